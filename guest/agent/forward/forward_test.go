package forward

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

// A table as Linux prints it: 127.0.0.1:8080 and 0.0.0.0:22 listening,
// one established connection, and in tcp6 [::]:443 and [::1]:9000.
const (
	tcp4 = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
`
	tcp6 = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:01BB 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:2328 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5 1 0000000000000000 100 0 0 10 0
`
)

func TestParseTable(t *testing.T) {
	l4, err := ParseTable(strings.NewReader(tcp4))
	if err != nil {
		t.Fatal(err)
	}
	l6, err := ParseTable(strings.NewReader(tcp6))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range append(l4, l6...) {
		got = append(got, l.Addr.String())
	}
	want := []string{"127.0.0.1:8080", "0.0.0.0:22", "[::]:443", "[::1]:9000"}
	if !slices.Equal(got, want) {
		t.Fatalf("listeners %v, want %v", got, want)
	}
	if p := Ports(append(l4, l6...)); !slices.Equal(p, []uint16{22, 443, 8080, 9000}) {
		t.Fatalf("ports %v", p)
	}
	for _, bad := range []string{
		"h\n 0: 0100007F:1F9 00000000:0000 0A\n",
		"h\n 0: 0100007G:1F90 00000000:0000 0A\n",
		"h\n 0: 01007F:1F90 00000000:0000 0A\n",
		"h\n 0: 0100007F 00000000:0000 0A\n",
	} {
		if ls, err := ParseTable(strings.NewReader(bad)); err == nil {
			t.Errorf("%q: parsed as %v", bad, ls)
		}
	}
}

// FuzzParseTable: any table parses to listeners or an error, never a panic.
func FuzzParseTable(f *testing.F) {
	f.Add([]byte(tcp4))
	f.Add([]byte(tcp6))
	f.Fuzz(func(t *testing.T, b []byte) {
		ls, err := ParseTable(bytes.NewReader(b))
		if err == nil && len(Ports(ls)) > portfwd.MaxPorts {
			t.Fatal("more ports than MaxPorts")
		}
	})
}

// serve runs a Server on a unix socket, as the agent does on its vsock
// port, and returns a dialer for it.
func serve(t *testing.T) func() net.Conn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fwd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- (&Server{Logf: t.Logf}).Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return func() net.Conn {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
}

// TestServe lists this host's own listeners and forwards to one of them
// through the real socket tables: an echo server that upper-cases, reached
// as TCP <port>, both half-closes passed on.
func TestServe(t *testing.T) {
	echo, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				c.Write(bytes.ToUpper(b))
			}()
		}
	}()
	port := uint16(echo.Addr().(*net.TCPAddr).Port)
	dial := serve(t)

	c := dial()
	c.Write(portfwd.Request{Watch: true}.Marshal())
	ports, err := portfwd.ReadReply(c)
	if err != nil || !slices.Contains(ports, port) {
		t.Fatalf("WATCH: %v, %v; want the echo server's port %d", ports, err, port)
	}
	// A server that starts listening is reported by the watch, and
	// again when it stops.
	late, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	latePort := uint16(late.Addr().(*net.TCPAddr).Port)
	c.SetReadDeadline(time.Now().Add(time.Minute))
	for !slices.Contains(ports, latePort) {
		if ports, err = portfwd.ReadReply(c); err != nil {
			t.Fatalf("WATCH after a new listener: %v", err)
		}
	}
	late.Close()
	for slices.Contains(ports, latePort) {
		if ports, err = portfwd.ReadReply(c); err != nil {
			t.Fatalf("WATCH after the listener closed: %v", err)
		}
	}
	c.Close()

	c = dial()
	defer c.Close()
	c.Write(portfwd.Request{Port: port}.Marshal())
	if _, err := portfwd.ReadReply(c); err != nil {
		t.Fatalf("TCP %d: %v", port, err)
	}
	c.Write([]byte("hello through the guest"))
	c.(*net.UnixConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "HELLO THROUGH THE GUEST" {
		t.Fatalf("stream: %q, %v", got, err)
	}
}

func TestServeRefuses(t *testing.T) {
	// A port nothing listens on: take one and close it.
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	dial := serve(t)
	for _, req := range []string{portfwd.Request{Port: port}.String(), "TCP 0", "GET / HTTP/1.0"} {
		c := dial()
		c.Write([]byte(req + "\n"))
		_, err := portfwd.ReadReply(c)
		c.Close()
		if !errors.Is(err, portfwd.ErrRefused) {
			t.Errorf("%q: %v, want a refusal", req, err)
		}
	}
}

func TestDialListenerPrefersLoopback(t *testing.T) {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	// An address no one answers on comes first in the table; the
	// loopback listener is still the one dialled.
	ls := []Listener{
		{Addr: netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), port)},
		{Addr: netip.AddrPortFrom(netip.IPv4Unspecified(), port)},
	}
	c, err := dialListener(context.Background(), ls, port)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := dialListener(context.Background(), ls, port+1); err == nil || !strings.Contains(err.Error(), "nothing in the pod listens") {
		t.Fatalf("a port with no listener: %v", err)
	}
}
