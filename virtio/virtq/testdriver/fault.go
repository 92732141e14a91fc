package testdriver

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// FaultingPage returns one page of a shared file mapping whose file was
// truncated to zero, as guest RAM whose /dev/shm ran out of space: every
// access to it raises SIGBUS. The mapping is removed when t ends.
func FaultingPage(t testing.TB) []byte {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "guest-ram"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(4096); err != nil {
		t.Fatal(err)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(data) })
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	return data
}
