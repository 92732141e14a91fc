package agent

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

// guestForward plays the guest's port-forward service behind a fake
// hybrid vsock: it answers WATCH with list and closes, and TCP requests
// with an upper-casing echo.
func guestForward(list string) func(net.Conn) {
	return func(c net.Conn) {
		io.WriteString(c, "OK 1073741824\n") // the hybrid vsock's handshake
		req, err := portfwd.ReadRequest(c)
		if err != nil {
			return
		}
		if req.Watch {
			io.WriteString(c, list)
			return
		}
		io.WriteString(c, "OK\n")
		b, _ := io.ReadAll(c)
		c.Write([]byte(strings.ToUpper(string(b))))
	}
}

func TestForwardOverHybridVsock(t *testing.T) {
	f := serveFakeHybridVsock(t, guestForward("OK 80 8080\nOK 22\n"))
	c := &Client{transport: HybridVsockTransport{Path: f.path}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var seen [][]uint16
	err := c.WatchPorts(ctx, func(ports []uint16) { seen = append(seen, ports) })
	if err == nil || len(seen) != 2 || !slices.Equal(seen[0], []uint16{80, 8080}) || !slices.Equal(seen[1], []uint16{22}) {
		t.Fatalf("WatchPorts: saw %v, then %v; want [80 8080], [22], then the end of the connection", seen, err)
	}
	conn, err := c.DialPort(ctx, 8080)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "stream")
	conn.(interface{ CloseWrite() error }).CloseWrite()
	if b, err := io.ReadAll(conn); err != nil || string(b) != "STREAM" {
		t.Fatalf("stream: %q, %v", b, err)
	}
	want := []string{"CONNECT 1027", "CONNECT 1027"}
	if got := f.lines(); !slices.Equal(got, want) {
		t.Fatalf("CONNECT lines %q, want %q (the service's port, not the agent's)", got, want)
	}
}

// TestForwardHostileReplies: a guest's reply that is not the format is an
// error, and one that never ends is cut by the context.
func TestForwardHostileReplies(t *testing.T) {
	for _, reply := range []string{"OK 80 80\n", "OK 0\n", "HTTP/1.1 200 OK\n", "OK 99999\n", strings.Repeat("OK ", 10000) + "\n"} {
		f := serveFakeHybridVsock(t, guestForward(reply))
		c := &Client{transport: HybridVsockTransport{Path: f.path}}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var seen [][]uint16
		err := c.WatchPorts(ctx, func(ports []uint16) { seen = append(seen, ports) })
		cancel()
		if len(seen) > 0 || err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("reply %.30q: accepted as %v (%v)", reply, seen, err)
		}
	}
	f := serveFakeHybridVsock(t, writeAndHold("OK 1073741824\nOK 80"))
	c := &Client{transport: HybridVsockTransport{Path: f.path}}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := c.WatchPorts(ctx, func([]uint16) {}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a reply without its newline: %v, want the context's deadline", err)
	}
	f = serveFakeHybridVsock(t, func(c net.Conn) {
		io.WriteString(c, "OK 1073741824\n")
		bufio.NewReader(c).ReadString('\n')
		io.WriteString(c, "ERR nothing in the pod listens on TCP port 81\n")
	})
	c = &Client{transport: HybridVsockTransport{Path: f.path}}
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.DialPort(ctx, 81); !errors.Is(err, portfwd.ErrRefused) || !strings.Contains(err.Error(), "TCP 81") {
		t.Fatalf("a refused port: %v", err)
	}
}

func TestForwardNeedsVsock(t *testing.T) {
	c := &Client{transport: SerialTransport{Path: "/nonexistent"}}
	if err := c.WatchPorts(context.Background(), func([]uint16) {}); !errors.Is(err, ErrNoForward) {
		t.Fatalf("virtio-serial: %v, want ErrNoForward", err)
	}
}
