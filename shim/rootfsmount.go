package shim

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
)

// mountFlags maps the mount(8) options containerd uses to mount flags;
// the rest is filesystem data.
var mountFlags = map[string]struct {
	clear bool
	flag  uintptr
}{
	"ro": {false, unix.MS_RDONLY}, "rw": {true, unix.MS_RDONLY},
	"bind": {false, unix.MS_BIND}, "rbind": {false, unix.MS_BIND | unix.MS_REC},
	"nosuid": {false, unix.MS_NOSUID}, "suid": {true, unix.MS_NOSUID},
	"nodev": {false, unix.MS_NODEV}, "dev": {true, unix.MS_NODEV},
	"noexec": {false, unix.MS_NOEXEC}, "exec": {true, unix.MS_NOEXEC},
	"noatime": {false, unix.MS_NOATIME}, "relatime": {false, unix.MS_RELATIME},
	"nodiratime": {false, unix.MS_NODIRATIME}, "sync": {false, unix.MS_SYNCHRONOUS},
	"async": {true, unix.MS_SYNCHRONOUS}, "defaults": {false, 0},
}

func parseMountOptions(opts []string) (uintptr, string) {
	var flags uintptr
	var data []string
	for _, o := range opts {
		if f, ok := mountFlags[o]; ok {
			if f.clear {
				flags &^= f.flag
			} else {
				flags |= f.flag
			}
			continue
		}
		data = append(data, o)
	}
	return flags, strings.Join(data, ",")
}

// mountRootfs mounts containerd's rootfs mounts (an overlay or a bind
// snapshot) onto target, the bundle's rootfs directory, for the shared
// directory backends.
func mountRootfs(mounts []config.Mount, target string) error {
	if err := os.MkdirAll(target, 0o711); err != nil {
		return fmt.Errorf("rootfs directory: %w", err)
	}
	if len(mounts) != 1 {
		return fmt.Errorf("rootfs: %d mounts; kata-fsx mounts exactly one (overlay or bind)", len(mounts))
	}
	m := mounts[0]
	flags, data := parseMountOptions(m.Options)
	typ := m.Type
	if flags&unix.MS_BIND != 0 {
		typ = ""
		data = ""
	}
	if err := unix.Mount(m.Source, target, typ, flags&^unix.MS_RDONLY, data); err != nil {
		return fmt.Errorf("mount %s rootfs %s on %s: %w", m.Type, m.Source, target, err)
	}
	if flags&unix.MS_RDONLY != 0 {
		// A bind mount takes ro only on a remount.
		if err := unix.Mount("", target, "", flags|unix.MS_REMOUNT, ""); err != nil {
			_ = unix.Unmount(target, unix.MNT_DETACH)
			return fmt.Errorf("remount rootfs %s read-only: %w", target, err)
		}
	}
	return nil
}

// unmountRootfs unmounts everything stacked on target; absent or
// unmounted targets are fine.
func unmountRootfs(target string) error {
	for i := 0; i < 16; i++ {
		err := unix.Unmount(target, 0)
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(target, unix.MNT_DETACH)
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil
		default:
			return fmt.Errorf("unmount rootfs %s: %w", target, err)
		}
	}
	return fmt.Errorf("unmount rootfs %s: still mounted after 16 unmounts", target)
}
