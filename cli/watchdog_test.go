package cli

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// fakePod makes a sandbox directory with a tmpfs mounted below it and a
// process whose command line names it, as a pod's QEMU's does.
func fakePod(t *testing.T) (dir string, proc *exec.Cmd, exited <-chan error) {
	t.Helper()
	testenv.Root(t, "mounting under the sandbox directory")
	dir = filepath.Join(t.TempDir(), "run-fake")
	must(t, os.MkdirAll(filepath.Join(dir, "shared"), 0o700))
	must(t, unix.Mount("tmpfs", filepath.Join(dir, "shared"), "tmpfs", 0, "size=1m"))
	t.Cleanup(func() { unix.Unmount(filepath.Join(dir, "shared"), unix.MNT_DETACH) })
	proc = exec.Command("tail", "-F", filepath.Join(dir, "vm", "qmp.sock"))
	must(t, proc.Start())
	ch := make(chan error, 1)
	go func() { ch <- proc.Wait() }()
	t.Cleanup(func() {
		if proc.ProcessState == nil {
			proc.Process.Kill()
			<-ch
		}
	})
	return dir, proc, ch
}

// startTestWatchdog starts the watchdog as run does, the test binary
// standing in for kata-fsx.
func startTestWatchdog(t *testing.T, dir string) (*watchdog, *syncWriter) {
	t.Helper()
	t.Setenv(cliEnv, "1")
	var stderr syncWriter
	wd, err := startWatchdog(dir, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wd.dismiss)
	return wd, &stderr
}

// TestWatchdogCleansUpAfterRunDies: once the pipe's write end closes, as
// the kernel closes it when run dies, the watchdog kills what names the
// sandbox directory, unmounts what is below it and removes it.
func TestWatchdogCleansUpAfterRunDies(t *testing.T) {
	dir, _, procExited := fakePod(t)
	wd, stderr := startTestWatchdog(t, dir)
	wd.pipe.Close()
	done := make(chan error, 1)
	go func() { done <- wd.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("watchdog: %v\n%s", err, stderr)
		}
	case <-time.After(30 * time.Second):
		wd.cmd.Process.Kill()
		t.Fatalf("the watchdog did not end 30 s after the pipe closed\n%s", stderr)
	}
	select {
	case <-procExited:
	default:
		t.Error("the process naming the sandbox directory still runs")
	}
	if m, err := mount.Under(dir); err != nil || len(m) > 0 {
		t.Errorf("mounts left under %s: %v %v", dir, m, err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sandbox directory left: %v", err)
	}
	if !strings.Contains(stderr.String(), "removed its sandbox "+dir) {
		t.Errorf("the watchdog did not say what it removed: %q", stderr)
	}
}

// TestWatchdogDismissedTouchesNothing: a run that ends normally has torn
// its pod down itself; its watchdog, dismissed first, must not act when
// the pipe then closes (here the pod is still there, to see that).
func TestWatchdogDismissedTouchesNothing(t *testing.T) {
	dir, _, procExited := fakePod(t)
	wd, stderr := startTestWatchdog(t, dir)
	wd.dismiss()
	select {
	case err := <-procExited:
		t.Fatalf("the process naming the sandbox directory ended (%v) when the watchdog was dismissed\n%s", err, stderr)
	case <-time.After(time.Second):
	}
	if m, _ := mount.Under(dir); len(m) != 1 {
		t.Errorf("mounts under %s after the dismissal: %v, want the one there was", dir, m)
	}
}

// syncWriter is a strings.Builder safe for the exec package's copying
// goroutine and the test.
type syncWriter struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}
