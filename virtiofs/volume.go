package virtiofs

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/mount"
)

// Volume is one host path bound into the shared directory for a container
// mount.
type Volume struct {
	// Name is the bind's name in the shared directory, Kata's
	// <cid>-<random>-<basename of the destination>; the guest finds it under
	// the directory the share is mounted on.
	Name string
	// HostPath is the bind on the host, in the host-only mounts/ directory.
	HostPath string
	// WritableBelow says the bind is read-only at its top only and has
	// mounts below it that stay writable (ro, not rro, on an rbind). The
	// guest sees the share as one filesystem, so a read-only bind there
	// would close the mounts below too: the guest's bind must stay
	// read-write and leave the top's read-only mode to the host.
	WritableBelow bool
}

// VolumeOptions say how a host path is bound into the shared directory.
type VolumeOptions struct {
	// Recursive binds the mounts below the source too (rbind).
	Recursive bool
	// ReadOnly makes the bind's own mount read-only on the host side, so
	// even the daemon serving the share cannot write through it; mounts
	// below it keep their mode, as the container runtime leaves them.
	ReadOnly bool
	// RecursiveReadOnly makes the mounts below the bind read-only too
	// (rro).
	RecursiveReadOnly bool
	// SourceMounts is the mount namespace the source is read in; nil is
	// the caller's own.
	SourceMounts *mount.Namespace
}

// nameMax is the longest file name Linux allows.
const nameMax = 255

// ShareVolume binds src (a directory or a regular file; symlinks are
// followed, as the container runtime would) into the shared directory
// under Kata's name for container cid's mount at dest. The source is
// cloned once and checked on what was cloned, so it cannot change kind
// between the check and the bind; the bind is nosuid and nodev, and
// read-only before it is attached, so every copy of it is too.
func (s *SharedDir) ShareVolume(cid, src, dest string, o VolumeOptions) (Volume, error) {
	if err := validID(cid); err != nil {
		return Volume{}, err
	}
	from, err := o.SourceMounts.Clone(src, o.Recursive)
	if err != nil {
		return Volume{}, fmt.Errorf("source %s: %w", src, err)
	}
	defer from.Close()
	if !from.Mode.IsDir() && !from.Mode.IsRegular() {
		// Device nodes, sockets and FIFOs do not work across virtio-fs:
		// the guest would see the node, not the host's device or peer.
		return Volume{}, fmt.Errorf("source %s is a %s: only directories and regular files can be shared with the guest", src, fileKind(from.Mode))
	}
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return Volume{}, fmt.Errorf("random name for %s: %w", src, err)
	}
	name := cid + "-" + hex.EncodeToString(rnd[:]) + "-"
	base := filepath.Base(filepath.Clean(dest))
	if base == "/" || base == "." || base == ".." {
		base = "root"
	}
	if len(name)+len(base) > nameMax {
		base = base[:nameMax-len(name)]
	}
	name += base
	if err := s.bind(from, name, mount.BindOptions{ReadOnly: o.RecursiveReadOnly, TopReadOnly: o.ReadOnly}); err != nil {
		return Volume{}, fmt.Errorf("bind %s into the shared directory: %w", src, err)
	}
	v := Volume{Name: name, HostPath: filepath.Join(s.Mounts, name)}
	if o.ReadOnly && !o.RecursiveReadOnly && o.Recursive {
		// The bind as attached, not the source, which may have changed.
		below, err := mount.Under(v.HostPath)
		if err != nil {
			s.unbind(name)
			return Volume{}, fmt.Errorf("mounts below the bind of %s: %w", src, err)
		}
		v.WritableBelow = len(below) > 1
	}
	return v, nil
}

// UnshareVolume removes a volume's bind from the shared directory and the
// empty file or directory it covered.
func (s *SharedDir) UnshareVolume(v Volume) error {
	if filepath.Dir(v.HostPath) != s.Mounts || filepath.Base(v.HostPath) != v.Name {
		return fmt.Errorf("volume %s is not in the shared directory %s", v.HostPath, s.Mounts)
	}
	if err := s.unbind(v.Name); err != nil {
		return fmt.Errorf("volume %s: %w", v.Name, err)
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
