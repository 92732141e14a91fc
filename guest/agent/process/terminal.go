package process

import (
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/kata-fsx/kata-fsx/guest/agent/initproc"
	"github.com/kata-fsx/kata-fsx/guest/agent/pty"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// terminal is the pty master of a process with a terminal.
type terminal struct {
	mu     sync.Mutex // orders resizes before the close at exit; a leaf lock held for one ioctl or close
	master *os.File
	closed bool
}

// resize sets the terminal's size; false once it is closed.
func (t *terminal) resize(rows, cols uint16) (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false, nil
	}
	return true, pty.SetWinsize(t.master, rows, cols)
}

func (t *terminal) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.master.Close()
}

// startTerminal is start for a process with a terminal: startFn starts
// cmd on a pty and returns the master, whose output is the process's
// stdout (a terminal has one output: stderr stays empty), and stdin is
// written to it. A cmd that started without handing over a master (its
// container-init helper failed first) is still reaped, with no output.
func (p *Process) startTerminal(cmd *exec.Cmd, startFn func() (*os.File, error)) error {
	master, err := startFn()
	if cmd.Process == nil {
		if master != nil {
			master.Close()
		}
		if err == nil {
			err = errors.New("the process did not start")
		}
		return err
	}
	if err != nil {
		log.Printf("%s: no terminal: %v", p.execID, err)
	}
	p.cmd = cmd
	p.stderr.end()
	outDone, stop := make(chan struct{}), make(chan struct{})
	if master != nil {
		p.tty = &terminal{master: master}
		// stdin is a second descriptor of the master: closing it (CloseStdin,
		// or the reaper) must not hang the terminal up under the reader.
		if in, err := pty.DupFile(master); err == nil {
			p.stdin.Store(in)
		} else {
			log.Printf("%s: terminal input: %v", p.execID, err)
		}
		go func() { p.stdout.fill(master, stop); close(outDone) }()
	} else {
		p.stdout.end()
		close(outDone)
	}
	p.started.Store(true)
	go func() {
		_ = cmd.Wait()
		// The master reads EIO once no slave is open; a descendant still
		// holding the terminal keeps it open for descendantGrace (see start).
		grace := time.NewTimer(descendantGrace)
		select {
		case <-outDone:
		case <-grace.C:
			close(stop)
			_ = master.SetReadDeadline(time.Now())
			<-outDone
		}
		grace.Stop()
		p.closeStdin()
		if p.tty != nil {
			p.tty.close()
		}
		p.status = exitStatus(cmd.ProcessState)
		close(p.done)
	}()
	return nil
}

// endTerminalInput is CloseStdin for a terminal: it types the terminal's
// end-of-file character (^D unless stty changed it), which a process
// reading the terminal at the start of a line takes as the end of its
// input, as if a user pressed it; closing the master instead would hang
// the terminal up and end its output. Later writes are refused, as they
// are after a pipe's close.
func (p *Process) endTerminalInput() error {
	f := p.stdin.Load()
	if f == nil {
		return nil
	}
	eof := byte(4) // ^D
	if rc, err := f.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			// TCGETS on the master reads the terminal's (the slave's) settings.
			if t, err := unix.IoctlGetTermios(int(fd), unix.TCGETS); err == nil && t.Cc[unix.VEOF] != 0 {
				eof = t.Cc[unix.VEOF]
			}
		})
	}
	_, err := f.Write([]byte{eof})
	p.closeStdin()
	if err != nil && !errors.Is(err, fs.ErrClosed) {
		return fmt.Errorf("terminal: write end of file: %w", err)
	}
	return nil
}

// resizeTerminal sets the size of a started process's terminal.
func (p *Process) resizeTerminal(rows, cols uint32) error {
	if rows > 0xffff || cols > 0xffff {
		return status.Errorf(codes.InvalidArgument, "terminal size %dx%d (rows x columns) is out of range: at most 65535 of each", rows, cols)
	}
	if !p.started.Load() {
		return status.Errorf(codes.FailedPrecondition, "process %s is not started", p.execID)
	}
	if p.tty == nil {
		return status.Errorf(codes.FailedPrecondition, "process %s has no terminal", p.execID)
	}
	open, err := p.tty.resize(uint16(rows), uint16(cols))
	if !open {
		return status.Errorf(codes.FailedPrecondition, "process %s has exited: its terminal is gone", p.execID)
	}
	if err != nil {
		return fmt.Errorf("process %s: resize terminal to %dx%d: %w", p.execID, rows, cols, err)
	}
	return nil
}

// startInitTerminal starts the container-init helper of a container whose
// process has a terminal: the helper opens the pty in the container and
// hands the master back over a socket at initproc.ConsoleFd.
func startInitTerminal(p *Process, cmd *exec.Cmd, start func() error) error {
	if len(cmd.ExtraFiles) != initproc.ConsoleFd-3 {
		return fmt.Errorf("terminal: the console socket must be fd %d, the helper has %d extra files", initproc.ConsoleFd, len(cmd.ExtraFiles))
	}
	agentEnd, helperEnd, err := pty.SocketPair()
	if err != nil {
		return err
	}
	defer agentEnd.Close()
	cmd.ExtraFiles = append(cmd.ExtraFiles, helperEnd)
	return p.startTerminal(cmd, func() (*os.File, error) {
		err := start()
		// Only the helper holds its end now: its exit ends the wait below.
		helperEnd.Close()
		if err != nil {
			return nil, err
		}
		return pty.RecvFile(agentEnd, "pty master")
	})
}

// startExecTerminal starts an exec in the namespaces of process pid on a
// new pty of its container, and returns the master.
func startExecTerminal(pid int, cmd *exec.Cmd, xc *initproc.ExecConfig, size *pty.Size) (*os.File, error) {
	var master, slave *os.File
	err := startInNamespaces(pid, cmd, xc, func() error {
		var err error
		master, slave, err = pty.ForExec(cmd, size, xc.Privileges.UID)
		return err
	})
	if slave != nil {
		slave.Close() // the process has its own copies
	}
	if err != nil && master != nil {
		master.Close()
		master = nil
	}
	return master, err
}
