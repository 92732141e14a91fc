module github.com/kata-fsx/kata-fsx

go 1.26.0

require (
	github.com/BurntSushi/toml v1.6.0
	github.com/containerd/cgroups/v3 v3.1.3
	github.com/containerd/containerd/api v1.10.0
	github.com/containerd/containerd/v2 v2.2.9
	github.com/containerd/continuity v0.4.5
	github.com/containerd/errdefs v1.0.0
	github.com/containerd/errdefs/pkg v0.3.0
	github.com/containerd/fifo v1.1.0
	github.com/containerd/log v0.1.0
	github.com/containerd/ttrpc v1.2.10
	github.com/elastic/go-seccomp-bpf v1.6.0
	github.com/klauspost/compress v1.20.4
	github.com/opencontainers/go-digest v1.0.0
	github.com/opencontainers/image-spec v1.1.1
	github.com/opencontainers/runtime-spec v1.3.0
	github.com/prometheus/client_model v0.6.2
	github.com/prometheus/common v0.66.1
	github.com/schollz/progressbar/v3 v3.19.1
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	go.etcd.io/bbolt v1.4.3
	golang.org/x/crypto v0.54.0
	golang.org/x/image v0.48.0
	golang.org/x/net v0.57.0
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.82.1
	google.golang.org/protobuf v1.36.12
	k8s.io/cri-api v0.37.2
)

require (
	github.com/Microsoft/go-winio v0.6.2 // indirect
	github.com/Microsoft/hcsshim v0.14.1 // indirect
	github.com/containerd/platforms v1.0.0-rc.2 // indirect
	github.com/containerd/typeurl/v2 v2.2.3 // indirect
	github.com/gogo/protobuf v1.3.2 // indirect
	github.com/golang/groupcache v0.0.0-20241129210726-2c02b8208cf8 // indirect
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/kr/text v0.2.0 // indirect
	github.com/mitchellh/colorstring v0.0.0-20190213212951-d06e56a500db // indirect
	github.com/moby/sys/mountinfo v0.7.2 // indirect
	github.com/moby/sys/userns v0.1.0 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/rivo/uniseg v0.4.7 // indirect
	github.com/sirupsen/logrus v1.10.2 // indirect
	go.opencensus.io v0.24.0 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/sync v0.25.0 // indirect
	golang.org/x/term v0.45.0 // indirect
	golang.org/x/text v0.44.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260526163538-3dc84a4a5aaa // indirect
)
