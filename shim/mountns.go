package shim

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
)

// enterOwnMounts makes the mount namespace start gave the server its
// own: every mount in it becomes a slave, so the host's later mounts
// still reach it where the host shares them and nothing the shim mounts
// reaches the host. It refuses to go on in the host's own namespace,
// where the share's binds would pin host directories.
func enterOwnMounts(host *mount.Namespace) error {
	own, err := mount.OwnNamespace()
	if err != nil {
		return err
	}
	if own == host.Inode() {
		return fmt.Errorf("the shim server runs in the host's mount namespace (%d): start did not give it one of its own", own)
	}
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make the shim's mount namespace a slave of the host's: %w", err)
	}
	return nil
}
