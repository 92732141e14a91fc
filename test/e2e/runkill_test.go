package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/mount"
)

// startPodRun starts `kata-fsx run --id id` of a command that prints "up"
// and sleeps, and returns once the command runs in the guest (its output
// reached the host). The run is SIGKILLed at the end of the test if it is
// still there.
func startPodRun(t *testing.T, e *env, id, backend string) (*exec.Cmd, *syncBuffer, <-chan error) {
	t.Helper()
	cmd := exec.Command(kataFSX(t), "run", "--config", e.config, "--id", id, "--backend", backend, "--rootfs", busyboxRootfs(t),
		"--", "/bin/sh", "-c", "echo up; exec sleep 1000")
	var out, errb syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-exited
		}
	})
	deadline := time.After(3 * time.Minute)
	for !strings.Contains(out.String(), "up\n") {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("run ended (%v) before its command started:\n%s", err, errb.String())
		case <-deadline:
			t.Fatalf("the command never started in the guest:\n%s", errb.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return cmd, &errb, exited
}

// podLeftovers lists what of a pod whose directory is dir is still on the
// host: QEMU and virtiofsd processes naming the directory, the directory,
// and mounts at or below it.
func podLeftovers(dir string) []string {
	var left []string
	for _, exe := range []string{"qemu-system", "virtiofsd"} {
		for _, pid := range pidsOf(dir, exe) {
			left = append(left, "process "+describeProcess(pid))
		}
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		left = append(left, "directory "+dir)
	}
	left = append(left, mountsUnder(dir)...)
	return left
}

// mountsUnder lists this mount namespace's mounts at or below dir, each
// as "mount <point>" (mount.Under; its error as the one line).
func mountsUnder(dir string) []string {
	mps, err := mount.Under(dir)
	if err != nil {
		return []string{"mountinfo: " + err.Error()}
	}
	out := make([]string, len(mps))
	for i, mp := range mps {
		out[i] = "mount " + mp
	}
	return out
}

// TestRunSIGKILLLeavesNothing: SIGKILL of `kata-fsx run` leaves no QEMU,
// virtiofsd, sandbox directory or mount under it within 5 s. The dead
// run cleans nothing: QEMU and virtiofsd die by their parent-death
// signal, and run's watchdog removes the directory and its mounts.
func TestRunSIGKILLLeavesNothing(t *testing.T) {
	for _, backend := range []string{"virtio-fs", "imagefs-blk"} {
		t.Run(backend, func(t *testing.T) {
			e := newEnv(t, "")
			id := "killed-" + backend
			dir := filepath.Join(e.stateDir, id)
			cmd, stderr, exited := startPodRun(t, e, id, backend)
			// What the kill must take away is there.
			if len(pidsOf(dir, "qemu-system")) != 1 {
				t.Fatalf("no QEMU names %s", dir)
			}
			if backend == "virtio-fs" && (len(pidsOf(dir, "virtiofsd")) == 0 || len(mountsUnder(dir)) == 0) {
				t.Fatalf("virtio-fs pod without virtiofsd or the rootfs bind under %s: %v", dir, mountsUnder(dir))
			}
			if err := cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			// The requirement's bound: nothing left within 5 s.
			for left := podLeftovers(dir); len(left) > 0; left = podLeftovers(dir) {
				if time.Since(killed) > 5*time.Second {
					t.Fatalf("5 s after SIGKILL of kata-fsx run, left:\n  %s\nstderr:\n%s", strings.Join(left, "\n  "), stderr.String())
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("nothing left %v after the SIGKILL", time.Since(killed).Round(time.Millisecond))
			// run's stderr closes once the watchdog, which shares it, is gone.
			select {
			case <-exited:
			case <-time.After(time.Minute):
				t.Fatal("run's stderr still open a minute after the kill")
			}
			t.Logf("stderr: %s", lastLine(stderr.String()))
		})
	}
}

// TestRunSIGTERMTwiceTearsDown: a second SIGTERM while `kata-fsx run`
// tears its pod down does not end it before the teardown is done: run
// exits with 130 of its own accord, and nothing of the pod is left at that
// moment. The pod's QEMU is stopped (SIGSTOP) first, so the teardown
// waits on a guest that never answers and is surely under way when the
// second signal comes.
func TestRunSIGTERMTwiceTearsDown(t *testing.T) {
	e := newEnv(t, "")
	const id = "sigterm-twice"
	dir := filepath.Join(e.stateDir, id)
	cmd, stderr, exited := startPodRun(t, e, id, "virtio-fs")
	qemu := pidsOf(dir, "qemu-system")
	if len(qemu) != 1 {
		t.Fatalf("QEMU processes naming %s: %v", dir, qemu)
	}
	if err := syscall.Kill(qemu[0], syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(qemu[0], syscall.SIGCONT) })
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Once run says it stops the pod (or after a second, for a run that
	// says nothing), the second SIGTERM.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	for ctx.Err() == nil && !strings.Contains(stderr.String(), "stopping the pod") {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("second SIGTERM: %v (run already gone?)\n%s", err, stderr.String())
	}
	var err error
	select {
	case err = <-exited:
	case <-time.After(2 * time.Minute):
		t.Fatalf("run still tearing down 2 minutes after SIGTERM:\n%s", stderr.String())
	}
	left := podLeftovers(dir)
	ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if ws.Signaled() || ws.ExitStatus() != 130 {
		t.Errorf("run ended with %v, want exit status 130 after its teardown", err)
	}
	if len(left) > 0 {
		t.Errorf("left when run exited:\n  %s", strings.Join(left, "\n  "))
	}
	if !strings.Contains(stderr.String(), "SIGTERM again") {
		t.Errorf("run did not acknowledge the second SIGTERM")
	}
	if t.Failed() {
		t.Logf("stderr:\n%s", stderr.String())
	}
}
