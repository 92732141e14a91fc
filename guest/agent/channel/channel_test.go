package channel

import (
	"context"
	"encoding/binary"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"

	hostagent "github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// health answers the health checks the tests make over a session.
type health struct{}

func (health) Check(context.Context, *pb.CheckRequest) (*pb.HealthCheckResponse, error) {
	return &pb.HealthCheckResponse{Status: pb.HealthCheckResponse_SERVING}, nil
}

func (health) Version(context.Context, *pb.CheckRequest) (*pb.VersionCheckResponse, error) {
	return &pb.VersionCheckResponse{AgentVersion: "channel-test"}, nil
}

// hangLimit bounds waits that would otherwise block for ever when the code
// under test is wrong; it is a failure message, not a speed assertion.
const hangLimit = 10 * time.Second

// fifoPort stands in for a virtio-serial port (mock: the real one exists only
// in a guest, where test/guest boots it): reads come from a FIFO, which like
// the port reads EOF while no host (writer) is connected and data again once
// one is; replies go out through a pipe.
type fifoPort struct {
	fifo           string
	replyR, replyW int
}

func newFifoPort(t *testing.T) (*fifoPort, *serialListener) {
	t.Helper()
	fp := &fifoPort{fifo: filepath.Join(t.TempDir(), "port")}
	if err := unix.Mkfifo(fp.fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	rfd, err := unix.Open(fp.fifo, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	fp.replyR, fp.replyW = p[0], p[1]
	t.Cleanup(func() { unix.Close(rfd); unix.Close(p[0]); unix.Close(p[1]) })
	l := newSerialListener(fp.fifo)
	l.open = func() (int, int, error) { return rfd, fp.replyW, nil }
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	pb.RegisterHealthService(srv, health{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(context.Background(), l)
	}()
	t.Cleanup(func() {
		srv.Close()
		select {
		case <-done:
		case <-time.After(hangLimit):
			t.Errorf("Serve on the serial listener did not return within %v of Close", hangLimit)
		}
	})
	return fp, l
}

// DialContext implements agent.Transport: one host connection.
func (fp *fifoPort) DialContext(context.Context) (net.Conn, error) {
	w, err := os.OpenFile(fp.fifo, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	rfd, err := unix.Dup(fp.replyR)
	if err != nil {
		w.Close()
		return nil, err
	}
	return &hostConn{r: os.NewFile(uintptr(rfd), "reply"), w: w}, nil
}

func (fp *fifoPort) String() string { return "fifo:" + fp.fifo }

type hostConn struct{ r, w *os.File }

func (c *hostConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *hostConn) Write(p []byte) (int, error)      { return c.w.Write(p) }
func (c *hostConn) Close() error                     { c.w.Close(); return c.r.Close() }
func (c *hostConn) LocalAddr() net.Addr              { return fileAddr("host") }
func (c *hostConn) RemoteAddr() net.Addr             { return fileAddr("guest") }
func (c *hostConn) SetDeadline(time.Time) error      { return nil }
func (c *hostConn) SetReadDeadline(time.Time) error  { return nil }
func (c *hostConn) SetWriteDeadline(time.Time) error { return nil }

func checkOn(t *testing.T, c *ttrpc.Client, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := pb.NewHealthClient(c).Check(ctx, &pb.CheckRequest{})
	if err != nil || resp.GetStatus() != pb.HealthCheckResponse_SERVING {
		t.Fatalf("%s: check: %v, %v", what, resp, err)
	}
}

func TestSerialSessionsSplitAtNewConnection(t *testing.T) {
	fp, _ := newFifoPort(t)
	connA, err := fp.DialContext(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	a := ttrpc.NewClient(connA)
	checkOn(t, a, "first connection")
	checkOn(t, a, "first connection again") // stream 3
	// The next host connection comes before the agent could see a hangup
	// (the FIFO keeps a writer throughout): its stream ids restart at 1.
	connB, err := fp.DialContext(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	b := ttrpc.NewClient(connB)
	checkOn(t, b, "connection after a missed hangup")
	checkOn(t, b, "connection after a missed hangup, again")
	b.Close()
	// A hangup the agent does see, then a reconnect.
	for i := range 3 {
		c, err := hostagent.Dial(context.Background(), fp, 20*time.Second)
		if err != nil {
			t.Fatalf("redial %d: %v", i, err)
		}
		c.Close()
	}
}

func TestSerialSessionRecoversFromTornFrame(t *testing.T) {
	fp, _ := newFifoPort(t)
	conn, err := fp.DialContext(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// A request header announcing 100 bytes, then a hangup after 20 of them.
	hdr := make([]byte, ttrpcHeaderLen+20)
	binary.BigEndian.PutUint32(hdr[0:4], 100)
	binary.BigEndian.PutUint32(hdr[4:8], 1)
	hdr[8] = ttrpcTypeRequest
	if _, err := conn.Write(hdr); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	c, err := hostagent.Dial(context.Background(), fp, 8*time.Second)
	if err != nil {
		t.Fatalf("dial after a torn frame: %v", err)
	}
	c.Close()
}

func TestSerialListenerOpenError(t *testing.T) {
	l := newSerialListener(filepath.Join(t.TempDir(), "missing"))
	if _, err := l.Accept(); err == nil {
		t.Fatal("Accept on a missing port succeeded")
	}
	l.Close()
	if _, err := l.Accept(); err == nil {
		t.Fatal("Accept after Close succeeded")
	}
}
