package virtiofs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
)

// GuestSharedMount is where the guest agent mounts the kataShared tag, as Kata does.
const GuestSharedMount = "/run/kata-containers/shared/containers/"

// SharedDir is a sandbox's share with the guest, split as Kata splits it
// so that the guest never writes a directory the shim resolves a path
// through:
//
//	<sandbox>/mounts/   host-only: the shim makes each container's rootfs
//	                    bind (<cid>/rootfs) and each volume bind here
//	<sandbox>/shared/   what virtiofsd (or 9p) exports: a read-only,
//	                    nosuid, nodev bind of mounts/ that receives (as a
//	                    slave) every bind made there later
//
// The binds themselves keep their own write access (a container's rootfs
// and rw volumes stay writable for the guest) and are all nosuid and
// nodev; the directories above them are read-only to the guest. Every
// mount, unmount and removal goes through a mount.Tree on mounts/: fd
// relative, beneath it, no symlink followed, and an unmount only of the
// mount id that was made.
type SharedDir struct {
	// Root is the shared/ directory the daemon exports.
	Root string
	// Mounts is the host-only mounts/ directory the shim binds into.
	Mounts string

	tree *mount.Tree
	// mu guards ids alone, a leaf lock: mounts and unmounts run without it.
	mu  sync.Mutex
	ids map[string]uint64 // bind name below Mounts -> its mount id
}

// NewSharedDir creates <sandboxDir>/mounts (a shared mount, so binds made
// there after the daemon started, in its own mount namespace, reach it)
// and <sandboxDir>/shared, the read-only view of it.
func NewSharedDir(sandboxDir string) (s *SharedDir, err error) {
	if err := os.MkdirAll(sandboxDir, 0o700); err != nil {
		return nil, fmt.Errorf("sandbox directory: %w", err)
	}
	sb, err := mount.OpenTree(sandboxDir)
	if err != nil {
		return nil, fmt.Errorf("sandbox directory: %w", err)
	}
	defer sb.Close()
	s = &SharedDir{Root: filepath.Join(sandboxDir, "shared"), Mounts: filepath.Join(sandboxDir, "mounts"), ids: map[string]uint64{}}
	defer func() {
		if err != nil {
			err = errors.Join(err, s.Cleanup())
		}
	}()
	if err := sb.Mkdir("mounts", 0o755); err != nil {
		return nil, fmt.Errorf("shared directory: %w", err)
	}
	if err := unix.Mount(s.Mounts, s.Mounts, "", unix.MS_BIND, ""); err != nil {
		return nil, fmt.Errorf("bind %s onto itself: %w", s.Mounts, err)
	}
	if err := unix.Mount("", s.Mounts, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return nil, fmt.Errorf("make %s nosuid, nodev: %w", s.Mounts, err)
	}
	if err := unix.Mount("", s.Mounts, "", unix.MS_SHARED, ""); err != nil {
		return nil, fmt.Errorf("make %s a shared mount: %w", s.Mounts, err)
	}
	if s.tree, err = mount.OpenTree(s.Mounts); err != nil {
		return nil, fmt.Errorf("shared directory: %w", err)
	}
	src, err := mount.Clone(s.Mounts, false)
	if err != nil {
		return nil, fmt.Errorf("shared directory: %w", err)
	}
	defer src.Close()
	if _, err := sb.Attach(src, "shared", mount.BindOptions{ReadOnly: true, Propagation: unix.MS_SLAVE}); err != nil {
		return nil, fmt.Errorf("shared directory: %w", err)
	}
	return s, nil
}

func validID(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") || len(id) > 255 {
		return fmt.Errorf("invalid container id %q", id)
	}
	return nil
}

// bind attaches a clone of src below mounts/ at rel and records its id.
func (s *SharedDir) bind(src *mount.Source, rel string, o mount.BindOptions) error {
	id, err := s.tree.Attach(src, rel, o)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.ids[rel] = id
	s.mu.Unlock()
	return nil
}

// unbind detaches the bind at rel, if this SharedDir made one, and
// removes its mount point.
func (s *SharedDir) unbind(rel string) error {
	s.mu.Lock()
	id, ok := s.ids[rel]
	s.mu.Unlock()
	if ok {
		if err := s.tree.Unmount(rel, id); err != nil {
			return err
		}
		s.mu.Lock()
		delete(s.ids, rel)
		s.mu.Unlock()
	}
	return s.tree.RemoveEmpty(rel)
}

// BindRootfs bind-mounts a container's rootfs to mounts/<cid>/rootfs and
// returns the path the guest sees it at.
func (s *SharedDir) BindRootfs(cid, src string, readonly bool) (string, error) {
	if err := validID(cid); err != nil {
		return "", err
	}
	from, err := mount.Clone(src, true)
	if err != nil {
		return "", fmt.Errorf("container %s rootfs: %w", cid, err)
	}
	defer from.Close()
	if !from.Mode.IsDir() {
		return "", fmt.Errorf("container %s rootfs %s is not a directory", cid, src)
	}
	if err := s.tree.Mkdir(cid, 0o755); err != nil {
		return "", fmt.Errorf("container %s: %w", cid, err)
	}
	if err := s.bind(from, cid+"/rootfs", mount.BindOptions{ReadOnly: readonly}); err != nil {
		return "", errors.Join(fmt.Errorf("bind container %s rootfs %s: %w", cid, src, err), s.tree.RemoveEmpty(cid))
	}
	return GuestSharedMount + cid + "/rootfs", nil
}

// Unbind removes a container's rootfs bind and its directory.
func (s *SharedDir) Unbind(cid string) error {
	if err := validID(cid); err != nil {
		return err
	}
	if err := s.unbind(cid + "/rootfs"); err != nil {
		return fmt.Errorf("container %s rootfs: %w", cid, err)
	}
	return s.tree.RemoveEmpty(cid)
}

// Cleanup unmounts every container bind and volume, the read-only view
// and mounts/ itself, and removes both. Nothing is deleted that is not an
// empty directory or an empty mount-point file, so a bind that failed to
// unmount never costs a container's or a volume's files.
func (s *SharedDir) Cleanup() error {
	sb, err := mount.OpenTree(filepath.Dir(s.Mounts))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer sb.Close()
	if s.tree != nil {
		s.tree.Close()
		s.tree = nil
	}
	// The view first: its copies of the binds go with it. Only what the
	// mount table shows at or below the two is unmounted, each checked to
	// be the mount found there.
	var errs []error
	for _, name := range []string{"shared", "mounts"} {
		if err := sb.UnmountAll(name); err != nil {
			return err
		}
	}
	for _, name := range []string{"shared", "mounts"} {
		if err := sb.RemoveEmpty(name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
