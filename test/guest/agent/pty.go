package main

import (
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"os/exec"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// A process with a terminal gets a pty of its container's own devpts
// instance, as runc does it: the container-init helper opens it after the
// container's mounts, and an exec opens it once it joined the container's
// mount namespace. So ttyname(3) in the container finds the process's
// terminal under the container's /dev/pts, which a pty of the agent's
// devpts would not be.

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
	return true, setWinsize(t.master, rows, cols)
}

func (t *terminal) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.master.Close()
}

// initConsoleFd is where the container-init helper of a process with a
// terminal finds the socket it hands the pty master back on.
const initConsoleFd = 4

// consoleSize is a terminal's size as the container-init helper gets it.
type consoleSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// terminalSize checks an OCI process's console size, which must fit a
// tty's winsize; nil when the process has no terminal or no size.
func terminalSize(p *pb.Process) (*consoleSize, error) {
	b := p.GetConsoleSize()
	if !p.GetTerminal() || b == nil {
		return nil, nil
	}
	if b.GetHeight() > 0xffff || b.GetWidth() > 0xffff {
		return nil, status.Errorf(codes.InvalidArgument, "console size %dx%d (rows x columns) is out of range: a terminal has at most 65535 of each", b.GetHeight(), b.GetWidth())
	}
	return &consoleSize{Rows: uint16(b.GetHeight()), Cols: uint16(b.GetWidth())}, nil
}

// openPty opens a new pty pair in the devpts instance on /dev/pts of the
// caller's mount namespace. The master is non-blocking, so reads on it
// honour deadlines; the slave is opened through the master (TIOCGPTPEER),
// so no path lookup can land on another instance's node.
func openPty() (master, slave *os.File, err error) {
	ptmx := "/dev/pts/ptmx"
	fd, err := unix.Open(ptmx, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if errors.Is(err, unix.ENOENT) {
		ptmx = "/dev/ptmx"
		fd, err = unix.Open(ptmx, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("terminal: open %s: %w (the container needs devpts on /dev/pts)", ptmx, err)
	}
	master = os.NewFile(uintptr(fd), ptmx)
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("terminal: unlock pty: %w", err)
	}
	// The slave is blocking, as a process expects of its stdio.
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	if errno != 0 {
		master.Close()
		return nil, nil, fmt.Errorf("terminal: open pty slave: %w", errno)
	}
	n, err := unix.IoctlGetUint32(fd, unix.TIOCGPTN)
	name := "pty slave"
	if err == nil {
		name = fmt.Sprintf("/dev/pts/%d", n)
	}
	return master, os.NewFile(uintptr(sfd), name), nil
}

// setWinsize sets the size of the terminal whose master is f; the kernel
// sends SIGWINCH to its foreground process group when the size changes.
func setWinsize(f *os.File, rows, cols uint16) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	if err := rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	}); err != nil {
		return err
	}
	return ierr
}

// makeControllingTerminal makes slave the process's stdin, stdout, stderr
// and controlling terminal; the caller is a session leader.
func makeControllingTerminal(slave *os.File) error {
	for fd := 0; fd <= 2; fd++ {
		if err := unix.Dup3(int(slave.Fd()), fd, 0); err != nil {
			return fmt.Errorf("terminal: dup pty slave to fd %d: %w", fd, err)
		}
	}
	if err := unix.IoctlSetInt(0, unix.TIOCSCTTY, 0); err != nil {
		return fmt.Errorf("terminal: make the pty the controlling terminal: %w", err)
	}
	return nil
}

// setupConsole runs in the container-init helper of a process with a
// terminal, after the container's mounts and before it drops privileges:
// it opens the pty, sizes it, hands the master to the agent over
// initConsoleFd and makes the slave the process's terminal.
func setupConsole(cfg *initConfig) error {
	sock := os.NewFile(initConsoleFd, "console socket")
	defer sock.Close()
	master, slave, err := openPty()
	if err != nil {
		return err
	}
	defer master.Close()
	defer slave.Close()
	if s := cfg.Console; s != nil {
		if err := setWinsize(master, s.Rows, s.Cols); err != nil {
			return fmt.Errorf("terminal: set size %dx%d: %w", s.Rows, s.Cols, err)
		}
	}
	// The process owns its terminal, as a login's user does.
	if err := unix.Fchown(int(slave.Fd()), int(cfg.Privileges.UID), -1); err != nil {
		return fmt.Errorf("terminal: chown %s to uid %d: %w", slave.Name(), cfg.Privileges.UID, err)
	}
	if err := sendFile(sock, master); err != nil {
		return fmt.Errorf("terminal: hand the pty master to the agent: %w", err)
	}
	return makeControllingTerminal(slave)
}

// sendFile passes f's descriptor over the unix socket sock. (f.Fd()
// would make the open file, shared with the receiver, blocking.)
func sendFile(sock, f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.Sendmsg(int(sock.Fd()), []byte{0}, unix.UnixRights(int(fd)), nil, 0)
	}); err != nil {
		return err
	}
	return serr
}

// dupFile is a second descriptor of f's open file, close-on-exec; not
// through f.Fd(), which would make the open file blocking.
func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) {
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, fmt.Errorf("dup %s: %w", f.Name(), derr)
	}
	return os.NewFile(uintptr(nfd), f.Name()), nil
}

// recvFile receives one descriptor sent by sendFile on sock; an end of
// stream means the peer exited without sending one.
func recvFile(sock *os.File, name string) (*os.File, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(int(sock.Fd()), buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("receive %s: %w", name, err)
	}
	if n == 0 && oobn == 0 {
		return nil, fmt.Errorf("receive %s: the container-init helper ended without sending it", name)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("receive %s: bad control message (%v)", name, err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("receive %s: want one descriptor, got %d (%v)", name, len(fds), err)
	}
	// Non-blocking (the flag is the open file's, shared with the sender's
	// copy), so the runtime poller serves it and deadlines work.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		return nil, fmt.Errorf("receive %s: %w", name, err)
	}
	return os.NewFile(uintptr(fds[0]), name), nil
}

// consoleSocket makes the socket pair a container-init helper hands its
// pty master back on: the agent keeps the first, the helper gets the second.
func consoleSocket() (agentEnd, helperEnd *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("console socket: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "console socket"), os.NewFile(uintptr(fds[1]), "console socket"), nil
}

// execTerminal prepares cmd, an exec about to start in its container's
// mount namespace, to run on a new pty of that namespace: the slave as
// its stdio and controlling terminal. It returns the master and the slave,
// which the caller closes once cmd has started.
func execTerminal(cmd *exec.Cmd, size *consoleSize, uid uint32) (master, slave *os.File, err error) {
	master, slave, err = openPty()
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*os.File, *os.File, error) {
		master.Close()
		slave.Close()
		return nil, nil, err
	}
	if size != nil {
		if err := setWinsize(master, size.Rows, size.Cols); err != nil {
			return fail(fmt.Errorf("terminal: set size %dx%d: %w", size.Rows, size.Cols, err))
		}
	}
	// The process's user owns its terminal, as with runc's console.
	if err := unix.Fchown(int(slave.Fd()), int(uid), -1); err != nil {
		return fail(fmt.Errorf("terminal: chown %s to uid %d: %w", slave.Name(), uid, err))
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr.Setsid = true
	cmd.SysProcAttr.Setctty = true
	cmd.SysProcAttr.Ctty = 0 // the child's fd number: its stdin
	return master, slave, nil
}

// startTerminal is start for a process with a terminal: startFn starts
// cmd on a pty and returns the master, whose output is the process's
// stdout (a terminal has one output: stderr stays empty), and stdin is
// written to it. A cmd that started without handing over a master (its
// container-init helper failed first) is still reaped, with no output.
func (p *process) startTerminal(cmd *exec.Cmd, startFn func() (*os.File, error)) error {
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
		if in, err := dupFile(master); err == nil {
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
func (p *process) endTerminalInput() error {
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
func (p *process) resizeTerminal(rows, cols uint32) error {
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
// hands the master back over a socket at initConsoleFd.
func startInitTerminal(p *process, cmd *exec.Cmd) error {
	if len(cmd.ExtraFiles) != initConsoleFd-3 {
		return fmt.Errorf("terminal: the console socket must be fd %d, the helper has %d extra files", initConsoleFd, len(cmd.ExtraFiles))
	}
	agentEnd, helperEnd, err := consoleSocket()
	if err != nil {
		return err
	}
	defer agentEnd.Close()
	cmd.ExtraFiles = append(cmd.ExtraFiles, helperEnd)
	return p.startTerminal(cmd, func() (*os.File, error) {
		err := cmd.Start()
		// Only the helper holds its end now: its exit ends the wait below.
		helperEnd.Close()
		if err != nil {
			return nil, err
		}
		return recvFile(agentEnd, "pty master")
	})
}

// startExecTerminal starts an exec in the namespaces of process pid on a
// new pty of its container, and returns the master.
func startExecTerminal(pid int, cmd *exec.Cmd, xc *execConfig, size *consoleSize) (*os.File, error) {
	var master, slave *os.File
	err := startInNamespaces(pid, cmd, xc, func() error {
		var err error
		master, slave, err = execTerminal(cmd, size, xc.Privileges.UID)
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
