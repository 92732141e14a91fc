package childproc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/helperproc"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const helperEnv = "KATA_FSX_CHILDPROC_HELPER"

// init keeps the main goroutine on the main thread. Go never ends the
// main thread (a locked goroutine that exits there wedges it instead), so
// a test goroutine that ran on it could not show what ending its thread
// does to the children it forked.
func init() { runtime.LockOSThread() }

// TestHelperProcess is the owner the tests kill: it starts `sleep` through
// Start and prints the child's pid.
func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "start" {
		return
	}
	cmd := exec.Command("sleep", "1000")
	if _, err := Start(cmd); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("child", cmd.Process.Pid)
	select {}
}

func alive(pid int) bool {
	// A zombie is as dead as a child gets before its parent reaps it.
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && !strings.Contains(string(st), ") Z ")
}

// TestChildDiesWithItsOwner: SIGKILL of the process that started a child
// through Start kills the child, which nothing else would.
func TestChildDiesWithItsOwner(t *testing.T) {
	owner := helperproc.Start(t, "TestHelperProcess", "child ", helperEnv+"=start")
	var pid int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		st, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(owner.Process.Pid) {
			pid, _ = strconv.Atoi(e.Name())
		}
	}
	if pid == 0 {
		t.Fatal("the helper's child not found")
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	helperproc.Kill(t, owner)
	// The kernel signals the child as the owner's threads exit; the bound
	// only keeps a broken build from hanging the test.
	testenv.Eventually(t, 5*time.Second, func() (bool, error) {
		return !alive(pid), fmt.Errorf("child %d outlived its owner's SIGKILL", pid)
	})
}

// startFromDoomedThread runs start on a goroutine locked to its thread
// that ends without unlocking, which makes Go end the thread too.
func startFromDoomedThread(t *testing.T, start func() error) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- start()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// TestChildOutlivesItsStarterThread: a child started from a thread that
// Go then ends keeps running, and is reaped through Start's channel when
// it exits. A plain exec with Pdeathsig from the same kind of thread is
// killed, which shows the test does end the starter's thread.
func TestChildOutlivesItsStarterThread(t *testing.T) {
	var exited <-chan error
	ours := exec.Command("sleep", "1000")
	startFromDoomedThread(t, func() (err error) {
		exited, err = Start(ours)
		return err
	})
	var reaped error
	reap := sync.OnceFunc(func() { reaped = <-exited })
	t.Cleanup(func() { ours.Process.Kill(); reap() })
	plain := exec.Command("sleep", "1000")
	plain.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	startFromDoomedThread(t, plain.Start)
	plainDone := make(chan error, 1)
	go func() { plainDone <- plain.Wait() }()
	select {
	case err := <-plainDone:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("the plain child ended with %v, want SIGKILL", err)
		}
	case <-time.After(30 * time.Second):
		plain.Process.Kill()
		<-plainDone
		t.Fatal("the plain child outlived its starter thread: the test did not end that thread")
	}
	if !alive(ours.Process.Pid) {
		reap()
		t.Fatalf("the child started through Start died with its starter thread: %v", reaped)
	}
	ours.Process.Signal(syscall.SIGTERM)
	reap()
	var ee *exec.ExitError
	if !errors.As(reaped, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
		t.Fatalf("reaped with %v, want the SIGTERM we sent", reaped)
	}
}
