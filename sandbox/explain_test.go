package sandbox

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
)

func TestExplainWaitsForTheVMsDeath(t *testing.T) {
	s := &Sandbox{ID: "p", state: StateReady, failed: make(chan struct{}), stopping: make(chan struct{}), stopped: make(chan struct{})}
	go func() {
		time.Sleep(100 * time.Millisecond)
		s.fail(errors.New("QEMU exited (signal: killed)"))
	}()
	err := s.Explain(fmt.Errorf("exec: %w", ttrpc.ErrClosed))
	if !errors.Is(err, ErrFailed) || !errors.Is(err, ttrpc.ErrClosed) {
		t.Fatalf("Explain = %v, want the VM's death wrapping the closed channel", err)
	}

	other := &Sandbox{ID: "q", state: StateReady, failed: make(chan struct{}), stopping: make(chan struct{}), stopped: make(chan struct{})}
	plain := errors.New("no such process")
	if err := other.Explain(plain); err != plain {
		t.Fatalf("Explain of a guest error = %v, want it unchanged", err)
	}
}
