package virtq_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// truncatedMapping maps n bytes of a file shared, as guest RAM is mapped
// from /dev/shm, and returns the mapping with a function that sets the
// file's size: at 0, every access to the mapping raises SIGBUS, as when the
// file system behind guest RAM runs out of space; at n it is backed again
// (with zeros).
func truncatedMapping(t *testing.T, n int) ([]byte, func(int64)) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "guest-ram"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(n)); err != nil {
		t.Fatal(err)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(data) })
	path := f.Name()
	return data, func(size int64) {
		if err := os.Truncate(path, size); err != nil {
			t.Fatal(err)
		}
	}
}

// TestGuestMemoryFault puts the rings in guest memory whose backing file
// is then truncated: popping, publishing and the notification checks must
// break the queue with ErrFault, not kill the process with SIGBUS.
func TestGuestMemoryFault(t *testing.T) {
	const size = 16
	data, resize := truncatedMapping(t, regLen)
	mem, err := virtq.NewMemory([]virtq.Region{{GuestAddr: regA, Size: regLen, UserAddr: 0x7f0000000000, Data: data}})
	if err != nil {
		t.Fatal(err)
	}
	for _, op := range []string{"Pop", "PushUsed", "EnableNotification", "New"} {
		t.Run(op, func(t *testing.T) {
			// Back the memory for the setup, then take the backing away.
			desc, avail, used, _ := testdriver.Layout(regA, size)
			resize(regLen)
			drv := testdriver.New(mem, size, desc, avail, used)
			drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 16}))
			q, err := virtq.New(mem, virtq.Config{Size: size, DescAddr: desc, AvailAddr: avail, UsedAddr: used})
			if err != nil {
				t.Fatal(err)
			}
			resize(0)
			switch op {
			case "Pop":
				var c virtq.Chain
				_, err = q.Pop(&c)
			case "PushUsed":
				err = q.PushUsed(0, 0)
			case "EnableNotification":
				if q.EnableNotification() {
					t.Error("EnableNotification on faulting memory reported more buffers")
				}
				if !q.Broken() {
					t.Fatal("EnableNotification: queue not broken after a fault")
				}
				return
			case "New":
				_, err = virtq.New(mem, virtq.Config{Size: size, DescAddr: desc, AvailAddr: avail, UsedAddr: used})
				if !errors.Is(err, virtq.ErrFault) {
					t.Fatalf("New on faulting memory: %v, want ErrFault", err)
				}
				return
			}
			if !errors.Is(err, virtq.ErrBroken) || !errors.Is(err, virtq.ErrFault) {
				t.Fatalf("%s on faulting memory: %v, want ErrBroken and ErrFault", op, err)
			}
			if !q.Broken() {
				t.Fatalf("%s: queue not broken after a fault", op)
			}
		})
	}
}
