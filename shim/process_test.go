package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/fifo"
	"golang.org/x/sys/unix"
)

// recordingSink stands in for the guest agent: it records what the pump
// forwards and in which order stdin was closed.
type recordingSink struct {
	mu     sync.Mutex
	data   strings.Builder
	closes int
	atEnd  string // data seen when stdin was closed
}

func (r *recordingSink) WriteStdin(_ context.Context, _, _ string, b []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.data.Write(b)
	return len(b), nil
}

func (r *recordingSink) CloseStdin(context.Context, string, string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closes++
	r.atEnd = r.data.String()
	return nil
}

// TestStdinPumpDrainsBeforeClose is the race behind `ctr tasks exec` with
// piped stdin losing its input: ctr writes into the fifo and sends CloseIO
// at once, possibly before the pump has even opened the fifo. What was
// written must reach the process before its stdin is closed.
func TestStdinPumpDrainsBeforeClose(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	path := filepath.Join(t.TempDir(), "stdin")
	if err := unix.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	// Opened as startIO does: in the background, completing once a writer comes.
	r, err := fifo.OpenFifo(ctx, path, syscall.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	const input = "piped\nlines\n"
	if _, err := w.WriteString(input); err != nil {
		t.Fatal(err)
	}
	raw, err := r.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	polling := make(chan struct{}, 1)
	pump := &stdinPump{raw: raw, done: make(chan struct{}), polling: polling}
	sink := &recordingSink{}

	// CloseIO arrives before the pump goroutine has run at all.
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		if pump.drained(ctx, 10*time.Second) {
			_ = sink.CloseStdin(ctx, "c", "e")
		}
	}()
	// The pump starts only once CloseIO has seen the fifo not yet opened.
	select {
	case <-polling:
	case <-time.After(10 * time.Second):
		t.Fatal("CloseIO never waited for the pump")
	}
	go pump.run(ctx, sink, "c", "e")

	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		t.Fatal("CloseIO did not return")
	}
	sink.mu.Lock()
	got, atEnd, closes := sink.data.String(), sink.atEnd, sink.closes
	sink.mu.Unlock()
	if closes != 1 || atEnd != input {
		t.Fatalf("stdin closed %d times, with %q forwarded first; want once, after %q", closes, atEnd, input)
	}
	if got != input {
		t.Fatalf("forwarded %q, want %q", got, input)
	}
	// ctr closes its end after CloseIO; the pump ends without closing again.
	w.Close()
	select {
	case <-pump.done:
	case <-time.After(10 * time.Second):
		t.Fatal("pump did not end after the writer closed the fifo")
	}
	if sink.closes != 1 {
		t.Fatalf("stdin closed %d times, want 1", sink.closes)
	}
}
