package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/logtest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// fakeGuest stands in for the agent's port-forward service (a mock: the
// real one runs in a VM, which TestNetworkCRIWithCNI's port-forward step
// drives): its "pod" is a set of servers on 127.0.0.1 of the host.
type fakeGuest struct {
	mu      sync.Mutex
	ports   []uint16
	err     error
	changed chan struct{} // closed and replaced on each set
	watches int
}

func newFakeGuest() *fakeGuest { return &fakeGuest{changed: make(chan struct{})} }

func (g *fakeGuest) set(ports []uint16, err error) {
	g.mu.Lock()
	g.ports, g.err = ports, err
	close(g.changed)
	g.changed = make(chan struct{})
	g.mu.Unlock()
}

// WatchPorts reports the ports at once and on each set, and returns the
// error set, as a watch connection that breaks.
func (g *fakeGuest) WatchPorts(ctx context.Context, fn func([]uint16)) error {
	g.mu.Lock()
	g.watches++
	g.mu.Unlock()
	for {
		g.mu.Lock()
		ports, err, changed := slices.Clone(g.ports), g.err, g.changed
		g.mu.Unlock()
		if err != nil {
			return err
		}
		fn(ports)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}

func (g *fakeGuest) DialPort(ctx context.Context, port uint16) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", "127.0.0.1:"+strconv.Itoa(int(port)))
}

// server is a guest server that greets and then echoes.
func server(t *testing.T, greeting string) uint16 {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.WriteString(c, greeting)
				io.Copy(c, c)
			}()
		}
	}()
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// podSide is where the forwarder listens: 127.0.0.2 stands for the pod
// namespace's loopback, so the same port is free beside the "guest's".
func podSide(addr string) (net.Listener, error) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if !strings.HasPrefix(addr, "127.0.0.1:") {
		return nil, fmt.Errorf("forwarder listens on %s, want the pod's 127.0.0.1", addr)
	}
	return net.Listen("tcp4", "127.0.0.2:"+port)
}

func dialPod(port uint16) (net.Conn, error) {
	return net.DialTimeout("tcp4", "127.0.0.2:"+strconv.Itoa(int(port)), 5*time.Second)
}

func TestPortForwarder(t *testing.T) {
	a, b := server(t, "a\n"), server(t, "b\n")
	g := newFakeGuest()
	g.set([]uint16{a}, nil)
	var logged logtest.Lines
	f := &portForwarder{guest: g, listen: podSide, logf: logged.Logf}
	f.start(context.Background())
	stopped := false
	defer func() {
		if !stopped {
			f.stop()
		}
	}()
	waitPorts := func(want ...uint16) {
		t.Helper()
		testenv.Eventually(t, time.Minute, func() (bool, error) {
			if got := f.ports(); !slices.Equal(got, want) {
				return false, fmt.Errorf("forwarding %v, want %v", got, want)
			}
			return true, nil
		})
	}
	waitPorts(a)
	c, err := dialPod(a)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "ping")
	c.(*net.TCPConn).CloseWrite()
	if got, err := io.ReadAll(c); err != nil || string(got) != "a\nping" {
		t.Fatalf("through the forwarder: %q, %v", got, err)
	}
	c.Close()

	// A port that appears is forwarded; one that goes stops being
	// listened on, while a connection made through it goes on.
	held, err := dialPod(a)
	if err != nil {
		t.Fatal(err)
	}
	g.set([]uint16{b}, nil)
	waitPorts(b)
	if c, err := dialPod(a); err == nil {
		c.Close()
		t.Fatalf("port %d is still listened on after the guest closed it", a)
	}
	io.WriteString(held, "still")
	buf := make([]byte, len("a\nstill"))
	if _, err := io.ReadFull(held, buf); err != nil || string(buf) != "a\nstill" {
		t.Fatalf("the connection made before the port went: %q, %v", buf, err)
	}

	// A guest that stops answering keeps what is forwarded, and is said once.
	g.set([]uint16{b}, errors.New("agent gone"))
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		if n := strings.Count(logged.String(), "agent gone"); n != 1 {
			return false, fmt.Errorf("the failure logged %d times: %q", n, logged.String())
		}
		return true, nil
	})
	waitPorts(b)

	// Stop closes the listeners and the connections under way.
	f.stop()
	stopped = true
	if _, err := held.Read(make([]byte, 1)); err == nil {
		t.Fatal("a forwarded connection is still open after stop")
	}
	held.Close()
	if c, err := dialPod(b); err == nil {
		c.Close()
		t.Fatalf("port %d is still listened on after stop", b)
	}
}

// TestPortForwarderPortTaken: a port that cannot be listened on in the pod
// is said once and skipped; the others are forwarded.
func TestPortForwarderPortTaken(t *testing.T) {
	a, b := server(t, "a\n"), server(t, "b\n")
	taken, err := podSide("127.0.0.1:" + strconv.Itoa(int(a)))
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	g := newFakeGuest()
	g.set(sortedPorts(a, b), nil)
	var logged logtest.Lines
	f := &portForwarder{guest: g, listen: podSide, logf: logged.Logf}
	f.start(context.Background())
	defer f.stop()
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		if got := f.ports(); !slices.Equal(got, []uint16{b}) {
			return false, fmt.Errorf("forwarding %v, want [%d]", got, b)
		}
		return true, nil
	})
	// A later report (another port appeared) does not retry the taken port.
	c := server(t, "c\n")
	g.set(sortedPorts(a, b, c), nil)
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		if got, want := f.ports(), sortedPorts(b, c); !slices.Equal(got, want) {
			return false, fmt.Errorf("forwarding %v, want %v", got, want)
		}
		return true, nil
	})
	if n := strings.Count(logged.String(), fmt.Sprintf("port %d is not forwarded", a)); n != 1 {
		t.Fatalf("the taken port logged %d times: %q", n, logged.String())
	}
}

func sortedPorts(ps ...uint16) []uint16 {
	slices.Sort(ps)
	return ps
}
