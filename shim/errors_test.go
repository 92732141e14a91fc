package shim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"

	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kata-fsx/kata-fsx/sandbox"
)

// Errors reach containerd in their errdefs class: containerd's side of
// the ttrpc connection (errgrpc.ToNative) finds a not-found exec and a
// task in the wrong state as such, with the shim's message.
func TestErrorsReachContainerdClassified(t *testing.T) {
	s := newTestService(t)
	s.containers["c1"] = &container{id: "c1", execs: map[string]*process{}, init: newProcess("c1", "", "c1", stdio{})}
	sock := filepath.Join(t.TempDir(), "shim.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	taskapi.RegisterTaskService(srv, s)
	go srv.Serve(context.Background(), ln)
	defer srv.Close()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	client := ttrpc.NewClient(conn)
	defer client.Close()
	task := taskapi.NewTaskClient(client)
	ctx := context.Background()

	_, err = task.State(ctx, &taskapi.StateRequest{ID: "c1", ExecID: "nope"})
	if err := errgrpc.ToNative(err); !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "nope") {
		t.Errorf("State of an unknown exec: %v, want not found naming it", err)
	}
	_, err = task.Pause(ctx, &taskapi.PauseRequest{ID: "c1"})
	if err := errgrpc.ToNative(err); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "created state") {
		t.Errorf("Pause of a created task: %v, want a failed precondition naming the state", err)
	}
	_, err = task.Start(ctx, &taskapi.StartRequest{ID: "c1", ExecID: "nope"})
	if err := errgrpc.ToNative(err); !errdefs.IsNotFound(err) {
		t.Errorf("Start of an unknown exec: %v, want not found", err)
	}
}

// The sandbox's errors carry their class to containerd; an agent's status
// passes as it is; an error of no class is Unknown.
func TestToGRPC(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want codes.Code
	}{
		{"sandbox state", fmt.Errorf("container c1: %w", &sandbox.StateError{ID: "p", Op: "create container c1", State: sandbox.StateStopping}), codes.FailedPrecondition},
		{"sandbox failed", fmt.Errorf("%w: p: QEMU exited", sandbox.ErrFailed), codes.Unavailable},
		{"invalid id", sandbox.ValidID("a/b"), codes.InvalidArgument},
		{"agent status", fmt.Errorf("agent ExecProcess: %w", status.Error(codes.NotFound, "no such file")), codes.NotFound},
		{"unclassified", errors.New("boom"), codes.Unknown},
		{"cancelled", context.Canceled, codes.Canceled},
	} {
		err := tc.err
		toGRPC(&err)
		if got := status.Code(err); got != tc.want {
			t.Errorf("%s: %v is %s, want %s", tc.name, err, got, tc.want)
		}
		if tc.want != codes.Unknown && !strings.Contains(err.Error(), tc.err.Error()) {
			t.Errorf("%s: message %q lost %q", tc.name, err, tc.err)
		}
	}
	var err error
	toGRPC(&err)
	if err != nil {
		t.Errorf("nil became %v", err)
	}
}
