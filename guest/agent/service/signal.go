package service

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// startupGrace bounds how long a signal to a container's first process
// waits for the process to catch it. That process is PID 1 of its PID
// namespace, and the kernel drops a signal PID 1 neither catches nor
// ignores; a stop sent right after the start (CRI's StopContainer a few
// milliseconds after StartContainer) reaches a slow guest's process before
// its handler exists and is lost, leaving the caller's whole grace period
// to run out before SIGKILL.
const startupGrace = 2 * time.Second

// awaitHandler waits, until the process has run for startupGrace or done
// is closed, for pid to catch or ignore sig. It returns at once for
// SIGKILL and SIGSTOP, which PID 1 cannot refuse. It returns how many
// times it found the signal unhandled and waited.
func awaitHandler(pid int, sig syscall.Signal, started time.Time, done <-chan struct{}) (waits int) {
	if sig == syscall.SIGKILL || sig == syscall.SIGSTOP {
		return 0
	}
	deadline := started.Add(startupGrace)
	for time.Now().Before(deadline) {
		handled, err := handlesSignal(pid, sig)
		if err != nil || handled {
			return waits
		}
		waits++
		select {
		case <-done:
			return waits
		case <-time.After(5 * time.Millisecond):
		}
	}
	return waits
}

// handlesSignal reports whether pid catches or ignores sig, from its
// /proc status masks.
func handlesSignal(pid int, sig syscall.Signal) (bool, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || (k != "SigCgt" && k != "SigIgn") {
			continue
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		if err != nil {
			return false, fmt.Errorf("pid %d: %s: %w", pid, k, err)
		}
		if mask&(1<<(uint(sig)-1)) != 0 {
			return true, nil
		}
	}
	return false, sc.Err()
}
