package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// terminalScript is what the tests run on a terminal in the guest: it
// names its terminal, reports every size the terminal takes until it is
// rows x cols, then reads a line. A size shows only if the guest process's
// pty has it: the polling `stty size` asks the terminal itself.
func terminalScript(rows, cols int) string {
	return fmt.Sprintf(`echo "tty=$(tty)"; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo stdio-is-a-tty
last=""
while :; do
	s=$(stty size)
	if [ "$s" != "$last" ]; then echo "size=$s"; last=$s; fi
	[ "$s" = "%d %d" ] && break
	sleep 0.2
done
read line; echo "line=$line"; exit 7`, rows, cols)
}

// outerTerminal is a pty of the test's: a client (ctr, crictl) runs on its
// slave as its controlling terminal, the test reads and types on the
// master and resizes it like a terminal window.
type outerTerminal struct {
	t      *testing.T
	master *os.File
	mu     sync.Mutex
	out    []byte
	ended  chan struct{} // the client side closed (reads end)
}

// runOnTerminal starts cmd on a new pty of rows x cols, in a session of
// its own with the pty as its controlling terminal, so a resize of the
// pty sends it SIGWINCH as a terminal window's would.
func runOnTerminal(t *testing.T, cmd *exec.Cmd, rows, cols uint16) *outerTerminal {
	t.Helper()
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open /dev/ptmx: %v", err)
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(mfd)
		t.Fatalf("unlock pty: %v", err)
	}
	if err := unix.IoctlSetWinsize(mfd, unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols}); err != nil {
		unix.Close(mfd)
		t.Fatalf("size pty: %v", err)
	}
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mfd), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	if errno != 0 {
		unix.Close(mfd)
		t.Fatalf("open pty slave: %v", errno)
	}
	master, slave := os.NewFile(uintptr(mfd), "pty master"), os.NewFile(sfd, "pty slave")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	err = cmd.Start()
	slave.Close()
	if err != nil {
		master.Close()
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	o := &outerTerminal{t: t, master: master, ended: make(chan struct{})}
	go func() {
		defer close(o.ended)
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf) // EIO once the client's side is closed
			o.mu.Lock()
			o.out = append(o.out, buf[:n]...)
			o.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		<-o.ended
		master.Close()
	})
	return o
}

func (o *outerTerminal) output() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return string(o.out)
}

// waitFor waits until the terminal's output matches re, failing the test
// with the output so far if it does not within a bound.
func (o *outerTerminal) waitFor(ctx context.Context, re string) {
	o.t.Helper()
	rx := regexp.MustCompile(re)
	deadline := time.After(2 * time.Minute)
	for !rx.MatchString(o.output()) {
		select {
		case <-o.ended:
			if !rx.MatchString(o.output()) {
				o.t.Fatalf("the client ended before its terminal showed %s; it showed:\n%q", re, o.output())
			}
			return
		case <-deadline:
			o.t.Fatalf("the terminal never showed %s; it showed:\n%q", re, o.output())
		case <-ctx.Done():
			o.t.Fatalf("%v waiting for %s; the terminal showed:\n%q", ctx.Err(), re, o.output())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// resize changes the terminal's size, as a user resizing the window: the
// kernel sends the client SIGWINCH.
func (o *outerTerminal) resize(rows, cols uint16) {
	o.t.Helper()
	if err := unix.IoctlSetWinsize(int(o.master.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols}); err != nil {
		o.t.Fatalf("resize the test's terminal: %v", err)
	}
}

func (o *outerTerminal) typeIn(s string) {
	o.t.Helper()
	if _, err := o.master.Write([]byte(s)); err != nil {
		o.t.Fatalf("type %q: %v", s, err)
	}
}

// checkGuestTerminal asserts what terminalScript printed on a pty of the
// guest: a terminal of the container's devpts as stdin, stdout and stderr,
// and the sizes in the order given.
func checkGuestTerminal(t *testing.T, out string, sizes ...string) {
	t.Helper()
	// ttyname(3) finds the terminal only if it is a node of the
	// container's own /dev/pts; "not a tty" otherwise.
	if !regexp.MustCompile(`tty=/dev/pts/\d+\r+\n`).MatchString(out) {
		t.Errorf("the process's terminal is not a pty of its container's /dev/pts:\n%q", out)
	}
	if !regexp.MustCompile(`stdio-is-a-tty\r+\n`).MatchString(out) {
		t.Errorf("stdin, stdout and stderr are not all a terminal:\n%q", out)
	}
	at := 0
	for _, s := range sizes {
		loc := regexp.MustCompile(`size=` + s + `\r+\n`).FindStringIndex(out[at:])
		if loc == nil {
			t.Errorf("the guest's stty size never showed %s (after what came before):\n%q", s, out)
			return
		}
		at += loc[1]
	}
}

// TestShimContainerdTerminal: `ctr run -t` and `ctr task exec -t` give the
// process a real pty in the guest; the size of the terminal ctr runs on
// reaches the guest, and so does a resize of it (ctr forwards SIGWINCH as
// ResizePty). The guest's pty ends lines with CR LF; the terminal ctr runs
// on may add a CR of its own.
func TestShimContainerdTerminal(t *testing.T) {
	ce := newContainerdEnv(t)
	ce.terminals(t, "imagefs-blk", "virtio-fs")
}

// TestShimContainerdTerminalGuestImage is TestShimContainerdTerminal on
// Kata's guest image (the agent as the image's /sbin/init, the kernel
// with its drivers built in), with the image's configured backend.
func TestShimContainerdTerminalGuestImage(t *testing.T) {
	kit := guestImageKit(t)
	boot := fmt.Sprintf("kernel = %q\nimage = %q\n", kit+"/vmlinux-kata", kit+"/kata-containers.img")
	ce := newContainerdEnvFor(t, func() *env {
		return newEnvBooting(t, kit, boot, `shared_fs = "imagefs-blk"`+"\n", "")
	})
	ce.terminals(t, "", "")
}

// terminals runs the ctr terminal checks: `ctr run -t` in a pod on
// runBackend and `ctr task exec -t` in one on execBackend (the
// configuration's backend where "").
func (ce *containerdEnv) terminals(t *testing.T, runBackend, execBackend string) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	backend := func(b string) []string {
		if b == "" {
			return nil
		}
		return []string{"--annotation", "io.katacontainers.config.hypervisor.shared_fs=" + b}
	}
	ctrArgs := func(args ...string) []string { return append([]string{"-a", ce.sock, "-n", "test"}, args...) }

	t.Run("run", func(t *testing.T) {
		const id = "ttyrun"
		args := append(append([]string{"-t", "--rm"}, backend(runBackend)...), ce.image, id, "/bin/sh", "-c", terminalScript(50, 132))
		cmd := exec.CommandContext(ctx, containerdBin("ctr"), ctrArgs(ce.runArgs(args...)...)...)
		term := runOnTerminal(t, cmd, 24, 80)
		term.waitFor(ctx, `size=24 80\r+\n`)
		term.resize(50, 132)
		term.waitFor(ctx, `size=50 132\r+\n`)
		term.typeIn("hello\r")
		term.waitFor(ctx, `line=hello\r+\n`)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Errorf("ctr run -t: %v, want exit status 7", err)
		}
		<-term.ended
		checkGuestTerminal(t, term.output(), "24 80", "50 132")
		t.Logf("ctr run -t showed:\n%s", term.output())
	})

	t.Run("exec", func(t *testing.T) {
		const id = "ttyexec"
		if r := ce.ctr(ctx, ce.runArgs(append(append([]string{"-d"}, backend(execBackend)...), ce.image, id, "/bin/sleep", "600")...)...); r.code != 0 {
			t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
		}
		if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
			t.Fatalf("task %s is %q, want RUNNING", id, st)
		}
		cmd := exec.CommandContext(ctx, containerdBin("ctr"), ctrArgs("tasks", "exec", "-t", "--exec-id", "sh1", id, "/bin/sh", "-c", terminalScript(40, 100))...)
		term := runOnTerminal(t, cmd, 30, 90)
		term.waitFor(ctx, `size=30 90\r+\n`)
		term.resize(40, 100)
		term.waitFor(ctx, `size=40 100\r+\n`)
		term.typeIn("exec-line\r")
		term.waitFor(ctx, `line=exec-line\r+\n`)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Errorf("ctr task exec -t: %v, want exit status 7", err)
		}
		<-term.ended
		checkGuestTerminal(t, term.output(), "30 90", "40 100")
		t.Logf("ctr task exec -t showed:\n%s", term.output())

		ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
		ce.waitTaskStatus(ctx, id, "STOPPED")
		ce.ctr(ctx, "tasks", "delete", id)
		ce.ctr(ctx, "containers", "delete", id)
	})
}

// TestCRITerminal: `crictl exec -it` into a pod's container gives a real
// pty in the guest, and a resize of crictl's terminal reaches it through
// the CRI's resize stream and the shim's ResizePty.
func TestCRITerminal(t *testing.T) {
	crictlBin := crictl(t)
	c := newCRIEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	pcfg := c.podConfig("pod-tty", "imagefs-blk")
	if err := os.MkdirAll(pcfg.LogDirectory, 0o755); err != nil {
		t.Fatal(err)
	}
	r, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: pcfg, RuntimeHandler: criRuntime})
	if err != nil {
		t.Fatalf("RunPodSandbox: %v", err)
	}
	podID := r.PodSandboxId
	if err := c.trackShim(podID); err != nil {
		t.Fatal(err)
	}
	cfg := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
		Image:    &runtimeapi.ImageSpec{Image: criBusyboxImage},
		Command:  []string{"sleep", "600"},
		LogPath:  "work.log",
		Linux: &runtimeapi.LinuxContainerConfig{
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()},
		},
	}
	cr, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: pcfg})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
		t.Fatalf("StartContainer: %v", err)
	}

	cmd := exec.CommandContext(ctx, crictlBin, "--runtime-endpoint", "unix://"+c.sock, "--image-endpoint", "unix://"+c.sock, "--timeout", "2m",
		"exec", "-it", cr.ContainerId, "sh", "-c", terminalScript(50, 132))
	term := runOnTerminal(t, cmd, 24, 80)
	term.waitFor(ctx, `size=24 80\r+\n`)
	term.resize(50, 132)
	term.waitFor(ctx, `size=50 132\r+\n`)
	term.typeIn("cri-line\r")
	term.waitFor(ctx, `line=cri-line\r+\n`)
	err = cmd.Wait()
	<-term.ended
	// crictl reports the exec's status as its own failure.
	if err == nil || !strings.Contains(term.output(), "exit code 7") {
		t.Errorf("crictl exec -it: %v, want the exec's exit code 7 reported; terminal:\n%q", err, term.output())
	}
	checkGuestTerminal(t, term.output(), "24 80", "50 132")
	t.Logf("crictl exec -it showed:\n%s", term.output())

	if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
	if left := lingering(ctx, c.sock); len(left) > 0 {
		t.Errorf("shim, QEMU or virtiofsd still running after RemovePodSandbox: %v", left)
	}
}
