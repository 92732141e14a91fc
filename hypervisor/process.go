package hypervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/childproc"
	"github.com/kata-fsx/kata-fsx/hypervisor/qmp"
)

const (
	// defaultStartTimeout bounds Start when ctx has no deadline: a QEMU
	// that neither opens its QMP socket nor exits is hung.
	defaultStartTimeout = 60 * time.Second
	// defaultQuitGrace is how long Stop waits for QEMU to exit after quit before SIGKILL.
	defaultQuitGrace = 5 * time.Second
	// stderrKeep is how much of QEMU's stderr is kept in memory for error messages.
	stderrKeep = 64 << 10
	// maxDialBackoff caps the wait between attempts to reach the QMP socket.
	maxDialBackoff = 50 * time.Millisecond
)

// ErrExited reports that QEMU exited before it was ready.
var ErrExited = errors.New("qemu exited")

// VM is a running QEMU process with its QMP connection.
type VM struct {
	cfg    VMConfig
	plan   *Plan
	binary string
	cmd    *exec.Cmd
	qmp    *qmp.Client
	stderr *tailBuffer

	exited  chan struct{} // closed after cmd.Wait returned
	waitErr error         // set before exited is closed

	stopOnce sync.Once
	stopErr  error
}

// StopOptions tunes Stop; the zero value sends quit and kills after 5 s.
type StopOptions struct {
	// PowerdownGrace, when positive, first presses the ACPI power button and
	// waits this long for the guest to shut down by itself.
	PowerdownGrace time.Duration
	// QuitGrace is how long to wait after QMP quit before SIGKILL (default 5 s).
	QuitGrace time.Duration
}

// Start creates the per-VM directory, launches QEMU with the argv Build makes
// from cfg, and returns once QMP is negotiated. If QEMU exits first, the
// error carries its stderr. On any error nothing is left behind: no process,
// no directory. cfg.Dir is required; QMPSocket and StderrLog default to files
// in it. ctx bounds the startup only, not the VM's life.
func Start(ctx context.Context, cfg *VMConfig) (*VM, error) {
	if cfg == nil {
		return nil, fmt.Errorf("%w: nil VMConfig", ErrInvalidConfig)
	}
	c := *cfg
	if c.Dir == "" || !filepath.IsAbs(c.Dir) {
		return nil, invalid("VM directory %q must be an absolute path", c.Dir)
	}
	c.Dir = filepath.Clean(c.Dir)
	if c.QMPSocket == "" {
		c.QMPSocket = filepath.Join(c.Dir, "qmp.sock")
	}
	if c.StderrLog == "" {
		c.StderrLog = filepath.Join(c.Dir, "qemu.log")
	}
	binary, err := resolveBinary(c.QEMUPath)
	if err != nil {
		return nil, err
	}
	plan, err := Build(&c)
	if err != nil {
		return nil, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultStartTimeout)
		defer cancel()
	}

	if err := MakeVMDir(c.Dir); err != nil {
		return nil, err
	}
	vm := &VM{cfg: c, plan: plan, binary: binary, stderr: &tailBuffer{max: stderrKeep}, exited: make(chan struct{})}
	if err := vm.launch(ctx); err != nil {
		vm.kill()
		if rmErr := os.RemoveAll(c.Dir); rmErr != nil {
			err = errors.Join(err, fmt.Errorf("remove VM directory: %w", rmErr))
		}
		return nil, err
	}
	return vm, nil
}

// MakeVMDir creates dir with mode 0700, or tightens an existing directory
// owned by us to 0700, so callers can place backend sockets in it before
// Start. It refuses symlinks and directories owned by someone else.
func MakeVMDir(dir string) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return fmt.Errorf("create parent of VM directory: %w", err)
	}
	err := os.Mkdir(dir, 0o700)
	if err == nil || !errors.Is(err, os.ErrExist) {
		if err != nil {
			return fmt.Errorf("create VM directory: %w", err)
		}
		return nil
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("VM directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("VM directory %s exists and is not a directory", dir)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("VM directory %s is owned by uid %d, not us", dir, sys.Uid)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("VM directory: %w", err)
	}
	return nil
}

func (vm *VM) launch(ctx context.Context) error {
	// A socket left by a previous QEMU would accept nothing and only slow the dial loop.
	if err := os.Remove(vm.cfg.QMPSocket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale QMP socket: %w", err)
	}
	// QEMU would create the console log with the umask's mode; the guest
	// console can carry secrets, so create it private first.
	if vm.cfg.ConsoleLog != "" {
		f, err := os.OpenFile(vm.cfg.ConsoleLog, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
		if err != nil {
			return fmt.Errorf("console log: %w", err)
		}
		err = f.Chmod(0o600)
		f.Close()
		if err != nil {
			return fmt.Errorf("console log: %w", err)
		}
	}
	logFile, err := os.OpenFile(vm.cfg.StderrLog, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("QEMU log: %w", err)
	}
	cmd := exec.Command(vm.binary, vm.plan.Args...)
	out := io.MultiWriter(logFile, vm.stderr)
	cmd.Stdout, cmd.Stderr = out, out
	// Own process group: a ^C meant for kata-fsx must not kill the VM
	// before Stop can shut it down in order. childproc adds the
	// parent-death signal: a shim or `kata-fsx run` that dies, even by
	// SIGKILL, takes its VM with it instead of leaving it to pid 1.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Fds the argv names (vhostfd=): the child gets its own copies; the
	// parent's stay the caller's, open until QEMU has exited.
	cmd.ExtraFiles = vm.plan.ExtraFiles
	exited, err := childproc.Start(cmd)
	if err != nil {
		logFile.Close()
		return fmt.Errorf("start %s: %w", vm.binary, err)
	}
	vm.cmd = cmd
	go func() {
		err := <-exited
		logFile.Close()
		vm.waitErr = err
		close(vm.exited)
	}()

	client, err := vm.connectQMP(ctx)
	if err != nil {
		return err
	}
	vm.qmp = client
	return nil
}

// connectQMP dials the QMP socket until QEMU has created it, watching for
// QEMU's exit and ctx.
func (vm *VM) connectQMP(ctx context.Context) (*qmp.Client, error) {
	backoff := time.Millisecond
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-vm.exited:
			return nil, vm.exitError("during startup")
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for QMP socket %s: %w%s", vm.cfg.QMPSocket, ctx.Err(), vm.stderrSuffix())
		case <-timer.C:
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", vm.cfg.QMPSocket)
		if err == nil {
			client, err := qmp.NewClient(ctx, conn, qmp.Options{})
			if err != nil {
				conn.Close()
				// A handshake cut short usually means QEMU is dying; give it
				// a moment to be reaped so the error can carry its stderr.
				t := time.NewTimer(time.Second)
				defer t.Stop()
				select {
				case <-vm.exited:
					return nil, vm.exitError("during QMP handshake")
				case <-t.C:
				}
				return nil, fmt.Errorf("QMP handshake: %w%s", err, vm.stderrSuffix())
			}
			return client, nil
		}
		if !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("dial QMP socket: %w", err)
		}
		backoff = min(backoff*2, maxDialBackoff)
		timer.Reset(backoff)
	}
}

func (vm *VM) exitError(when string) error {
	return fmt.Errorf("%w %s: %v%s", ErrExited, when, vm.waitErr, vm.stderrSuffix())
}

func (vm *VM) stderrSuffix() string {
	s := strings.TrimSpace(vm.stderr.String())
	if s == "" {
		return ""
	}
	return ": " + s
}

// QMP returns the negotiated QMP client.
func (vm *VM) QMP() *qmp.Client { return vm.qmp }

// Plan returns the command line and PCI layout the VM was started with.
func (vm *VM) Plan() *Plan { return vm.plan }

// NextHotplugSlot reserves a free hot-plug slot; see HotplugAllocator.
func (vm *VM) NextHotplugSlot() (HotplugSlot, error) {
	if vm.plan.Hotplug == nil {
		return HotplugSlot{}, fmt.Errorf("%w: the VM was started with HotplugSlots = 0", ErrNoHotplugSlot)
	}
	return vm.plan.Hotplug.NextHotplugSlot()
}

// ReleaseHotplugSlot frees a slot once its device is gone (DeviceDel returned).
func (vm *VM) ReleaseHotplugSlot(s HotplugSlot) error {
	if vm.plan.Hotplug == nil {
		return fmt.Errorf("%w: the VM was started with HotplugSlots = 0", ErrNoHotplugSlot)
	}
	return vm.plan.Hotplug.Release(s)
}

// Pid returns QEMU's process id.
func (vm *VM) Pid() int { return vm.cmd.Process.Pid }

// Dir returns the per-VM directory.
func (vm *VM) Dir() string { return vm.cfg.Dir }

// Stderr returns the last 64 KiB QEMU wrote to stderr and stdout.
func (vm *VM) Stderr() string { return vm.stderr.String() }

// Exited is closed when the QEMU process has ended.
func (vm *VM) Exited() <-chan struct{} { return vm.exited }

// Wait blocks until QEMU exits and returns nil for a clean exit (quit, guest
// poweroff) and an error (wrapping *exec.ExitError) otherwise, including a
// kill from outside or Stop's SIGKILL.
func (vm *VM) Wait() error {
	<-vm.exited
	if vm.waitErr != nil {
		return fmt.Errorf("%w: %w%s", ErrExited, vm.waitErr, vm.stderrSuffix())
	}
	return nil
}

// Stop shuts QEMU down with StopOptions{}; see StopWith.
func (vm *VM) Stop(ctx context.Context) error { return vm.StopWith(ctx, StopOptions{}) }

// StopWith shuts QEMU down (ACPI power-down if asked, then QMP quit, then
// SIGKILL when a grace period or ctx runs out), reaps it and removes the
// per-VM directory. It is idempotent and also cleans up after a QEMU that
// already exited. It reports only failures to clean up, not how QEMU died
// (see Wait).
func (vm *VM) StopWith(ctx context.Context, opts StopOptions) error {
	vm.stopOnce.Do(func() { vm.stopErr = vm.stop(ctx, opts) })
	return vm.stopErr
}

func (vm *VM) stop(ctx context.Context, opts StopOptions) error {
	if opts.QuitGrace <= 0 {
		opts.QuitGrace = defaultQuitGrace
	}
	if opts.PowerdownGrace > 0 && !vm.hasExited() {
		if err := vm.qmp.SystemPowerdown(ctx); err == nil {
			vm.waitExit(ctx, opts.PowerdownGrace)
		}
	}
	if !vm.hasExited() {
		qctx, cancel := context.WithTimeout(ctx, opts.QuitGrace)
		if err := vm.qmp.Quit(qctx); err == nil {
			vm.waitExit(qctx, opts.QuitGrace)
		}
		cancel()
	}
	vm.kill()
	// QEMU is gone, so its end of the QMP socket is closed: let the reader
	// drain what QEMU sent last (SHUTDOWN and friends reach subscribers)
	// before closing our end.
	drain := time.NewTimer(time.Second)
	select {
	case <-vm.qmp.Done():
	case <-drain.C:
	}
	drain.Stop()
	vm.qmp.Close()
	if err := os.RemoveAll(vm.cfg.Dir); err != nil {
		return fmt.Errorf("remove VM directory: %w", err)
	}
	return nil
}

func (vm *VM) hasExited() bool {
	select {
	case <-vm.exited:
		return true
	default:
		return false
	}
}

// waitExit waits up to grace (and ctx) for QEMU to exit.
func (vm *VM) waitExit(ctx context.Context, grace time.Duration) {
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-vm.exited:
	case <-t.C:
	case <-ctx.Done():
	}
}

// kill sends SIGKILL if QEMU still runs and reaps it; a killed process
// always ends, so the wait is unbounded.
func (vm *VM) kill() {
	if vm.cmd == nil || vm.cmd.Process == nil {
		return
	}
	if !vm.hasExited() {
		// The error only says the process already finished.
		_ = vm.cmd.Process.Kill()
	}
	<-vm.exited
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	// mu is a leaf lock, held for a copy: QEMU's output pipe writes
	// under it, readers take a string.
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := len(p)
	if len(p) >= t.max {
		p = p[len(p)-t.max:]
		t.buf = append(t.buf[:0], p...)
		return n, nil
	}
	if over := len(t.buf) + len(p) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	t.buf = append(t.buf, p...)
	return n, nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
