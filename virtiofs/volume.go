package virtiofs

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
)

// Volume is one host path bound into the shared directory for a container
// mount.
type Volume struct {
	// Name is the bind's name in the shared directory, Kata's
	// <cid>-<random>-<basename of the destination>; the guest finds it under
	// the directory the share is mounted on.
	Name string
	// HostPath is the bind in the shared directory on the host.
	HostPath string
}

// VolumeOptions say how a host path is bound into the shared directory.
type VolumeOptions struct {
	// Recursive binds the mounts below the source too (rbind).
	Recursive bool
	// ReadOnly makes the bind read-only on the host side, so even the
	// daemon serving the share cannot write through it.
	ReadOnly bool
}

// nameMax is the longest file name Linux allows.
const nameMax = 255

// ShareVolume binds src (a directory or a regular file; symlinks are
// followed, as the container runtime would) into the shared directory
// under Kata's name for container cid's mount at dest.
func (s *SharedDir) ShareVolume(cid, src, dest string, o VolumeOptions) (Volume, error) {
	if err := validID(cid); err != nil {
		return Volume{}, err
	}
	resolved, err := filepath.EvalSymlinks(src)
	if err != nil {
		return Volume{}, fmt.Errorf("source %s: %w", src, err)
	}
	fi, err := os.Stat(resolved)
	if err != nil {
		return Volume{}, fmt.Errorf("source %s: %w", src, err)
	}
	if !fi.IsDir() && !fi.Mode().IsRegular() {
		// Device nodes, sockets and FIFOs do not work across virtio-fs:
		// the guest would see the node, not the host's device or peer.
		return Volume{}, fmt.Errorf("source %s is a %s: only directories and regular files can be shared with the guest", src, fileKind(fi.Mode()))
	}
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return Volume{}, fmt.Errorf("random name for %s: %w", src, err)
	}
	name := cid + "-" + hex.EncodeToString(rnd[:]) + "-"
	base := filepath.Base(filepath.Clean(dest))
	if base == "/" || base == "." {
		base = "root"
	}
	if len(name)+len(base) > nameMax {
		base = base[:nameMax-len(name)]
	}
	name += base
	v := Volume{Name: name, HostPath: filepath.Join(s.Root, name)}
	if err := makeMountPoint(v.HostPath, fi.IsDir()); err != nil {
		return Volume{}, err
	}
	flags := uintptr(unix.MS_BIND)
	if o.Recursive {
		flags |= unix.MS_REC
	}
	from := resolved
	if o.ReadOnly {
		// A remount to read-only does not propagate to the copy of the
		// share in the daemon's mount namespace; a bind of a mount that is
		// read-only already is read-only everywhere it propagates, so the
		// read-only mount is made aside first, as Kata does. Its
		// propagation is left as it comes: the unmount below then reaches
		// every copy the bind made in other mount namespaces.
		private := filepath.Join(filepath.Dir(s.Root), "private", name)
		if err := os.MkdirAll(filepath.Dir(private), 0o700); err != nil {
			os.Remove(v.HostPath)
			return Volume{}, fmt.Errorf("private mount directory: %w", err)
		}
		if err := makeMountPoint(private, fi.IsDir()); err != nil {
			os.Remove(v.HostPath)
			return Volume{}, err
		}
		defer func() {
			unix.Unmount(private, unix.MNT_DETACH)
			os.Remove(private)
			os.Remove(filepath.Dir(private))
		}()
		if err := unix.Mount(resolved, private, "", flags, ""); err != nil {
			os.Remove(v.HostPath)
			return Volume{}, fmt.Errorf("bind %s: %w", src, err)
		}
		if err := unix.Mount("", private, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			os.Remove(v.HostPath)
			return Volume{}, fmt.Errorf("make the bind of %s read-only: %w", src, err)
		}
		from = private
	}
	if err := unix.Mount(from, v.HostPath, "", flags, ""); err != nil {
		os.Remove(v.HostPath)
		return Volume{}, fmt.Errorf("bind %s into the shared directory: %w", src, err)
	}
	return v, nil
}

// UnshareVolume removes a volume's bind from the shared directory and the
// empty file or directory it covered.
func (s *SharedDir) UnshareVolume(v Volume) error {
	if filepath.Dir(v.HostPath) != s.Root {
		return fmt.Errorf("volume %s is not in the shared directory %s", v.HostPath, s.Root)
	}
	if err := unix.Unmount(v.HostPath, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount volume %s: %w", v.HostPath, err)
	}
	return removeMountPoint(v.HostPath)
}

// makeMountPoint creates what a bind of a directory or of a file covers:
// a file cannot be bound over a directory, nor a directory over a file.
func makeMountPoint(path string, dir bool) error {
	if dir {
		if err := os.Mkdir(path, 0o755); err != nil {
			return fmt.Errorf("volume mount point: %w", err)
		}
		return nil
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("volume mount point: %w", err)
	}
	return f.Close()
}

// removeMountPoint removes an unmounted mount point: an empty directory
// or an empty file. Anything else is a bind still in place or not ours,
// and stays.
func removeMountPoint(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	switch {
	case fi.IsDir():
		err = unix.Rmdir(path)
	case fi.Mode().IsRegular() && fi.Size() == 0:
		err = unix.Unlink(path)
	default:
		return fmt.Errorf("%s is not an empty mount point: left in place", path)
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}

// unmountBelow unmounts everything mounted below dir (not dir itself),
// the most recent first, and checks that nothing is left: only then may
// the tree be walked without crossing into a bound host directory.
func unmountBelow(dir string) error {
	mps, err := mount.Under(dir)
	if err != nil {
		return err
	}
	var errs []error
	for i := len(mps) - 1; i >= 0; i-- {
		if mps[i] == dir {
			continue
		}
		if err := unix.Unmount(mps[i], unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", mps[i], err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	left, err := mount.Under(dir)
	if err != nil {
		return err
	}
	for _, mp := range left {
		if mp != dir {
			return fmt.Errorf("%s is still mounted: the shared directory is left in place so nothing behind it is deleted", mp)
		}
	}
	return nil
}

func fileKind(m os.FileMode) string {
	switch {
	case m&os.ModeDevice != 0 && m&os.ModeCharDevice != 0:
		return "character device"
	case m&os.ModeDevice != 0:
		return "block device"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	}
	return "special file"
}
