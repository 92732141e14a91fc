package shim

import (
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"testing"

	versionapi "github.com/containerd/containerd/api/services/version/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/emptypb"
)

// versionServer answers containerd's Version call with a fixed release.
type versionServer struct {
	versionapi.UnimplementedVersionServer
	version string
}

func (v versionServer) Version(context.Context, *emptypb.Empty) (*versionapi.VersionResponse, error) {
	return &versionapi.VersionResponse{Version: v.version, Revision: "test"}, nil
}

// serveVersion serves containerd's Version service on a unix socket, as
// containerd's gRPC socket does, and returns its path.
func serveVersion(t *testing.T, version string) string {
	sock := filepath.Join(t.TempDir(), "containerd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	versionapi.RegisterVersionServer(srv, versionServer{version: version})
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return sock
}

// TestStartResponse: containerd 2.x gets the bootstrap parameters of Task
// API v3; 1.6 and 1.7 (which refuse version 3), and a containerd that
// cannot be asked, get the plain address every version reads.
func TestStartResponse(t *testing.T) {
	const addr = "unix:///run/kata-fsx/s/abc"
	for _, tc := range []struct{ version, want string }{
		{"2.2.9", `{"version":3,"address":"unix:///run/kata-fsx/s/abc","protocol":"ttrpc"}`},
		{"v2.0.0", `{"version":3,"address":"unix:///run/kata-fsx/s/abc","protocol":"ttrpc"}`},
		{"1.7.35", addr},
		{"1.6.20~ds1", addr},
		{"dev", addr},
	} {
		got := startResponse(context.Background(), serveVersion(t, tc.version), addr)
		if got != tc.want {
			t.Errorf("containerd %s: start printed %q, want %q", tc.version, got, tc.want)
		}
		var p bootstrapParams
		if tc.want != addr && json.Unmarshal([]byte(got), &p) != nil {
			t.Errorf("containerd %s: %q is not JSON", tc.version, got)
		}
	}
	if got := startResponse(context.Background(), filepath.Join(t.TempDir(), "none.sock"), addr); got != addr {
		t.Errorf("no containerd: start printed %q, want the plain address", got)
	}
}
