package service

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func TestAwaitHandlerWaitsForTheTrap(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", `sleep 0.3; trap "exit 3" TERM; while :; do sleep 0.05; done`)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { _ = cmd.Process.Kill(); <-done }()
	start := time.Now()
	if h, err := handlesSignal(cmd.Process.Pid, syscall.SIGTERM); err != nil || h {
		t.Fatalf("before the trap: handles SIGTERM = %v, %v; want false", h, err)
	}
	if waits := awaitHandler(cmd.Process.Pid, syscall.SIGTERM, start, done); waits == 0 {
		t.Error("awaitHandler did not wait for the trap")
	}
	if h, err := handlesSignal(cmd.Process.Pid, syscall.SIGTERM); err != nil || !h {
		t.Fatalf("awaitHandler returned after %s with SIGTERM not caught (%v, %v)", time.Since(start), h, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the trapped SIGTERM did not end the shell")
	}
	if code := cmd.ProcessState.ExitCode(); code != 3 {
		t.Errorf("exit code %d, want the trap's 3", code)
	}
}

func TestAwaitHandlerGivesUpAfterTheGrace(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { _ = cmd.Process.Kill(); <-done }()
	// A process that started longer ago than the grace is signalled at once.
	if waits := awaitHandler(cmd.Process.Pid, syscall.SIGTERM, time.Now().Add(-startupGrace), done); waits != 0 {
		t.Errorf("awaitHandler waited %d times for a process past its start-up grace", waits)
	}
	// SIGKILL never waits.
	if waits := awaitHandler(cmd.Process.Pid, syscall.SIGKILL, time.Now(), done); waits != 0 {
		t.Errorf("awaitHandler waited %d times for SIGKILL", waits)
	}
}
