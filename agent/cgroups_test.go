package agent

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// cgroupAgent is fakeAgent answering the cgroup calls.
type cgroupAgent struct {
	*fakeAgent
	mu      sync.Mutex
	updated *pb.UpdateContainerRequest
	frozen  map[string]bool
	oom     chan string
}

func (a *cgroupAgent) UpdateContainer(_ context.Context, r *pb.UpdateContainerRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.updated = r
	return &emptypb.Empty{}, nil
}

func (a *cgroupAgent) StatsContainer(_ context.Context, r *pb.StatsContainerRequest) (*pb.StatsContainerResponse, error) {
	if r.GetContainerId() != "c1" {
		return nil, status.Errorf(codes.NotFound, "container %s not found", r.GetContainerId())
	}
	return &pb.StatsContainerResponse{CgroupStats: &pb.CgroupStats{
		CpuStats:    &pb.CpuStats{CpuUsage: &pb.CpuUsage{TotalUsage: 5000}},
		MemoryStats: &pb.MemoryStats{Usage: &pb.MemoryData{Usage: 4096, Limit: 1 << 20}},
	}}, nil
}

func (a *cgroupAgent) PauseContainer(_ context.Context, r *pb.PauseContainerRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.frozen[r.GetContainerId()] = true
	return &emptypb.Empty{}, nil
}

func (a *cgroupAgent) ResumeContainer(_ context.Context, r *pb.ResumeContainerRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.frozen[r.GetContainerId()] = false
	return &emptypb.Empty{}, nil
}

func (a *cgroupAgent) GetOOMEvent(ctx context.Context, _ *pb.GetOOMEventRequest) (*pb.OOMEvent, error) {
	select {
	case id := <-a.oom:
		return &pb.OOMEvent{ContainerId: id}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func TestCgroupCalls(t *testing.T) {
	a := &cgroupAgent{fakeAgent: &fakeAgent{status: pb.HealthCheckResponse_SERVING}, frozen: map[string]bool{}, oom: make(chan string, 1)}
	path := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterAgentServiceService(srv, a)
	pb.RegisterHealthService(srv, a)
	go srv.Serve(context.Background(), l)
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, SerialTransport{Path: path}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	if err := c.UpdateContainer(ctx, "c1", &pb.LinuxResources{Memory: &pb.LinuxMemory{Limit: 64 << 20}}); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	if a.updated.GetContainerId() != "c1" || a.updated.GetResources().GetMemory().GetLimit() != 64<<20 {
		t.Errorf("update reached the agent as %v", a.updated)
	}
	a.mu.Unlock()
	st, err := c.StatsContainer(ctx, "c1")
	if err != nil || st.GetCgroupStats().GetCpuStats().GetCpuUsage().GetTotalUsage() != 5000 || st.GetCgroupStats().GetMemoryStats().GetUsage().GetLimit() != 1<<20 {
		t.Errorf("stats %v %v", st, err)
	}
	if _, err := c.StatsContainer(ctx, "nope"); status.Code(errors.Unwrap(err)) != codes.NotFound {
		t.Errorf("stats of an unknown container: %v", err)
	}
	if err := c.PauseContainer(ctx, "c1"); err != nil || !a.frozen["c1"] {
		t.Errorf("pause: %v %v", err, a.frozen)
	}
	if err := c.ResumeContainer(ctx, "c1"); err != nil || a.frozen["c1"] {
		t.Errorf("resume: %v %v", err, a.frozen)
	}
	a.oom <- "c1"
	if id, err := c.GetOOMEvent(ctx); err != nil || id != "c1" {
		t.Errorf("OOM event %q %v", id, err)
	}
	// GetOOMEvent blocks until an event or the caller gives up.
	short, scancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer scancel()
	if _, err := c.GetOOMEvent(short); err == nil {
		t.Error("GetOOMEvent returned without an event")
	}
}
