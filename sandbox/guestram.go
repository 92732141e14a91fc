package sandbox

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// checkGuestRAM makes sure the file system that will hold the guest's RAM
// file, when it is a file (hypervisor.GuestRAMDir: file_mem_backend's
// directory, or /dev/shm where memfd_create fails), has room for all of it
// before the VM boots. RAM there is allocated page by page as the guest
// touches it, so a file system that runs out makes a later touch raise
// SIGBUS: in QEMU, which dies, and in the shim's own vhost-user devices,
// which turn it into failed requests. Refusing up front gives the operator
// an error naming the path and the size instead. It cannot reserve the
// room (tmpfs has no reservation short of allocating the memory), so pods
// that start together, or anyone else who may write there, can still take
// it: that is why guest RAM is a memfd by default, which has no file
// system of its own and is not checked (its pages come from the host's
// memory, as anonymous RAM's would).
func checkGuestRAM(vmc *hypervisor.VMConfig) error {
	dir := hypervisor.GuestRAMDir(vmc)
	if dir == "" {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("guest RAM directory %s: %w", dir, err)
	}
	freeMiB := st.Bavail * uint64(st.Bsize) >> 20
	if freeMiB < vmc.MemoryMiB {
		return fmt.Errorf("guest RAM of %d MiB is a shared file in %s, which has only %d MiB free: "+
			"the VM would fault once the guest used more; free space in %s or grow it (for /dev/shm: mount -o remount,size=<size> /dev/shm), "+
			"or lower hypervisor.qemu.default_memory", vmc.MemoryMiB, dir, freeMiB, dir)
	}
	return nil
}
