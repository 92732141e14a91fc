// Package process runs the processes of the agent's containers, an init or
// an exec, as the host sees them: stdio pipes or a terminal whose output
// is buffered for the host's reads, a stdin the host writes, the exit
// status once the output has ended, and the start of an exec inside the
// namespaces of its container's init.
package process

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/guest/agent/initproc"
	"github.com/kata-fsx/kata-fsx/guest/agent/pty"
	"golang.org/x/sys/unix"
)

// Process is a container's init or an exec'd process.
type Process struct {
	execID string
	cmd    *exec.Cmd
	// stdin is the write end of the process's stdin pipe, set once at
	// start; os.File serialises concurrent writes and a Close wakes a
	// blocked one, so no lock is held across a write that may block.
	stdin atomic.Pointer[os.File]
	// tty is the terminal of a process with one, set once at start.
	tty     *terminal
	stdout  *outputBuffer
	stderr  *outputBuffer
	started atomic.Bool   // set once cmd has started
	done    chan struct{} // closed after the process is reaped
	status  int32
}

// New returns a process not yet started, with the host-given exec id.
func New(execID string) *Process {
	return &Process{execID: execID, stdout: newOutputBuffer(), stderr: newOutputBuffer(), done: make(chan struct{})}
}

// start wires stdio pipes into cmd, runs startFn and reaps in the background.
func (p *Process) start(cmd *exec.Cmd, startFn func() error) error {
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		return err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		outR.Close()
		outW.Close()
		return err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdinR, outW, errW
	err = startFn()
	stdinR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		stdinW.Close()
		outR.Close()
		errR.Close()
		return err
	}
	p.cmd = cmd
	p.stdin.Store(stdinW)
	p.started.Store(true)
	outDone, errDone := make(chan struct{}), make(chan struct{})
	stop := make(chan struct{})
	go func() { p.stdout.fill(outR, stop); close(outDone) }()
	go func() { p.stderr.fill(errR, stop); close(errDone) }()
	go func() {
		_ = cmd.Wait()
		// The pipes still hold what the process wrote last: the copiers take
		// them to EOF. Only a descendant that kept a pipe open keeps it from
		// ending; after a grace period the streams are cut, and the copiers
		// still take what is in the pipes then (see fill), so a late timer
		// under load costs nothing but the descendant's later output.
		grace := time.NewTimer(descendantGrace)
		both := make(chan struct{})
		go func() { <-outDone; <-errDone; close(both) }()
		select {
		case <-both:
		case <-grace.C:
			close(stop)
			now := time.Now()
			_ = outR.SetReadDeadline(now)
			_ = errR.SetReadDeadline(now)
			<-both
		}
		grace.Stop()
		outR.Close()
		errR.Close()
		// Nobody reads stdin any more (but a descendant, which gets EOF).
		p.closeStdin()
		p.status = exitStatus(cmd.ProcessState)
		close(p.done)
	}()
	return nil
}

// descendantGrace is how long the streams of an exited process stay open
// for descendants that inherited its stdout or stderr.
const descendantGrace = 2 * time.Second

// closeStdin closes the stdin pipe; a WriteStdin blocked on it fails with
// os.ErrClosed.
func (p *Process) closeStdin() {
	if f := p.stdin.Swap(nil); f != nil {
		f.Close()
	}
}

func exitStatus(ps *os.ProcessState) int32 {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int32(ws.Signal())
	}
	return int32(ps.ExitCode())
}

func (p *Process) running() bool {
	if !p.started.Load() {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// startInNamespaces starts cmd inside the namespaces of process pid; see
// ExecProcess for why a dedicated, never-unlocked OS thread does it.
// prepare, if not nil, runs on that thread once it joined them.
func startInNamespaces(pid int, cmd *exec.Cmd, xc *initproc.ExecConfig, prepare func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread's namespaces no longer match the rest
		// of the agent, so the runtime must discard it when we return.
		errc <- joinAndStart(pid, cmd, xc, prepare)
	}()
	return <-errc
}

func joinAndStart(pid int, cmd *exec.Cmd, xc *initproc.ExecConfig, prepare func() error) error {
	namespaces := []struct {
		name string
		typ  int
	}{{"uts", unix.CLONE_NEWUTS}, {"pid", unix.CLONE_NEWPID}, {"mnt", unix.CLONE_NEWNS}}
	fds := make([]int, 0, len(namespaces))
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	// Open all first: after joining the mount namespace, /proc is the container's.
	for _, ns := range namespaces {
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, ns.name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s namespace of pid %d: %w", ns.name, pid, err)
		}
		fds = append(fds, fd)
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs attributes: %w", err)
	}
	for i, ns := range namespaces {
		if err := unix.Setns(fds[i], ns.typ); err != nil {
			return fmt.Errorf("join %s namespace of pid %d: %w", ns.name, pid, err)
		}
	}
	path, err := initproc.LookPath(xc.Args[0], xc.Env)
	if err != nil {
		return err
	}
	xc.Path = path
	// The child resolves /proc/self/exe in the container's procfs (this
	// thread's /proc/self is not in it: it has not joined the PID namespace).
	var st unix.Statfs_t
	if err := unix.Statfs("/proc", &st); err != nil || st.Type != unix.PROC_SUPER_MAGIC {
		return fmt.Errorf("the exec helper starts through the container's /proc/self/exe, and the container has no procfs on /proc (%v)", err)
	}
	blob, err := json.Marshal(xc)
	if err != nil {
		return err
	}
	cmd.Env = []string{initproc.ConfigEnv + "=" + string(blob)}
	if prepare != nil {
		if err := prepare(); err != nil {
			return err
		}
	}
	return cmd.Start()
}

// ExecID is the process's exec id; a container's init has the one the
// host created the container with.
func (p *Process) ExecID() string { return p.execID }

// StartInit starts cmd, a container-init helper, as the process: on a
// terminal the helper opens in the container when withTerminal is set,
// else on stdio pipes. With pidNS (an open PID namespace) not nil, the
// helper starts in that namespace, and cmd's clone flags must not ask
// for a new one.
func (p *Process) StartInit(cmd *exec.Cmd, withTerminal bool, pidNS *os.File) error {
	start := cmd.Start
	if pidNS != nil {
		start = func() error { return inPIDNamespace(pidNS, cmd.Start) }
	}
	if withTerminal {
		return startInitTerminal(p, cmd, start)
	}
	return p.start(cmd, start)
}

// inPIDNamespace runs start on an OS thread of its own whose children go
// to the PID namespace ns: setns of a PID namespace changes only where a
// thread's children are born.
func inPIDNamespace(ns *os.File, start func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread's children would go on being born
		// in ns, so the runtime must discard it when we return.
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWPID); err != nil {
			errc <- fmt.Errorf("join the pod's PID namespace: %w", err)
			return
		}
		errc <- start()
	}()
	return <-errc
}

// StartExec starts cmd, an exec helper, as the process inside the
// namespaces of the container init pid: on a new terminal of the
// container of the given size when withTerminal is set, else on stdio
// pipes. xc is what the helper is handed once the command is resolved in
// the container.
func (p *Process) StartExec(pid int, cmd *exec.Cmd, xc *initproc.ExecConfig, withTerminal bool, size *pty.Size) error {
	if withTerminal {
		return p.startTerminal(cmd, func() (*os.File, error) { return startExecTerminal(pid, cmd, xc, size) })
	}
	return p.start(cmd, func() error { return startInNamespaces(pid, cmd, xc, nil) })
}

// Started says whether the process has been started.
func (p *Process) Started() bool { return p.started.Load() }

// Running says whether the process has been started and not yet reaped.
func (p *Process) Running() bool { return p.running() }

// Done is closed once the process has been reaped and its output has ended.
func (p *Process) Done() <-chan struct{} { return p.done }

// Status is the exit status, 128+signal for a signal; valid once Done is closed.
func (p *Process) Status() int32 { return p.status }

// Pid is the process id of a started process.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to a started process; a process already gone is no error.
func (p *Process) Signal(sig syscall.Signal) error {
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal %d to %s: %w", sig, p.execID, err)
	}
	return nil
}

// ReadOutput returns up to n bytes of the process's stdout or stderr,
// blocking until some arrive; empty with a nil error is the end of the
// stream.
func (p *Process) ReadOutput(ctx context.Context, stderr bool, n int) ([]byte, error) {
	b := p.stdout
	if stderr {
		b = p.stderr
	}
	return b.read(ctx, n)
}

// Stdin is the write end of the process's stdin, nil before the start and
// after CloseInput; a write blocked on it when it is closed fails with
// os.ErrClosed.
func (p *Process) Stdin() *os.File { return p.stdin.Load() }

// CloseInput ends the process's input: it closes a stdin pipe, and types
// the end-of-file character on a terminal (see endTerminalInput).
func (p *Process) CloseInput() error {
	if p.started.Load() && p.tty != nil {
		return p.endTerminalInput()
	}
	p.closeStdin()
	return nil
}

// Resize sets the size of the process's terminal.
func (p *Process) Resize(rows, cols uint32) error { return p.resizeTerminal(rows, cols) }
