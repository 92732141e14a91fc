package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// fakeAgent is an in-process stand-in for the guest agent (the real one,
// cmd/kata-fsx-agent, runs only inside a VM; test/guest boots it). It
// records requests and serves a scripted stdout.
type fakeAgent struct {
	// The calls a test does not make stay unimplemented: the nil interface
	// makes one panic, which fails the test that made it.
	pb.AgentServiceService

	mu        sync.Mutex
	status    pb.HealthCheckResponse_ServingStatus
	sandboxes []*pb.CreateSandboxRequest
	stdout    []byte
	stdin     []byte
	writes    []int
	signals   []uint32
}

func (f *fakeAgent) Check(context.Context, *pb.CheckRequest) (*pb.HealthCheckResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return &pb.HealthCheckResponse{Status: f.status}, nil
}

func (f *fakeAgent) Version(context.Context, *pb.CheckRequest) (*pb.VersionCheckResponse, error) {
	return &pb.VersionCheckResponse{AgentVersion: "fake"}, nil
}

func (f *fakeAgent) CreateSandbox(_ context.Context, r *pb.CreateSandboxRequest) (*emptypb.Empty, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sandboxes = append(f.sandboxes, r)
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) DestroySandbox(context.Context, *pb.DestroySandboxRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) CreateContainer(_ context.Context, r *pb.CreateContainerRequest) (*emptypb.Empty, error) {
	if r.GetOCI().GetProcess() == nil {
		return nil, status.Error(codes.InvalidArgument, "no process")
	}
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) StartContainer(_ context.Context, r *pb.StartContainerRequest) (*emptypb.Empty, error) {
	return nil, status.Errorf(codes.NotFound, "container %s not found", r.GetContainerId())
}

func (f *fakeAgent) RemoveContainer(context.Context, *pb.RemoveContainerRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) ExecProcess(context.Context, *pb.ExecProcessRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) SignalProcess(_ context.Context, r *pb.SignalProcessRequest) (*emptypb.Empty, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.signals = append(f.signals, r.GetSignal())
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) WaitProcess(context.Context, *pb.WaitProcessRequest) (*pb.WaitProcessResponse, error) {
	return &pb.WaitProcessResponse{Status: 3}, nil
}

func (f *fakeAgent) WriteStdin(_ context.Context, r *pb.WriteStreamRequest) (*pb.WriteStreamResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stdin = append(f.stdin, r.GetData()...)
	f.writes = append(f.writes, len(r.GetData()))
	return &pb.WriteStreamResponse{Len: uint32(len(r.GetData()))}, nil
}

func (f *fakeAgent) ReadStdout(_ context.Context, r *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := min(int(r.GetLen()), len(f.stdout))
	data := f.stdout[:n]
	f.stdout = f.stdout[n:]
	return &pb.ReadStreamResponse{Data: data}, nil
}

func (f *fakeAgent) ReadStderr(context.Context, *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	return &pb.ReadStreamResponse{}, nil
}

func (f *fakeAgent) CloseStdin(context.Context, *pb.CloseStdinRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

func (f *fakeAgent) TtyWinResize(context.Context, *pb.TtyWinResizeRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

// serveFake starts a fake agent on a fresh unix socket and returns its path.
func serveFake(t *testing.T, f *fakeAgent) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterAgentServiceService(srv, f)
	pb.RegisterHealthService(srv, f)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(context.Background(), l)
	}()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return path
}

func TestDialTimeoutNamesTransport(t *testing.T) {
	dir := t.TempDir()
	// A bound socket nobody accepts on refuses connections, like a QEMU that
	// has not created its chardev yet; a missing path is the other early state.
	refused := filepath.Join(dir, "refused.sock")
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: refused}); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{refused, filepath.Join(dir, "missing.sock")} {
		tr := SerialTransport{Path: path}
		const timeout = 300 * time.Millisecond
		start := time.Now()
		c, err := Dial(context.Background(), tr, timeout)
		if err == nil {
			c.Close()
			t.Fatalf("Dial(%s) succeeded with nobody listening", tr)
		}
		if elapsed := time.Since(start); elapsed < timeout {
			t.Errorf("Dial(%s) gave up after %s, before its %s timeout", tr, elapsed, timeout)
		}
		if !errors.Is(err, ErrUnreachable) {
			t.Errorf("error does not wrap ErrUnreachable: %v", err)
		}
		if !strings.Contains(err.Error(), path) {
			t.Errorf("error does not name the transport %s: %v", tr, err)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT) {
			t.Errorf("error does not carry the last connect error: %v", err)
		}
	}
}

// attemptsTransport is a transport that tells the test about each failed
// connection attempt, so a test can act between Dial's attempts without
// guessing how long they take.
type attemptsTransport struct {
	SerialTransport
	failed chan<- error // receives each attempt's error; must not block Dial forever
}

func (t attemptsTransport) DialContext(ctx context.Context) (net.Conn, error) {
	c, err := t.SerialTransport.DialContext(ctx)
	if err != nil {
		select {
		case t.failed <- err:
		default: // the test has seen what it waits for
		}
	}
	return c, err
}

func TestDialCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	failed := make(chan error, 1)
	go func() {
		// Cancel once Dial has failed an attempt and is waiting to retry.
		<-failed
		cancel()
	}()
	tr := attemptsTransport{SerialTransport{Path: filepath.Join(t.TempDir(), "none.sock")}, failed}
	_, err := Dial(ctx, tr, time.Minute)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("want context.Canceled, got %v", err)
	}
}

func TestDialRetriesUntilAgentAppears(t *testing.T) {
	f := &fakeAgent{status: pb.HealthCheckResponse_SERVING}
	path := filepath.Join(t.TempDir(), "late.sock")
	failed := make(chan error, 1)
	ready := make(chan string, 1)
	go func() {
		// The agent appears only after Dial found nobody there.
		<-failed
		// serveFake needs *testing.T on this goroutine only for cleanup; start
		// the listener by hand instead.
		l, err := net.Listen("unix", path)
		if err != nil {
			ready <- err.Error()
			return
		}
		srv, _ := ttrpc.NewServer()
		pb.RegisterHealthService(srv, f)
		t.Cleanup(func() { srv.Close() })
		go srv.Serve(context.Background(), l)
		ready <- ""
	}()
	c, err := Dial(context.Background(), attemptsTransport{SerialTransport{Path: path}, failed}, 10*time.Second)
	// Dial can only have connected to the listener the goroutine made.
	select {
	case msg := <-ready:
		if msg != "" {
			t.Fatal(msg)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("Dial returned (%v) but the agent never started listening", err)
	}
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	c.Close()
}

func TestDialRefusesNotServing(t *testing.T) {
	path := serveFake(t, &fakeAgent{status: pb.HealthCheckResponse_NOT_SERVING})
	_, err := Dial(context.Background(), SerialTransport{Path: path}, 200*time.Millisecond)
	if !errors.Is(err, ErrNotServing) || !errors.Is(err, ErrUnreachable) {
		t.Fatalf("want ErrNotServing and ErrUnreachable, got %v", err)
	}
}

func TestFakeAgentRoundTrips(t *testing.T) {
	f := &fakeAgent{status: pb.HealthCheckResponse_SERVING, stdout: []byte("hello world\n")}
	path := serveFake(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, SerialTransport{Path: path}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	want := &pb.CreateSandboxRequest{
		Hostname:  "pod",
		SandboxId: "sb1",
		Storages: []*pb.Storage{{
			Driver:     "virtio-fs",
			Source:     "kataShared",
			Fstype:     "virtiofs",
			MountPoint: "/run/kata-containers/shared/containers/",
		}},
	}
	if err := c.CreateSandbox(ctx, want); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	if len(f.sandboxes) != 1 || !proto.Equal(f.sandboxes[0], want) {
		t.Errorf("agent received %v, want %v", f.sandboxes, want)
	}
	f.mu.Unlock()

	err = c.CreateContainer(ctx, &pb.CreateContainerRequest{ContainerId: "c1", OCI: &pb.Spec{}})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("CreateContainer without process: want InvalidArgument status through the wrap, got %v", err)
	}
	err = c.StartContainer(ctx, "c9")
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "c9") {
		t.Errorf("StartContainer: want NotFound naming c9, got %v", err)
	}

	out, err := io.ReadAll(c.StreamReader(ctx, "c1", "", false))
	if err != nil || string(out) != "hello world\n" {
		t.Errorf("stdout = %q, %v", out, err)
	}
	if n, err := c.ReadStderr(ctx, "c1", "", make([]byte, 8)); n != 0 || err != io.EOF {
		t.Errorf("empty stderr: got %d, %v; want 0, EOF", n, err)
	}
	if n, err := c.WriteStdin(ctx, "c1", "", []byte("input")); n != 5 || err != nil {
		t.Errorf("WriteStdin = %d, %v", n, err)
	}
	if st, err := c.WaitProcess(ctx, "c1", ""); st != 3 || err != nil {
		t.Errorf("WaitProcess = %d, %v", st, err)
	}
	if err := c.SignalProcess(ctx, "c1", "", syscall.SIGTERM); err != nil {
		t.Error(err)
	}
	f.mu.Lock()
	if string(f.stdin) != "input" || len(f.signals) != 1 || f.signals[0] != uint32(syscall.SIGTERM) {
		t.Errorf("agent saw stdin %q signals %v", f.stdin, f.signals)
	}
	f.mu.Unlock()
	if err := c.DestroySandbox(ctx); err != nil {
		t.Error(err)
	}
}

func TestWriteStdinChunks(t *testing.T) {
	f := &fakeAgent{status: pb.HealthCheckResponse_SERVING}
	c, err := Dial(context.Background(), SerialTransport{Path: serveFake(t, f)}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	big := make([]byte, 2*maxChunk+12345)
	for i := range big {
		big[i] = byte(i)
	}
	if n, err := c.WriteStdin(context.Background(), "c1", "", big); n != len(big) || err != nil {
		t.Fatalf("WriteStdin = %d, %v", n, err)
	}
	if n, err := c.WriteStdin(context.Background(), "c1", "", nil); n != 0 || err != nil {
		t.Fatalf("empty WriteStdin = %d, %v", n, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Equal(f.writes, []int{maxChunk, maxChunk, 12345}) || !bytes.Equal(f.stdin, big) {
		t.Errorf("agent saw writes of %v bytes (content equal: %v)", f.writes, bytes.Equal(f.stdin, big))
	}
}

func TestVsockTransportString(t *testing.T) {
	if got := (VsockTransport{CID: 3}).String(); got != "vsock://3:1024" {
		t.Errorf("String() = %q", got)
	}
}

func TestVsockDialFailsCleanly(t *testing.T) {
	if _, err := os.Stat("/dev/vsock"); err != nil {
		// Not a missing package: hosts without a vsock transport (these
		// CI machines among them) cannot open AF_VSOCK at all.
		t.Skip("no /dev/vsock on this host: AF_VSOCK unavailable")
	}
	// CID 2 is the host; nothing of ours listens on this port there.
	_, err := Dial(context.Background(), VsockTransport{CID: 2, Port: 40999}, 200*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "vsock://2:40999") {
		t.Fatalf("want an error naming vsock://2:40999, got %v", err)
	}
}

// TestDialRetriesLostCheck has the first connection swallow its health
// check, as a virtio-serial guest does that drops a request arriving while it
// still tears down an earlier host connection: Dial must give that attempt up
// within its share of the timeout, close it, and succeed on a new connection.
func TestDialRetriesLostCheck(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterHealthService(srv, &fakeAgent{status: pb.HealthCheckResponse_SERVING})
	served := make(chan struct{})
	go func() {
		defer close(served)
		first, err := l.Accept()
		if err != nil {
			return
		}
		// Read and drop everything until the client hangs up; like QEMU's
		// chardev, serve the next connection only after that, so a Dial
		// that kept the first connection open could not succeed.
		_, _ = io.Copy(io.Discard, first)
		first.Close()
		_ = srv.Serve(context.Background(), l)
	}()
	t.Cleanup(func() {
		srv.Close()
		l.Close()
		<-served
	})
	c, err := Dial(context.Background(), SerialTransport{Path: path}, 8*time.Second)
	if err != nil {
		t.Fatalf("Dial after a lost check: %v", err)
	}
	c.Close()
}
