package testenv

import (
	"errors"
	"testing"
	"time"
)

// Poll is how often Eventually asks its condition again.
const Poll = 10 * time.Millisecond

// Eventually waits until cond reports true, asking it every Poll, and
// fails t if timeout passes first. An error from cond says why the
// condition is not met yet: the last one is in the failure, so a test
// that waits for a state names the state it saw instead of sleeping a
// fixed time and hoping. The last call comes at or after the deadline.
func Eventually(t testing.TB, timeout time.Duration, cond func() (bool, error)) {
	t.Helper()
	if err := Wait(timeout, cond); err != nil {
		t.Fatalf("not within %v: %v", timeout, err)
	}
}

// Wait is Eventually for a caller that handles the timeout itself (a
// helper process, a goroutine that may not call t.Fatal): it returns nil
// once cond reports true, else cond's last error, or a plain one.
func Wait(timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if !time.Now().Before(deadline) {
			if err == nil {
				err = errNotMet
			}
			return err
		}
		time.Sleep(min(Poll, time.Until(deadline)+time.Millisecond))
	}
}

var errNotMet = errors.New("condition not met")
