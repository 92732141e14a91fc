package imagestore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// lockFile opens (or creates) path and takes a flock on it (unix.LOCK_SH
// or LOCK_EX), waiting until ctx ends. Lock files are unlinked by holders
// of their exclusive lock (Remove, a finished build), so after acquiring,
// the lock must still be on the file at path: if not, it is opened again.
func lockFile(ctx context.Context, path string, how int) (*os.File, error) {
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return nil, fmt.Errorf("imagestore: lock: %w", err)
		}
		if err := relock(ctx, f, how); err != nil {
			f.Close()
			return nil, err
		}
		if sameFile(f, path) {
			return f, nil
		}
		f.Close()
	}
}

// relock takes (or converts to) the flock how on f, polling so that ctx
// can end the wait: flock(2) itself cannot be interrupted by a context.
func relock(ctx context.Context, f *os.File, how int) error {
	wait := time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("imagestore: lock %s: %w", f.Name(), err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("imagestore: wait for %s: %w", f.Name(), context.Cause(ctx))
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// tryLock takes how on f without waiting; false means another holder.
func tryLock(f *os.File, how int) (bool, error) {
	err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("imagestore: lock %s: %w", f.Name(), err)
	}
	return true, nil
}

// sameFile says whether the open file f is still the file at path.
func sameFile(f *os.File, path string) bool {
	var a, b unix.Stat_t
	if unix.Fstat(int(f.Fd()), &a) != nil || unix.Stat(path, &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}
