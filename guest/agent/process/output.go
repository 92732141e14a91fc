package process

import (
	"context"
	"errors"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// maxBuffered bounds how much unread output the agent keeps per stream;
// beyond it the copying goroutine waits, so the process blocks on its pipe
// as it would on a slow terminal.
const maxBuffered = 1 << 20

// outputBuffer holds a process's stdout or stderr between the pipe and the
// host's ReadStdout/ReadStderr calls.
type outputBuffer struct {
	// mu guards the fields below, a leaf lock: append and read wait for
	// changed (or stop, or their context) with mu released.
	mu      sync.Mutex
	data    []byte
	eof     bool
	changed chan struct{} // closed and replaced on every state change

	// waiting, when set (by tests, before any append), runs each time
	// append finds the buffer full and is about to wait for a reader.
	waiting func()
}

func newOutputBuffer() *outputBuffer {
	return &outputBuffer{changed: make(chan struct{})}
}

func (b *outputBuffer) notifyLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// fill copies the pipe r into the buffer until EOF, then marks the end.
// Closing stop cuts the stream short (a descendant of the exited process
// still holds the pipe): what is in the pipe at that point is still taken,
// without waiting for more and without the maxBuffered limit, so that no
// byte the process itself wrote is lost however late this goroutine runs.
// The caller sets a past read deadline on r together with closing stop.
func (b *outputBuffer) fill(r *os.File, stop <-chan struct{}) {
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			b.append(buf[:n], stop)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			b.drain(r, buf, stop)
		}
		if err != nil {
			break
		}
	}
	b.end()
}

// end marks the end of the stream: readers get what is left, then EOF.
func (b *outputBuffer) end() {
	b.mu.Lock()
	b.eof = true
	b.notifyLocked()
	b.mu.Unlock()
}

// drain takes what the pipe holds right now, without blocking: Control
// bypasses the expired deadline that made Read fail.
func (b *outputBuffer) drain(r *os.File, buf []byte, stop <-chan struct{}) {
	rc, err := r.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		for {
			n, err := unix.Read(int(fd), buf)
			if n > 0 {
				b.append(buf[:n], stop)
				continue
			}
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return // EOF, EAGAIN (empty) or an error
		}
	})
}

// append adds p, waiting while the buffer is full until stop is closed
// (after that the overshoot is bounded by what one pipe holds).
func (b *outputBuffer) append(p []byte, stop <-chan struct{}) {
	b.mu.Lock()
	for len(b.data) >= maxBuffered && !isClosed(stop) {
		ch := b.changed
		b.mu.Unlock()
		if b.waiting != nil {
			b.waiting()
		}
		select {
		case <-ch:
		case <-stop:
		}
		b.mu.Lock()
	}
	b.data = append(b.data, p...)
	b.notifyLocked()
	b.mu.Unlock()
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// read returns up to n bytes, blocking until data arrives; empty with a nil
// error means the stream has ended (Kata's convention for EOF).
func (b *outputBuffer) read(ctx context.Context, n int) ([]byte, error) {
	if n <= 0 {
		n = 32 << 10
	}
	b.mu.Lock()
	for len(b.data) == 0 && !b.eof {
		ch := b.changed
		b.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		b.mu.Lock()
	}
	defer b.mu.Unlock()
	n = min(n, len(b.data))
	out := make([]byte, n)
	copy(out, b.data)
	b.data = b.data[n:]
	b.notifyLocked()
	return out, nil
}
