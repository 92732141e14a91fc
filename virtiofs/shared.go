package virtiofs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// GuestSharedMount is where the guest agent mounts the kataShared tag, as Kata does.
const GuestSharedMount = "/run/kata-containers/shared/containers/"

// SharedDir is a sandbox's shared/ directory, the tree virtiofsd exports.
// It is its own mount with shared propagation, so container rootfs binds
// made after virtiofsd started (in its own mount namespace) reach it.
type SharedDir struct {
	Root string
}

// NewSharedDir creates <sandboxDir>/shared (the sandbox directory 0700) and
// makes it a shared mount point.
func NewSharedDir(sandboxDir string) (*SharedDir, error) {
	if err := os.MkdirAll(sandboxDir, 0o700); err != nil {
		return nil, fmt.Errorf("sandbox directory: %w", err)
	}
	root := filepath.Join(sandboxDir, "shared")
	if err := os.Mkdir(root, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("shared directory: %w", err)
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
		return nil, fmt.Errorf("bind %s onto itself: %w", root, err)
	}
	if err := unix.Mount("", root, "", unix.MS_SHARED, ""); err != nil {
		unix.Unmount(root, unix.MNT_DETACH)
		return nil, fmt.Errorf("make %s a shared mount: %w", root, err)
	}
	return &SharedDir{Root: root}, nil
}

func validID(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") || len(id) > 255 {
		return fmt.Errorf("invalid container id %q", id)
	}
	return nil
}

// BindRootfs bind-mounts a container's rootfs to shared/<cid>/rootfs and
// returns the path the guest sees it at.
func (s *SharedDir) BindRootfs(cid, src string, readonly bool) (string, error) {
	if err := validID(cid); err != nil {
		return "", err
	}
	dst := filepath.Join(s.Root, cid, "rootfs")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return "", fmt.Errorf("container %s rootfs mount point: %w", cid, err)
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return "", fmt.Errorf("bind container %s rootfs %s: %w", cid, src, err)
	}
	if readonly {
		if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			unix.Unmount(dst, unix.MNT_DETACH)
			return "", fmt.Errorf("make container %s rootfs read-only: %w", cid, err)
		}
	}
	return GuestSharedMount + cid + "/rootfs", nil
}

// Unbind removes a container's rootfs bind and its directory.
func (s *SharedDir) Unbind(cid string) error {
	if err := validID(cid); err != nil {
		return err
	}
	dir := filepath.Join(s.Root, cid)
	if err := unix.Unmount(filepath.Join(dir, "rootfs"), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount container %s rootfs: %w", cid, err)
	}
	return removeEmptyTree(dir)
}

// Cleanup unmounts every container bind and volume and the shared
// directory itself and removes it. Nothing under it is deleted that is not an empty directory, so
// a bind that failed to unmount never costs a container's files.
func (s *SharedDir) Cleanup() error {
	// Volume binds go first: walking the tree with a host directory still
	// bound below it could remove that directory's empty subdirectories.
	if err := unmountBelow(s.Root); err != nil {
		return err
	}
	entries, _ := os.ReadDir(s.Root)
	var errs []error
	for _, e := range entries {
		if !e.IsDir() {
			// A single-file volume's mount point.
			if err := removeMountPoint(filepath.Join(s.Root, e.Name())); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if err := s.Unbind(e.Name()); err != nil {
			errs = append(errs, err)
		}
	}
	if err := unix.Unmount(s.Root, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("unmount %s: %w", s.Root, err))
	}
	if err := removeEmptyTree(s.Root); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeEmptyTree removes dir and its subdirectories, which must all be
// empty directories; a file or a mount still in place is an error.
func removeEmptyTree(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !e.IsDir() {
			return fmt.Errorf("%s is not empty: %s", dir, e.Name())
		}
		if err := removeEmptyTree(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}
