package sandbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

func TestStateMoves(t *testing.T) {
	all := []State{StateBooting, StateReady, StateFailed, StateStopping, StateStopped}
	allowed := map[[2]State]bool{
		{StateBooting, StateReady}: true, {StateBooting, StateFailed}: true, {StateBooting, StateStopping}: true,
		{StateReady, StateFailed}: true, {StateReady, StateStopping}: true,
		{StateFailed, StateStopping}:  true,
		{StateStopping, StateStopped}: true,
	}
	for _, from := range all {
		for _, to := range all {
			if got := canMove(from, to); got != allowed[[2]State{from, to}] {
				t.Errorf("canMove(%s, %s) = %v", from, to, got)
			}
		}
	}
}

// bareSandbox is a sandbox that has started nothing: enough to drive the
// lifecycle without a VM.
func bareSandbox(t *testing.T) *Sandbox {
	t.Helper()
	cfg := config.Default()
	cfg.KataFSX.StateDir = t.TempDir()
	s, err := newSandbox(context.Background(), "pod-1", config.Decision{Config: cfg, Backend: config.SharedFSImagefsBlk})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestFailedSandboxRefusesWorkAndStops(t *testing.T) {
	s := bareSandbox(t)
	s.mu.Lock()
	if err := s.moveLocked(StateReady); err != nil {
		t.Fatal(err)
	}
	s.mu.Unlock()
	exited := make(chan struct{})
	s.watch(func() (<-chan struct{}, func() error) {
		return exited, func() error { return errors.New("qemu: killed") }
	})
	close(exited)
	<-s.Failed()
	if s.State() != StateFailed || !errors.Is(s.Err(), ErrFailed) {
		t.Fatalf("after a component died: state %s, err %v", s.State(), s.Err())
	}
	// A second death changes nothing: the first cause is kept.
	s.fail(errors.New("virtiofsd: killed"))
	if err := s.Err(); err == nil || err.Error() != "sandbox failed: pod-1: qemu: killed" {
		t.Fatalf("Err after a second death: %v", err)
	}
	err := s.CreateContainer(context.Background(), ContainerSpec{ID: "c1"})
	var se *StateError
	if !errors.As(err, &se) || se.State != StateFailed || !errors.Is(err, ErrFailed) {
		t.Fatalf("CreateContainer in a failed sandbox: %v", err)
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if s.State() != StateStopped {
		t.Fatalf("state after Stop: %s", s.State())
	}
	if _, err := os.Stat(s.Dir); !os.IsNotExist(err) {
		t.Fatalf("sandbox directory left behind: %v", err)
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
}

// TestStopReportsTeardownErrors leaves a mount below the sandbox
// directory, which Stop must not remove through: the error is returned,
// by the second Stop too, and the sandbox still ends stopped.
func TestStopReportsTeardownErrors(t *testing.T) {
	testenv.Root(t, "mounting a tmpfs in the sandbox directory")
	s := bareSandbox(t)
	mp := filepath.Join(s.Dir, "shared")
	if err := os.MkdirAll(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(mp, unix.MNT_DETACH)
	err := s.Stop(context.Background())
	if err == nil || !strings.Contains(err.Error(), "remove sandbox directory") || !strings.Contains(err.Error(), mp) {
		t.Fatalf("Stop with a mount left below the sandbox: %v", err)
	}
	if s.State() != StateStopped {
		t.Fatalf("state after a failed teardown: %s", s.State())
	}
	if err2 := s.Stop(context.Background()); err2 == nil || err2.Error() != err.Error() {
		t.Fatalf("second Stop: %v, want %v", err2, err)
	}
	if _, err := s.backend.(*imagefsBackend).createDisk(context.Background(), "c2", config.Rootfs{Kind: config.RootfsDir, Layers: []string{t.TempDir()}}, nil, nil); err == nil || !strings.Contains(err.Error(), "sandbox is stopped") {
		t.Fatalf("createDisk after Stop: %v", err)
	}
}

// An imagefs-blk pod's volume share and Stop are serialised by the
// backend: a share started during Stop finishes or fails before the
// backend's teardown looks at it, and none starts after (go test -race).
func TestStopAndVolumeShareDoNotRace(t *testing.T) {
	s := bareSandbox(t)
	s.mu.Lock()
	if err := s.moveLocked(StateReady); err != nil {
		t.Fatal(err)
	}
	s.mu.Unlock()
	b := s.backend.(*imagefsBackend)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 100; i++ {
			// No virtiofsd is configured: each start fails and undoes itself.
			if _, _, _, err := b.volumeShare(context.Background()); err == nil {
				t.Error("a volume share started with no virtiofsd")
				return
			}
			_ = b.unshareVolumes([]virtiofs.Volume{{Name: "x"}})
		}
	}()
	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-done
	var se *StateError
	if _, _, _, err := b.volumeShare(context.Background()); !errors.As(err, &se) {
		t.Fatalf("volume share after Stop: %v, want a StateError", err)
	}
}
