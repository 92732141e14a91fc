package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestRunHelloExitStatus(t *testing.T) {
	for _, backend := range []struct{ name, fstype string }{{"virtio-fs", "virtiofs"}, {"virtio-9p", "9p"}} {
		t.Run(backend.name, func(t *testing.T) {
			e := newEnv(t, "")
			rootfs := busyboxRootfs(t)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			r := e.run(ctx, "run", "--backend", backend.name, "--rootfs", rootfs, "--",
				"/bin/sh", "-c", "echo hello; cat /proc/mounts; echo from-guest > /tmp/written; exit 3")
			if r.code != 3 {
				t.Fatalf("exit %d, want 3\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
			if !strings.HasPrefix(r.stdout, "hello\n") {
				t.Fatalf("stdout %q", r.stdout)
			}
			// The container's root is the shared filesystem, as the guest sees it.
			var root string
			for _, l := range strings.Split(r.stdout, "\n") {
				if f := strings.Fields(l); len(f) > 2 && f[1] == "/" {
					root = f[2]
				}
			}
			if root != backend.fstype {
				t.Fatalf("guest / is %q, want %q:\n%s", root, backend.fstype, r.stdout)
			}
			b, err := os.ReadFile(filepath.Join(rootfs, "tmp", "written"))
			if err != nil || string(b) != "from-guest\n" {
				t.Fatalf("file written in the guest: %q %v", b, err)
			}
			if !strings.Contains(r.stderr, "backend "+backend.name) {
				t.Fatalf("backend not reported: %s", r.stderr)
			}
		})
	}
}

func TestRunCacheModeReachesVirtiofsd(t *testing.T) {
	e := newEnv(t, `virtio_fs_cache = "never"`)
	rootfs := busyboxRootfs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The C daemon spells "never" as "none"; read its command line from the guest's point of view: while the process runs.
	done := make(chan result, 1)
	go func() {
		done <- e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", rootfs, "--", "/bin/sh", "-c", "touch /tmp/started 2>/dev/null || echo x > /tmp/started; sleep 3; echo ok")
	}()
	var cmdline string
	_ = testenv.Wait(2*time.Minute, func() (bool, error) {
		for _, pid := range processesMentioning(e.dir) {
			b, _ := os.ReadFile(filepath.Join("/proc", itoa(pid), "cmdline"))
			if strings.Contains(string(b), "virtiofsd") {
				cmdline = strings.ReplaceAll(string(b), "\x00", " ")
			}
		}
		return cmdline != "", nil
	})
	r := <-done
	if r.code != 0 || !strings.Contains(r.stdout, "ok") {
		t.Fatalf("exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(cmdline, "-o cache=none") || !strings.Contains(cmdline, "-o source=") {
		t.Fatalf("virtiofsd command line %q lacks the C dialect's cache=none", cmdline)
	}
}

func TestRunVirtiofsdKilledFailsThePod(t *testing.T) {
	e := newEnv(t, "")
	rootfs := busyboxRootfs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	done := make(chan result, 1)
	go func() {
		done <- e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", rootfs, "--", "/bin/sh", "-c", "echo up > /tmp/up; sleep 600")
	}()
	// Wait until the process runs (its file appears through the share), then kill the daemon.
	_ = testenv.Wait(2*time.Minute, func() (bool, error) {
		_, err := os.Stat(filepath.Join(rootfs, "tmp", "up"))
		return err == nil, nil
	})
	killed := false
	for _, pid := range processesMentioning(e.dir) {
		b, _ := os.ReadFile(filepath.Join("/proc", itoa(pid), "cmdline"))
		if strings.Contains(string(b), "virtiofsd") {
			syscall.Kill(pid, syscall.SIGKILL)
			killed = true
		}
	}
	if !killed {
		t.Fatal("no virtiofsd found to kill")
	}
	killedAt := time.Now()
	r := <-done
	if r.code == 0 || !strings.Contains(r.stderr, "virtiofsd") {
		t.Fatalf("exit %d, stderr does not name virtiofsd:\n%s", r.code, r.stderr)
	}
	t.Logf("run failed %v after virtiofsd was killed: %s", time.Since(killedAt).Round(time.Millisecond), lastLine(r.stderr))
}

func TestRunCommandNotFound(t *testing.T) {
	e := newEnv(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r := e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", busyboxRootfs(t), "--", "/bin/no-such-command", "arg")
	if r.code != 127 || !strings.Contains(r.stderr, "no-such-command") {
		t.Fatalf("exit %d, want 127 with the agent's error naming the command:\n%s", r.code, r.stderr)
	}
}

func TestRunQEMUMissingOrFailing(t *testing.T) {
	e := newEnv(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Missing binary.
	cfg, _ := os.ReadFile(e.config)
	os.WriteFile(e.config, []byte(strings.Replace(string(cfg), `path = "/usr/bin/qemu-system-x86_64"`, `path = "/nonexistent/qemu"`, 1)), 0o644)
	r := e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", busyboxRootfs(t), "--", "/bin/true")
	if r.code == 0 || !strings.Contains(r.stderr, "/nonexistent/qemu") {
		t.Fatalf("missing QEMU: exit %d\n%s", r.code, r.stderr)
	}
	// A QEMU that fails at start: its stderr must be in the error.
	fake := filepath.Join(e.dir, "qemu-fails")
	real := "/usr/bin/qemu-system-x86_64"
	os.WriteFile(fake, []byte("#!/bin/sh\ncase \"$*\" in *-name*) echo 'qemu: simulated failure: cannot allocate guest memory' >&2; exit 1;; esac\nexec "+real+" \"$@\"\n"), 0o755)
	os.WriteFile(e.config, []byte(strings.Replace(string(cfg), `path = "/usr/bin/qemu-system-x86_64"`, `path = "`+fake+`"`, 1)), 0o644)
	r = e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", busyboxRootfs(t), "--", "/bin/true")
	if r.code == 0 || !strings.Contains(r.stderr, "simulated failure: cannot allocate guest memory") {
		t.Fatalf("failing QEMU: exit %d\n%s", r.code, r.stderr)
	}
}

func TestRunAgentNeverAnswers(t *testing.T) {
	// An initrd whose /init is busybox's init: the guest boots and stays up,
	// and nobody ever answers on the agent channel.
	kit := guestKit(t)
	e := newEnv(t, "")
	cfg, _ := os.ReadFile(e.config)
	tree := filepath.Join(e.dir, "silent-initrd")
	os.MkdirAll(filepath.Join(tree, "bin"), 0o755)
	bb, _ := os.ReadFile(filepath.Join(busyboxRootfs(t), "bin", "busybox"))
	os.WriteFile(filepath.Join(tree, "init"), bb, 0o755)
	silent := filepath.Join(e.dir, "silent-initrd.img")
	cpio := testenv.Tool(t, "cpio", "cpio")
	pack := exec.Command("sh", "-c", "find . | "+cpio+" -o -H newc --quiet > "+silent)
	pack.Dir = tree
	if out, err := pack.CombinedOutput(); err != nil {
		t.Fatalf("packing the silent initrd: %v %s", err, out)
	}
	c := strings.Replace(string(cfg), `initrd = "`+kit+`/initrd.img"`, `initrd = "`+silent+`"`, 1)
	c = strings.Replace(c, "dial_timeout = 90", "dial_timeout = 5", 1)
	os.WriteFile(e.config, []byte(c), 0o644)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r := e.run(ctx, "run", "--backend", "virtio-9p", "--rootfs", busyboxRootfs(t), "--", "/bin/true")
	if r.code == 0 || !strings.Contains(r.stderr, "guest agent unreachable after 5s") {
		t.Fatalf("exit %d\n%s", r.code, r.stderr)
	}
	t.Logf("took %v: %s", r.took.Round(time.Millisecond), lastLine(r.stderr))
}

func itoa(i int) string { return strconv.Itoa(i) }

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndex(s, "\n"); i >= 0 {
		return s[i+1:]
	}
	return s
}

func TestRunKeepThenExec(t *testing.T) {
	e := newEnv(t, "")
	rootfs := busyboxRootfs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kataFSX(t), "run", "--config", e.config, "--id", "kept", "--backend", "virtio-9p", "--keep", "--rootfs", rootfs,
		"--", "/bin/sh", "-c", "echo state > /tmp/kept; exit 4")
	// The context's end interrupts the run, which then stops its pod,
	// instead of killing it and leaving the pod behind.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGINT) }
	var out, errb syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// A test that fails before its own SIGINT still lets the kept pod go
	// down cleanly, before the environment checks for leftovers.
	t.Cleanup(func() {
		if cmd.ProcessState != nil {
			return
		}
		cmd.Process.Signal(syscall.SIGINT)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			cmd.Process.Kill()
		}
	})
	_ = testenv.Wait(3*time.Minute, func() (bool, error) {
		return strings.Contains(errb.String(), "exec into it"), nil
	})
	if !strings.Contains(errb.String(), "exited with status 4") {
		t.Fatalf("run --keep did not report the command's status:\n%s", errb.String())
	}
	r := e.run(ctx, "exec", "kept", "--", "/bin/sh", "-c", "cat /tmp/kept; exit 6")
	if r.code != 6 || r.stdout != "state\n" {
		t.Fatalf("exec: exit %d stdout %q stderr %s", r.code, r.stdout, r.stderr)
	}
	// -i forwards stdin and closes the command's stdin at its end; without
	// -i the command's stdin is closed at once, so a reader does not wait.
	ic := exec.CommandContext(ctx, kataFSX(t), "exec", "--config", e.config, "-i", "kept", "--", "/bin/wc", "-l")
	ic.Stdin = strings.NewReader("piped\nlines\n")
	if r := runCmd(t, ic); r.code != 0 || strings.TrimSpace(r.stdout) != "2" {
		t.Fatalf("exec -i: exit %d stdout %q stderr %s", r.code, r.stdout, r.stderr)
	}
	if r := e.run(ctx, "exec", "kept", "--", "/bin/cat"); r.code != 0 || r.stdout != "" {
		t.Fatalf("exec without -i: exit %d stdout %q stderr %s", r.code, r.stdout, r.stderr)
	}
	// An exec interrupted on the host is killed in the guest too.
	sc := exec.CommandContext(ctx, kataFSX(t), "exec", "--config", e.config, "kept", "--", "/bin/sh", "-c", "echo started; exec sleep 300")
	var sout, serr syncBuffer
	sc.Stdout, sc.Stderr = &sout, &serr
	if err := sc.Start(); err != nil {
		t.Fatal(err)
	}
	_ = testenv.Wait(3*time.Minute, func() (bool, error) {
		return strings.Contains(sout.String(), "started"), nil
	})
	sc.Process.Signal(syscall.SIGTERM)
	if err := sc.Wait(); err == nil {
		t.Fatalf("exec of sleep 300 ended well after SIGTERM: stdout %q stderr %s", sout.String(), serr.String())
	}
	if r := e.run(ctx, "exec", "kept", "--", "/bin/sh", "-c", "ps | grep -c '[s]leep 300'"); strings.TrimSpace(r.stdout) != "0" {
		t.Fatalf("the interrupted exec still runs in the guest: ps counts %q sleep processes (stderr %s)\nthe interrupted exec's stderr: %s", r.stdout, r.stderr, serr.String())
	}
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err == nil || cmd.ProcessState.ExitCode() != 4 {
		t.Fatalf("run --keep after SIGINT: %v (exit %d), want the command's status 4\n%s", err, cmd.ProcessState.ExitCode(), errb.String())
	}
}

// syncBuffer is a bytes.Buffer safe for a writer goroutine and a polling reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
