// Package pty opens a pseudo-terminal in the caller's devpts instance and
// passes its descriptors around: the agent's helpers give a process with a
// terminal a pty of its container's own devpts instance, as runc does it (the
// container-init helper opens it after the container's mounts, an exec once
// it joined the container's mount namespace), so ttyname(3) in the container
// finds the process's terminal under the container's /dev/pts, which a pty
// of the agent's devpts would not be.
package pty

import (
	"errors"
	"fmt"
	"os"
	"os/exec"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// Size is a terminal's size as the container-init helper gets it.
type Size struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// SizeOf checks an OCI process's console size, which must fit a
// tty's winsize; nil when the process has no terminal or no size.
func SizeOf(p *pb.Process) (*Size, error) {
	b := p.GetConsoleSize()
	if !p.GetTerminal() || b == nil {
		return nil, nil
	}
	if b.GetHeight() > 0xffff || b.GetWidth() > 0xffff {
		return nil, status.Errorf(codes.InvalidArgument, "console size %dx%d (rows x columns) is out of range: a terminal has at most 65535 of each", b.GetHeight(), b.GetWidth())
	}
	return &Size{Rows: uint16(b.GetHeight()), Cols: uint16(b.GetWidth())}, nil
}

// Open opens a new pty pair in the devpts instance on /dev/pts of the
// caller's mount namespace. The master is non-blocking, so reads on it
// honour deadlines; the slave is opened through the master (TIOCGPTPEER),
// so no path lookup can land on another instance's node.
func Open() (master, slave *os.File, err error) {
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

// SetWinsize sets the size of the terminal whose master is f; the kernel
// sends SIGWINCH to its foreground process group when the size changes.
func SetWinsize(f *os.File, rows, cols uint16) error {
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

// MakeControllingTerminal makes slave the process's stdin, stdout, stderr
// and controlling terminal; the caller is a session leader.
func MakeControllingTerminal(slave *os.File) error {
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

// SendFile passes f's descriptor over the unix socket sock. (f.Fd()
// would make the open file, shared with the receiver, blocking.)
func SendFile(sock, f *os.File) error {
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

// DupFile is a second descriptor of f's open file, close-on-exec; not
// through f.Fd(), which would make the open file blocking.
func DupFile(f *os.File) (*os.File, error) {
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

// RecvFile receives one descriptor sent by SendFile on sock; an end of
// stream means the peer exited without sending one.
func RecvFile(sock *os.File, name string) (*os.File, error) {
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

// SocketPair makes the socket pair a container-init helper hands its
// pty master back on: the agent keeps the first, the helper gets the second.
func SocketPair() (agentEnd, helperEnd *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("console socket: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "console socket"), os.NewFile(uintptr(fds[1]), "console socket"), nil
}

// ForExec prepares cmd, an exec about to start in its container's
// mount namespace, to run on a new pty of that namespace: the slave as
// its stdio and controlling terminal. It returns the master and the slave,
// which the caller closes once cmd has started.
func ForExec(cmd *exec.Cmd, size *Size, uid uint32) (master, slave *os.File, err error) {
	master, slave, err = Open()
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*os.File, *os.File, error) {
		master.Close()
		slave.Close()
		return nil, nil, err
	}
	if size != nil {
		if err := SetWinsize(master, size.Rows, size.Cols); err != nil {
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
