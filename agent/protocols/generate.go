// Package protocols holds the Kata guest agent protocol (services
// grpc.AgentService and grpc.Health) as generated Go and ttrpc code.
//
// The .proto files are ours, reduced to what kata-fsx uses, with Kata's
// message names and field numbers so a real kata-agent understands them.
// The package is over 2,500 lines because it is generated code; its size
// follows the .proto files, not anything written here by hand.
// Regenerate with Debian's protoc (protobuf-compiler, libprotobuf-dev) and
// the plugins installed into build/tools (protoc-gen-go v1.36.12, protoc-gen-go-ttrpc v1.2.10):
//
//	GOBIN=$PWD/build/tools go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	GOBIN=$PWD/build/tools go install github.com/containerd/ttrpc/cmd/protoc-gen-go-ttrpc@v1.2.10
//	go generate ./agent/protocols
package protocols

//go:generate env PATH=../../build/tools:/usr/bin:/bin protoc -I . -I /usr/include --go_out=. --go_opt=paths=source_relative --go-ttrpc_out=. --go-ttrpc_opt=paths=source_relative agent.proto health.proto oci.proto types.proto
