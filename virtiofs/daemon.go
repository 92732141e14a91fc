package virtiofs

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/childproc"
)

// Process is a running virtiofsd serving one shared directory.
type Process struct {
	cmd    *exec.Cmd
	socket string
	stderr *tailBuffer
	done   chan struct{}
	err    error // set before done closes
	stop   sync.Once
	// stopping marks an exit we asked for, which is not a failure. mu
	// guards it alone and is never held across a signal or a wait.
	mu       sync.Mutex
	stopping bool
}

// Start listens on socketPath (mode 0600; its directory must exist and
// should be 0700), starts the daemon on it and returns once the daemon is
// running. The daemon is in its own process group, so Stop reaches the
// children it forks for its sandbox.
func Start(ctx context.Context, o Options, socketPath string) (*Process, error) {
	args, err := Args(o)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(o.SharedDir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("virtiofsd shared directory %s: not a directory (%v)", o.SharedDir, err)
	}
	ln, err := listen(socketPath)
	if err != nil {
		return nil, err
	}
	f, err := ln.File()
	// The daemon owns the socket from here; our copy of the listener
	// closes without unlinking the path QEMU will connect to.
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if err != nil {
		os.Remove(socketPath)
		return nil, fmt.Errorf("virtiofsd socket %s: %w", socketPath, err)
	}
	defer f.Close()

	p := &Process{socket: socketPath, stderr: newTailBuffer(8 << 10), done: make(chan struct{})}
	p.cmd = exec.Command(o.Daemon.Path, args...)
	p.cmd.ExtraFiles = []*os.File{f}
	p.cmd.Stdout = p.stderr
	p.cmd.Stderr = p.stderr
	// childproc adds the parent-death signal, forked from a thread that
	// lives as long as the daemon: the daemon dies with its owner, and
	// only then.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	exited, err := childproc.Start(p.cmd)
	if err != nil {
		os.Remove(socketPath)
		return nil, fmt.Errorf("start virtiofsd %s: %w", o.Daemon.Path, err)
	}
	go p.wait(exited)
	// A daemon that rejects its arguments exits at once; give it a moment
	// to do so, so the error names the cause instead of a later hang.
	select {
	case <-p.done:
		os.Remove(socketPath)
		return nil, p.err
	case <-time.After(200 * time.Millisecond):
	case <-ctx.Done():
		p.Stop(context.Background())
		return nil, ctx.Err()
	}
	return p, nil
}

func listen(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("virtiofsd socket %s: %w", path, err)
	}
	// The umask makes the socket 0600 from birth: a chmod after bind
	// would leave a window in which others could connect.
	old := syscall.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("virtiofsd socket %s: %w", path, err)
	}
	return ln, nil
}

func (p *Process) wait(exited <-chan error) {
	err := <-exited
	p.mu.Lock()
	stopping := p.stopping
	p.mu.Unlock()
	if !stopping {
		last := strings.TrimSpace(p.stderr.String())
		if last == "" {
			last = "(no output)"
		}
		p.err = fmt.Errorf("virtiofsd %s (pid %d) exited: %v; its last words: %s", filepath.Base(p.cmd.Path), p.cmd.Process.Pid, err, last)
	}
	close(p.done)
}

// Done is closed when the daemon has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is why the daemon exited (nil if Stop asked it to); valid after Done.
func (p *Process) Err() error {
	<-p.done
	return p.err
}

// Pid is the daemon's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Socket is the vhost-user socket QEMU connects to.
func (p *Process) Socket() string { return p.socket }

// Stop terminates the daemon and every process of its group: SIGTERM, then
// SIGKILL when ctx expires or after 5 s; the socket file is removed.
func (p *Process) Stop(ctx context.Context) error {
	p.stop.Do(func() {
		p.mu.Lock()
		p.stopping = true
		p.mu.Unlock()
		pgid := p.cmd.Process.Pid
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		select {
		case <-p.done:
		case <-t.C:
		case <-ctx.Done():
		}
		// Whatever is left of the group (a sandbox child) goes too.
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.done
		os.Remove(p.socket)
	})
	return nil
}

// tailBuffer keeps the last n bytes written to it.
type tailBuffer struct {
	// mu is a leaf lock, held for a copy: the daemon's output pipe
	// writes under it, readers take a string.
	mu  sync.Mutex
	n   int
	buf []byte
}

func newTailBuffer(n int) *tailBuffer { return &tailBuffer{n: n} }

func (t *tailBuffer) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, b...)
	if len(t.buf) > t.n {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.n:]...)
	}
	return len(b), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
