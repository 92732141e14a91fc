package process

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// hangLimit bounds waits that would otherwise block for ever when the code
// under test is wrong; it is a failure message, not a speed assertion.
const hangLimit = 10 * time.Second

// within waits for ch to be closed, failing the test with what if it is
// not within hangLimit.
func within(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(hangLimit):
		t.Fatalf("%s within %v", what, hangLimit)
	}
}

func TestOutputBuffer(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b := newOutputBuffer()
	go b.fill(r, make(chan struct{}))
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	go func() {
		w.Write([]byte("hello "))
		w.Write([]byte("world"))
		w.Close()
	}()
	var got []byte
	for {
		data, err := b.read(ctx, 4)
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("no data or end of stream within %v after %q", hangLimit, got)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(data) > 4 {
			t.Fatalf("read returned %d bytes for a 4-byte request", len(data))
		}
		if len(data) == 0 {
			break
		}
		got = append(got, data...)
	}
	if string(got) != "hello world" {
		t.Errorf("got %q", got)
	}
	// After EOF every read is an immediate empty answer.
	if data, err := b.read(ctx, 10); len(data) != 0 || err != nil {
		t.Errorf("read after EOF: %q, %v", data, err)
	}

	idle := newOutputBuffer()
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := idle.read(cctx, 10); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("read with nothing written: %v, want deadline exceeded", err)
	}
}

func TestOutputBufferBackpressure(t *testing.T) {
	b := newOutputBuffer()
	blocked := make(chan struct{})
	b.waiting = sync.OnceFunc(func() { close(blocked) })
	done := make(chan struct{})
	go func() {
		stop := make(chan struct{})
		b.append(make([]byte, maxBuffered), stop)
		b.append([]byte("x"), stop) // must wait for a reader
		close(done)
	}()
	select {
	case <-blocked:
	case <-done:
		t.Fatal("append went past maxBuffered without a reader")
	case <-time.After(hangLimit):
		t.Fatalf("append neither waited for a reader nor returned within %v", hangLimit)
	}
	// Only a reader (or stop, which nobody closes) releases the wait.
	select {
	case <-done:
		t.Fatal("append went past maxBuffered without a reader")
	default:
	}
	if _, err := b.read(context.Background(), 1<<20); err != nil {
		t.Fatal(err)
	}
	within(t, done, "append did not return after a reader emptied the buffer")
}

// TestOutputBufferCut checks that cutting a stream a descendant holds open
// still delivers what is in the pipe, even past a full buffer.
func TestOutputBufferCut(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close() // the "descendant" keeps the write end open
	b := newOutputBuffer()
	b.append(make([]byte, maxBuffered), nil) // full: the copier will block
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { b.fill(r, stop); close(done) }()
	if _, err := w.Write([]byte("tail")); err != nil {
		t.Fatal(err)
	}
	close(stop)
	if err := r.SetReadDeadline(time.Now()); err != nil {
		t.Fatal(err)
	}
	within(t, done, "fill did not end after the stream was cut")
	var got []byte
	for {
		data, err := b.read(context.Background(), 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if len(data) == 0 {
			break
		}
		got = append(got, data...)
	}
	if len(got) != maxBuffered+4 || string(got[maxBuffered:]) != "tail" {
		t.Errorf("got %d bytes ending %q, want %d ending \"tail\"", len(got), got[max(0, len(got)-4):], maxBuffered+4)
	}
}

// TestProcessOutputComplete runs real processes through process.start and
// checks that the whole output arrives, and that a descendant holding stdout
// open does not keep the process from being reaped.
func TestProcessOutputComplete(t *testing.T) {
	sh := testenv.Tool(t, "sh", "dash")
	for i := range 20 {
		p := New(fmt.Sprint("p", i))
		cmd := exec.Command(sh, "-c", "i=0; while [ $i -lt 2000 ]; do echo line$i; i=$((i+1)); done; echo err >&2; exit 4")
		if err := p.start(cmd, cmd.Start); err != nil {
			t.Fatal(err)
		}
		out, errOut := readBuffer(t, p.stdout), readBuffer(t, p.stderr)
		within(t, p.done, fmt.Sprintf("run %d: not reaped", i))
		if p.status != 4 || !strings.HasSuffix(out, "line1999\n") || strings.Count(out, "\n") != 2000 || errOut != "err\n" {
			t.Fatalf("run %d: status %d, %d lines ending %q, stderr %q", i, p.status, strings.Count(out, "\n"), out[max(0, len(out)-20):], errOut)
		}
	}
	// The descendant outlives hangLimit, so a stream it keeps open fails
	// the bounded waits below instead of ending when it does.
	p := New("bg")
	cmd := exec.Command(sh, "-c", "echo fg; sleep 30 & exit 0")
	if err := p.start(cmd, cmd.Start); err != nil {
		t.Fatal(err)
	}
	within(t, p.done, "a descendant holding stdout kept the process from being reaped")
	if out := readBuffer(t, p.stdout); out != "fg\n" {
		t.Errorf("with a descendant holding stdout: %q, want fg", out)
	}
	if p.stdin.Load() != nil {
		t.Error("stdin still open after exit")
	}
}

// readBuffer reads b to its end, failing the test if the end does not come
// within hangLimit.
func readBuffer(t *testing.T, b *outputBuffer) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	var got []byte
	for {
		data, err := b.read(ctx, 4096)
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("stream did not end within %v; read %d bytes", hangLimit, len(got))
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(data) == 0 {
			return string(got)
		}
		got = append(got, data...)
	}
}
