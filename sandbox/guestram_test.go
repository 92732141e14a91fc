package sandbox

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// TestCheckGuestRAM asks for guest RAM in a real directory: one MiB more
// than its file system has free is refused naming the directory and both
// sizes; what fits passes; a memfd (no file system of its own) is not
// checked; the default directory is /dev/shm.
func TestCheckGuestRAM(t *testing.T) {
	dir := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	free := st.Bavail * uint64(st.Bsize) >> 20
	vmc := &hypervisor.VMConfig{SharedMemory: hypervisor.SharedMemoryFile, MemPath: dir, MemoryMiB: free + 1}
	err := checkGuestRAM(vmc)
	if err == nil {
		t.Fatalf("%d MiB of guest RAM in %s with %d MiB free accepted", free+1, dir, free)
	}
	for _, want := range []string{dir, "only ", "default_memory"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	t.Logf("refused: %v", err)
	vmc.MemoryMiB = 1
	if err := checkGuestRAM(vmc); err != nil {
		t.Fatalf("1 MiB of guest RAM: %v", err)
	}
	vmc.MemoryMiB = 1 << 40
	vmc.SharedMemory, vmc.MemPath = hypervisor.SharedMemoryMemfd, ""
	if err := checkGuestRAM(vmc); err != nil {
		t.Fatalf("memfd RAM checked against a file system: %v", err)
	}
	vmc.SharedMemory = hypervisor.SharedMemoryFile
	if got := hypervisor.GuestRAMDir(vmc); got != "/dev/shm" {
		t.Fatalf("default guest RAM directory %q, want /dev/shm", got)
	}
	if err := checkGuestRAM(vmc); err == nil || !strings.Contains(err.Error(), "/dev/shm") {
		t.Fatalf("1 TiB of guest RAM in /dev/shm: %v, want an error naming /dev/shm", err)
	}
}
