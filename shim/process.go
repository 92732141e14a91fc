package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/fifo"
	"github.com/containerd/log"
	"github.com/kata-fsx/kata-fsx/sandbox"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// procState is where a task process is in its life; the only moves are
// created -> running -> stopped and created -> stopped.
type procState int

const (
	procCreated procState = iota
	procRunning
	procStopped
)

func (s procState) String() string {
	switch s {
	case procCreated:
		return "created"
	case procRunning:
		return "running"
	case procStopped:
		return "stopped"
	}
	return "unknown"
}

// exitSandboxFailed is the status of processes of a pod whose VM died.
const exitSandboxFailed = 255

// stdio are the fifo paths containerd gave for a process. A process with
// a terminal has no stderr fifo: its terminal's output, in the guest a pty
// master, is its stdout, and its stdin is typed into that terminal.
type stdio struct {
	stdin, stdout, stderr string
	terminal              bool
}

// maxTerminalSide is the most rows or columns a terminal has (a winsize
// field is 16 bits).
const maxTerminalSide = 0xffff

// checkTerminal checks a process's terminal request against its OCI
// process: containerd made the fifos for one or the other, so they must
// agree, and the console size must fit a terminal.
func checkTerminal(terminal bool, p *specs.Process) error {
	if p == nil {
		return nil // the spec's own check names a missing process
	}
	if terminal != p.Terminal {
		return fmt.Errorf("the request's terminal flag (%v) and the spec's process.terminal (%v) disagree; set both or neither", terminal, p.Terminal)
	}
	if terminal && p.ConsoleSize != nil {
		if err := checkTerminalSize(uint32(min(p.ConsoleSize.Height, 1<<32-1)), uint32(min(p.ConsoleSize.Width, 1<<32-1))); err != nil {
			return fmt.Errorf("process.consoleSize: %w", err)
		}
	}
	return nil
}

// checkTerminalSize refuses a size no terminal can have.
func checkTerminalSize(rows, cols uint32) error {
	if rows > maxTerminalSide || cols > maxTerminalSide {
		return fmt.Errorf("terminal size %dx%d (rows x columns) is out of range: at most %d of each", rows, cols, maxTerminalSide)
	}
	return nil
}

// terminalSize is a terminal's rows (Height) and columns (Width).
type terminalSize struct{ Height, Width uint32 }

// process is a task's init process or one of its execs, living in the guest.
type process struct {
	containerID string
	execID      string // "" for the init process
	agentExecID string // the agent's name for it: the container id for init
	io          stdio
	// execSpec is an exec's process as the guest runs it, kept from Exec to Start.
	execSpec *sandbox.ProcessSpec

	// mu guards the fields below; it is the last lock taken (the
	// service's mu may be held) and nothing waits under it: closing
	// waitBlock wakes its waiters without waiting for them.
	mu         sync.Mutex
	state      procState
	exitStatus uint32
	exitedAt   time.Time
	waitBlock  chan struct{} // closed once the process stopped
	// inGuest is set once the agent started the process; until then a
	// resize waits in pendingSize.
	inGuest     bool
	pendingSize *terminalSize

	// stdin forwards the stdin fifo to the guest; nil without one.
	stdin *stdinPump

	// ioMu guards ioCancel and closers: exits and kills race with each
	// other. It is taken with no other lock held and held across closing
	// the fifos, which does not wait for containerd's end: a fifo whose
	// open is still pending is closed by opening its other end without
	// blocking. The output copies and the stdin pump never take it.
	ioMu     sync.Mutex
	ioCancel context.CancelFunc
	copies   sync.WaitGroup
	closers  []io.Closer
}

// newProcess makes a process; agentID is its name in the agent, which must
// stay unique for the container's life (the agent may remember exited execs).
func newProcess(cid, execID, agentID string, io stdio) *process {
	return &process{containerID: cid, execID: execID, agentExecID: agentID, io: io, waitBlock: make(chan struct{})}
}

func (p *process) status() (procState, uint32, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.state, p.exitStatus, p.exitedAt
}

// transition moves the process on, rejecting illegal moves.
func (p *process) setRunning() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state != procCreated {
		return fmt.Errorf("cannot start a process in %s state", p.state)
	}
	p.state = procRunning
	return nil
}

// deferResize keeps a terminal size for a process the agent has not
// started yet, and reports whether it did (false: resize it in the guest).
func (p *process) deferResize(rows, cols uint32) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inGuest || p.state == procStopped {
		return false
	}
	p.pendingSize = &terminalSize{Height: rows, Width: cols}
	return true
}

// setStartedInGuest records that the agent started the process and
// returns the size a resize asked for before, if any.
func (p *process) setStartedInGuest() *terminalSize {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.inGuest = true
	size := p.pendingSize
	p.pendingSize = nil
	return size
}

// setExited records the exit once; it reports whether this call did.
func (p *process) setExited(status uint32) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state == procStopped {
		return false
	}
	p.state, p.exitStatus, p.exitedAt = procStopped, status, time.Now()
	close(p.waitBlock)
	return true
}

// startIO opens the process's fifos and copies the agent's streams into
// them (and the stdin fifo into the agent) until the streams end.
func (p *process) startIO(ctx context.Context, g *sandbox.Guest) error {
	ctx, cancel := context.WithCancel(ctx)
	p.ioMu.Lock()
	p.ioCancel = cancel
	p.ioMu.Unlock()
	open := func(path string, flag int) (io.ReadWriteCloser, error) {
		// O_NONBLOCK: the open completes in the background, so a reader
		// that comes late (or never) cannot block the RPC.
		f, err := fifo.OpenFifo(ctx, path, flag|syscall.O_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", path, err)
		}
		p.ioMu.Lock()
		p.closers = append(p.closers, f)
		p.ioMu.Unlock()
		return f, nil
	}
	for _, s := range []struct {
		path   string
		stderr bool
	}{{p.io.stdout, false}, {p.io.stderr, true}} {
		if s.path == "" {
			continue
		}
		w, err := open(s.path, syscall.O_WRONLY)
		if err != nil {
			p.closeIO()
			return err
		}
		r := g.Output(ctx, p.containerID, p.agentExecID, s.stderr)
		p.copies.Add(1)
		go func() {
			defer p.copies.Done()
			if _, err := io.Copy(w, r); err != nil && !errors.Is(err, context.Canceled) {
				log.G(ctx).WithError(err).Debugf("%s/%s: output copy ended", p.containerID, p.agentExecID)
			}
		}()
	}
	if p.io.stdin != "" {
		r, err := open(p.io.stdin, syscall.O_RDONLY)
		if err != nil {
			p.closeIO()
			return err
		}
		sc, ok := r.(syscall.Conn)
		if !ok {
			p.closeIO()
			return fmt.Errorf("stdin fifo %s: no raw access", p.io.stdin)
		}
		raw, err := sc.SyscallConn()
		if err != nil {
			p.closeIO()
			return fmt.Errorf("stdin fifo %s: %w", p.io.stdin, err)
		}
		p.stdin = &stdinPump{raw: raw, done: make(chan struct{})}
		go p.stdin.run(ctx, g, p.containerID, p.agentExecID)
	}
	return nil
}

// finishIO lets the output copies drain (bounded: the agent may never
// end a stream of a process whose VM died) and closes the fifos, which
// tells containerd the output is complete.
func (p *process) finishIO(grace time.Duration) {
	done := make(chan struct{})
	go func() { p.copies.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
	}
	p.closeIO()
}

func (p *process) closeIO() {
	p.ioMu.Lock()
	defer p.ioMu.Unlock()
	if p.ioCancel != nil {
		p.ioCancel()
	}
	for _, c := range p.closers {
		c.Close()
	}
	p.closers = nil
}

// stdinPump copies a stdin fifo into a guest process. CloseIO (ctr sends
// it when its own stdin ends, before it closes the fifo, and waits for the
// answer) must forward what is already in the fifo and then close the
// process's stdin: mu makes "the fifo is empty and nothing read is still
// on its way" one observation.
type stdinPump struct {
	raw  syscall.RawConn
	done chan struct{} // closed when run returns

	// mu is held for non-blocking steps only: a read of the fifo that
	// returns EAGAIN rather than wait (raw.Read waits for readiness with
	// mu released), the FIONREAD of drained, the flags; never across the
	// write to the guest, so CloseIO never waits for the agent under it.
	mu      sync.Mutex
	opened  bool // the fifo is open (a read was attempted)
	busy    bool // a chunk was read and is not yet in the guest
	closing bool // stdin was closed on request: read no more

	// polling, when set, hears (without blocking) each time drained finds
	// the fifo not yet drained and waits: tests order the pump after it.
	polling chan<- struct{}
}

// stdinSink is the guest side of a stdinPump: the agent, or a test's recorder.
type stdinSink interface {
	WriteStdin(ctx context.Context, containerID, execID string, data []byte) (int, error)
	CloseStdin(ctx context.Context, containerID, execID string) error
}

func (s *stdinPump) run(ctx context.Context, a stdinSink, cid, execID string) {
	defer close(s.done)
	buf := make([]byte, 32<<10)
	for {
		var n int
		var rerr error
		err := s.raw.Read(func(fd uintptr) bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.opened = true
			if s.closing {
				rerr = errStdinClosed
				return true
			}
			n, rerr = unix.Read(int(fd), buf)
			if errors.Is(rerr, unix.EAGAIN) {
				return false
			}
			if rerr == nil && n == 0 {
				rerr = io.EOF
			}
			s.busy = n > 0
			return true
		})
		if err == nil {
			err = rerr
		}
		if n > 0 {
			_, werr := a.WriteStdin(ctx, cid, execID, buf[:n])
			s.mu.Lock()
			s.busy = false
			s.mu.Unlock()
			if werr != nil {
				log.G(ctx).WithError(werr).Debugf("%s/%s: stdin copy ended", cid, execID)
				return
			}
		}
		if err != nil {
			s.mu.Lock()
			closing := s.closing
			s.closing = true
			s.mu.Unlock()
			if errors.Is(err, io.EOF) && !closing && ctx.Err() == nil {
				// The writer closed the fifo: the process sees its stdin end.
				if cerr := a.CloseStdin(ctx, cid, execID); cerr != nil {
					log.G(ctx).WithError(cerr).Debugf("%s/%s: close stdin", cid, execID)
				}
			}
			return
		}
	}
}

var errStdinClosed = errors.New("stdin closed")

// drained waits until everything written into the fifo so far reached the
// guest and then stops the pump; it reports false when the pump already
// ended (and closed stdin itself, or failed).
func (s *stdinPump) drained(ctx context.Context, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		s.mu.Lock()
		select {
		case <-s.done:
			s.mu.Unlock()
			return false
		default:
		}
		// Until the pump has opened the fifo, an empty answer means
		// nothing: the writer's bytes may be waiting for that open.
		empty := false
		if s.opened {
			avail := 0
			_ = s.raw.Control(func(fd uintptr) {
				avail, _ = unix.IoctlGetInt(int(fd), unix.TIOCINQ) // FIONREAD
			})
			empty = avail == 0 && !s.busy
		}
		if empty || time.Now().After(deadline) || ctx.Err() != nil {
			s.closing = true
			s.mu.Unlock()
			return true
		}
		s.mu.Unlock()
		select {
		case s.polling <- struct{}{}:
		default:
		}
		time.Sleep(10 * time.Millisecond)
	}
}
