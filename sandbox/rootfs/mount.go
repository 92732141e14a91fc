package rootfs

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/node"
)

// Mount mounts containerd's rootfs mounts (an overlay or a bind
// snapshot) onto target, the bundle's rootfs directory, for the shared
// directory backends.
func Mount(ctx context.Context, mounts []config.Mount, target string, logf func(string, ...any)) error {
	if err := os.MkdirAll(target, 0o711); err != nil {
		return fmt.Errorf("rootfs directory: %w", err)
	}
	if len(mounts) != 1 {
		return fmt.Errorf("rootfs: %d mounts; kata-fsx mounts exactly one (overlay or bind)", len(mounts))
	}
	m := mounts[0]
	if m.Type == layerdir.MountType {
		// The kata-fsx snapshotter's remote layers: materialized from the
		// node's lazy store, then an ordinary overlay.
		if err := layerdir.Mount(ctx, m.Source, target, m.Options, logf); err != nil {
			return fmt.Errorf("mount %s rootfs on %s: %w", m.Type, target, err)
		}
		return nil
	}
	flags, data := mount.ParseOptions(m.Options)
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

// Unmount unmounts everything stacked on target; absent or
// unmounted targets are fine.
func Unmount(target string) error {
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

// IsLazyImage reports whether ref names a registry image a pod's
// annotation may ask to read lazily (registry:HOST/REPO[:TAG|@DIGEST]).
func IsLazyImage(ref string) bool { return lazyroot.IsSource(ref) }

// OpenLazyImage opens registry image ref from the node's lazy store, as
// configured in cfg; logf gets its progress.
func OpenLazyImage(ctx context.Context, ref string, cfg *config.Config, logf func(string, ...any)) (*lazyroot.Root, error) {
	return lazyroot.Open(ctx, ref, node.LazyRootOptions(cfg, logf))
}
