package agent

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// fakeHybridVsock stands in for a hybrid vsock's unix socket (kata-fsx's
// vhost-user-vsock device, Firecracker, Cloud Hypervisor): it reads the
// CONNECT line and hands the connection to a scripted reply.
type fakeHybridVsock struct {
	path string
	mu   sync.Mutex
	// connects are the CONNECT lines received, without the newline.
	connects []string
}

// serveFakeHybridVsock listens on a fresh socket; reply runs for each
// connection once its CONNECT line has been read.
func serveFakeHybridVsock(t *testing.T, reply func(c net.Conn)) *fakeHybridVsock {
	t.Helper()
	f := &fakeHybridVsock{path: filepath.Join(t.TempDir(), "hybrid.sock")}
	l, err := net.Listen("unix", f.path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				// The client writes only the CONNECT line before the
				// reply, so a buffered read cannot take stream bytes here.
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					return
				}
				f.mu.Lock()
				f.connects = append(f.connects, strings.TrimSuffix(line, "\n"))
				f.mu.Unlock()
				reply(c)
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		wg.Wait()
	})
	return f
}

func (f *fakeHybridVsock) lines() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.connects...)
}

func writeAndHold(s string) func(net.Conn) {
	return func(c net.Conn) {
		io.WriteString(c, s)
		// Keep the connection open until the client is done with it.
		io.Copy(io.Discard, c)
	}
}

func dialHybrid(t *testing.T, tr HybridVsockTransport) (net.Conn, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return tr.DialContext(ctx)
}

func TestHybridVsockHandshakeOK(t *testing.T) {
	f := serveFakeHybridVsock(t, func(c net.Conn) {
		io.WriteString(c, "OK 1073741824\n")
		io.Copy(c, c) // the guest stream: an echo
	})
	tr := HybridVsockTransport{Path: f.path}
	if got, want := tr.String(), "hybrid-vsock:"+f.path+":1024"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	c, err := dialHybrid(t, tr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "ping"); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "ping" {
		t.Fatalf("stream after the handshake: %q, %v", b, err)
	}
	if got := f.lines(); len(got) != 1 || got[0] != "CONNECT 1024" {
		t.Errorf("CONNECT lines %q, want [CONNECT 1024]", got)
	}

	c2, err := dialHybrid(t, HybridVsockTransport{Path: f.path, Port: 2000})
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
	if got := f.lines(); len(got) != 2 || got[1] != "CONNECT 2000" {
		t.Errorf("CONNECT lines %q, want a second CONNECT 2000", got)
	}
}

// TestHybridVsockKeepsStreamBytes: the guest's first bytes can arrive in
// the same segment as the reply; they belong to the stream.
func TestHybridVsockKeepsStreamBytes(t *testing.T) {
	f := serveFakeHybridVsock(t, writeAndHold("OK 5\nguest-bytes"))
	c, err := dialHybrid(t, HybridVsockTransport{Path: f.path})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := make([]byte, len("guest-bytes"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "guest-bytes" {
		t.Fatalf("stream bytes sent with the reply: %q, %v", b, err)
	}
}

func TestHybridVsockHandshakeFailures(t *testing.T) {
	cases := []struct {
		name  string
		reply func(net.Conn)
		want  []string
	}{
		{"refused", func(net.Conn) {}, []string{"refused", "closed after \"\"", "port 1024"}},
		{"eof mid-line", func(c net.Conn) { io.WriteString(c, "OK 1") }, []string{"refused", `"OK 1"`}},
		{"garbage", writeAndHold("ERR no listener\n"), []string{`want "OK <port>"`, `"ERR no listener"`}},
		{"ok without port", writeAndHold("OK\n"), []string{`got "OK"`}},
		{"port out of range", writeAndHold("OK 4294967296\n"), []string{`got "OK 4294967296"`}},
		{"overlong", writeAndHold(strings.Repeat("A", 4096)), []string{"longer than 32 bytes"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := serveFakeHybridVsock(t, tc.reply)
			c, err := dialHybrid(t, HybridVsockTransport{Path: f.path})
			if err == nil {
				c.Close()
				t.Fatal("handshake accepted")
			}
			for _, w := range append(tc.want, f.path, "CONNECT 1024") {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestHybridVsockNoSocket(t *testing.T) {
	p := filepath.Join(t.TempDir(), "none.sock")
	_, err := dialHybrid(t, HybridVsockTransport{Path: p})
	if err == nil || !strings.Contains(err.Error(), p) {
		t.Fatalf("dial of a missing socket: %v", err)
	}
}

// TestHybridVsockCancelDuringHandshake: a device that never answers does
// not hold the dial beyond its context.
func TestHybridVsockCancelDuringHandshake(t *testing.T) {
	f := serveFakeHybridVsock(t, writeAndHold(""))
	for _, deadline := range []bool{false, true} {
		var ctx context.Context
		var cancel context.CancelFunc
		if deadline {
			ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
		} else {
			ctx, cancel = context.WithCancel(context.Background())
			time.AfterFunc(100*time.Millisecond, cancel)
		}
		start := time.Now()
		c, err := HybridVsockTransport{Path: f.path}.DialContext(ctx)
		cancel()
		if err == nil {
			c.Close()
			t.Fatal("handshake without a reply accepted")
		}
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("deadline %v: error %v is not the context's", deadline, err)
		}
		if el := time.Since(start); el > 3*time.Second {
			t.Errorf("deadline %v: the dial took %s after the context ended", deadline, el)
		}
	}
}

// TestDialAgentOverHybridVsock: the client reaches a ttrpc agent behind
// the handshake, as it will reach the guest's.
func TestDialAgentOverHybridVsock(t *testing.T) {
	agentSock := serveFake(t, &fakeAgent{status: pb.HealthCheckResponse_SERVING})
	f := serveFakeHybridVsock(t, func(c net.Conn) {
		g, err := net.Dial("unix", agentSock)
		if err != nil {
			return
		}
		defer g.Close()
		io.WriteString(c, "OK 1025\n")
		go func() {
			io.Copy(g, c)
			g.Close() // the client hung up: end the copy below too
		}()
		io.Copy(c, g)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := Dial(ctx, HybridVsockTransport{Path: f.path}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "hv"}); err != nil {
		t.Fatalf("CreateSandbox over the hybrid vsock: %v", err)
	}
}
