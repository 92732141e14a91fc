package mount

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Tree is a directory the shim makes mounts in, held open so that every
// operation below it starts from its descriptor: names are resolved
// beneath it without following a symlink, and without crossing a mount
// except, where a mount is the target, at the last component. A name
// planted or swapped below it can then neither lead the shim outside the
// tree nor onto a mount the shim did not make; what is not as expected is
// refused, never followed.
type Tree struct {
	path string
	fd   int // O_PATH|O_DIRECTORY
}

// strict is how a Tree resolves the directories above a target.
const strict = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// OpenTree opens the directory path (not a symlink) as a Tree.
func OpenTree(path string) (*Tree, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return &Tree{path: filepath.Clean(path), fd: fd}, nil
}

// Path is the tree's path when it was opened, for messages and mountinfo.
func (t *Tree) Path() string { return t.path }

// Close releases the tree's descriptor.
func (t *Tree) Close() error {
	if t.fd < 0 {
		return nil
	}
	err := unix.Close(t.fd)
	t.fd = -1
	return err
}

// checkRel refuses a name that is not a clean path below the tree.
func checkRel(rel string) error {
	if rel == "" || rel == "." || filepath.IsAbs(rel) || filepath.Clean(rel) != rel || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("%q is not a clean path below the tree", rel)
	}
	return nil
}

// parent opens the directory holding rel strictly and returns it with
// rel's last component.
func (t *Tree) parent(rel string) (int, string, error) {
	if err := checkRel(rel); err != nil {
		return -1, "", err
	}
	dir, name := filepath.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	fd, err := unix.Openat2(t.fd, dir, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: strict})
	if err != nil {
		return -1, "", fmt.Errorf("open %s beneath %s: %w", dir, t.path, err)
	}
	return fd, name, nil
}

// Mkdir creates the directory rel, whose parent must exist in the tree.
func (t *Tree) Mkdir(rel string, mode uint32) error {
	pfd, name, err := t.parent(rel)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	if err := unix.Mkdirat(pfd, name, mode); err != nil {
		return fmt.Errorf("mkdir %s beneath %s: %w", rel, t.path, err)
	}
	return nil
}

// Source is a copy of a host mount tree, detached: attached into a Tree
// it becomes a bind mount. Cloning first lets the caller look at what it
// got (Mode) and have the bind's attributes set before any copy of it
// exists, so every copy mount propagation makes of it has them too.
type Source struct {
	fd int
	// Mode is the type and permissions of the source's root.
	Mode fs.FileMode
}

// Clone copies the mount tree at path (a host path the caller trusts, its
// symlinks followed as a container runtime would), with the mounts below
// it when recursive.
func Clone(path string, recursive bool) (*Source, error) {
	flags := uint(unix.OPEN_TREE_CLONE | unix.OPEN_TREE_CLOEXEC)
	if recursive {
		flags |= unix.AT_RECURSIVE
	}
	fd, err := unix.OpenTree(unix.AT_FDCWD, path, flags)
	if err != nil {
		return nil, fmt.Errorf("clone the mount of %s: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	return &Source{fd: fd, Mode: modeOf(st.Mode)}, nil
}

// Close drops the source; once attached it is the mount's and stays.
func (s *Source) Close() error {
	if s.fd < 0 {
		return nil
	}
	err := unix.Close(s.fd)
	s.fd = -1
	return err
}

// BindOptions are a bind's attributes. Every bind is nosuid and nodev:
// the guest writes below it, and nothing it writes may act as a device
// or a set-user-id program on the host.
type BindOptions struct {
	// ReadOnly makes the bind and every mount below it read-only.
	ReadOnly bool
	// TopReadOnly makes the bind's own mount read-only and leaves the
	// mounts below it as they are, as mount(8)'s ro on an rbind does.
	TopReadOnly bool
	// Propagation, when non-zero, is the bind's propagation type
	// (unix.MS_SLAVE, MS_SHARED, MS_PRIVATE).
	Propagation uint64
}

// Attach creates rel (a directory for a directory source, an empty file
// otherwise; its parent must exist) and mounts src there with o's
// attributes. It returns the new mount's id, which Unmount checks.
func (t *Tree) Attach(src *Source, rel string, o BindOptions) (id uint64, err error) {
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV, Propagation: o.Propagation}
	if o.ReadOnly {
		attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.MountSetattr(src.fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return 0, fmt.Errorf("set the attributes of the bind for %s: %w", rel, err)
	}
	if o.TopReadOnly && !o.ReadOnly {
		top := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		if err := unix.MountSetattr(src.fd, "", unix.AT_EMPTY_PATH, &top); err != nil {
			return 0, fmt.Errorf("make the bind for %s read-only: %w", rel, err)
		}
	}
	var stx unix.Statx_t
	if err := unix.Statx(src.fd, "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &stx); err != nil {
		return 0, fmt.Errorf("mount id of the bind for %s: %w", rel, err)
	}
	pfd, name, err := t.parent(rel)
	if err != nil {
		return 0, err
	}
	defer unix.Close(pfd)
	dir := src.Mode.IsDir()
	if dir {
		err = unix.Mkdirat(pfd, name, 0o755)
	} else {
		var fd int
		fd, err = unix.Openat(pfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
		if err == nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("mount point %s beneath %s: %w", rel, t.path, err)
	}
	defer func() {
		if err != nil {
			flags := 0
			if dir {
				flags = unix.AT_REMOVEDIR
			}
			unix.Unlinkat(pfd, name, flags)
		}
	}()
	// The mount point was just made by name in a directory opened
	// strictly; it is opened again the same way (no symlink, no mount) so
	// the bind lands on what was made even if the name was swapped since.
	tfd, err := unix.Openat2(pfd, name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: strict})
	if err != nil {
		return 0, fmt.Errorf("open mount point %s beneath %s: %w", rel, t.path, err)
	}
	defer unix.Close(tfd)
	if err := unix.MoveMount(src.fd, "", tfd, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return 0, fmt.Errorf("attach the bind at %s beneath %s: %w", rel, t.path, err)
	}
	return stx.Mnt_id, nil
}

// Unmount detaches the mount id from rel. It must be the mount at rel, at
// its root, reached beneath the tree without a symlink: anything else
// there (a name swapped, another mount stacked) is refused and left
// alone. A mount id no longer mounted anywhere is not an error.
func (t *Tree) Unmount(rel string, id uint64) error {
	pfd, name, err := t.parent(rel)
	if err != nil {
		if gone, _ := notMounted(id); gone {
			return nil
		}
		return err
	}
	defer unix.Close(pfd)
	return t.unmountAt(pfd, name, rel, id)
}

func (t *Tree) unmountAt(dirfd int, name, rel string, id uint64) error {
	// Not RESOLVE_NO_XDEV: the last component is the mount itself.
	fd, err := unix.Openat2(dirfd, name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		if gone, _ := notMounted(id); gone {
			return nil
		}
		return fmt.Errorf("open %s beneath %s: %w", rel, t.path, err)
	}
	defer unix.Close(fd)
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &stx); err != nil {
		return fmt.Errorf("stat %s beneath %s: %w", rel, t.path, err)
	}
	if stx.Mnt_id != id || stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		if gone, _ := notMounted(id); gone {
			return nil
		}
		return fmt.Errorf("%s beneath %s is not the mount %d that was made there (found mount %d): left alone", rel, t.path, id, stx.Mnt_id)
	}
	// The descriptor's magic link names exactly this mount's root; the
	// path it was reached by is never looked up again.
	if err := unix.Unmount(fmt.Sprintf("/proc/self/fd/%d", fd), unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount %s beneath %s: %w", rel, t.path, err)
	}
	return nil
}

// UnmountAll detaches every mount the mount table shows at or below rel
// ("." for everything strictly below the tree), the most recent first,
// each reached beneath the tree and checked to be the mount the table
// names (its id); it then checks that none is left.
func (t *Tree) UnmountAll(rel string) error {
	if rel != "." {
		if err := checkRel(rel); err != nil {
			return err
		}
	}
	ms, err := t.listed(rel)
	if err != nil {
		return err
	}
	var errs []error
	for i := len(ms) - 1; i >= 0; i-- {
		m := ms[i]
		// A detached parent took its children with it.
		if gone, err := notMounted(m.id); err != nil || gone {
			continue
		}
		r := strings.TrimPrefix(m.point, t.path+"/")
		if err := t.unmountAt(t.fd, r, r, m.id); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	left, err := t.listed(rel)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		return fmt.Errorf("%s is still mounted: left in place so nothing behind it is deleted", left[0].point)
	}
	return nil
}

// RemoveEmpty removes rel: an empty file, or a directory whose whole
// tree is empty directories and empty files. Each is reached beneath the
// tree without a symlink or a mount, and removed with unlinkat on its
// parent's descriptor; anything else (data, a device, a mount still in
// place) is an error and stays, with what holds it.
func (t *Tree) RemoveEmpty(rel string) error {
	pfd, name, err := t.parent(rel)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	return t.removeEmptyAt(pfd, name, rel)
}

func (t *Tree) removeEmptyAt(pfd int, name, rel string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(pfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat %s beneath %s: %w", rel, t.path, err)
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size == 0:
		if err := unix.Unlinkat(pfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s beneath %s: %w", rel, t.path, err)
		}
		return nil
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s beneath %s is not empty: left in place", rel, t.path)
	}
	fd, err := unix.Openat2(pfd, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: strict})
	if errors.Is(err, unix.EXDEV) {
		return fmt.Errorf("%s beneath %s is still a mount point: left in place", rel, t.path)
	}
	if err != nil {
		return fmt.Errorf("open %s beneath %s: %w", rel, t.path, err)
	}
	d := os.NewFile(uintptr(fd), rel)
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("list %s beneath %s: %w", rel, t.path, err)
	}
	for _, n := range names {
		if err := t.removeEmptyAt(fd, n, rel+"/"+n); err != nil {
			return err
		}
	}
	if err := unix.Unlinkat(pfd, name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s beneath %s: %w", rel, t.path, err)
	}
	return nil
}

// listed lists the mount table's mounts at or below rel ("." strictly
// below the tree), in table order.
func (t *Tree) listed(rel string) ([]mountEntry, error) {
	all, err := table()
	if err != nil {
		return nil, err
	}
	var out []mountEntry
	for _, m := range all {
		if rel == "." && strings.HasPrefix(m.point, t.path+"/") ||
			rel != "." && (m.point == t.path+"/"+rel || strings.HasPrefix(m.point, t.path+"/"+rel+"/")) {
			out = append(out, m)
		}
	}
	return out, nil
}

// notMounted says whether the mount id is absent from the mount table.
func notMounted(id uint64) (bool, error) {
	all, err := table()
	if err != nil {
		return false, err
	}
	for _, m := range all {
		if m.id == id {
			return false, nil
		}
	}
	return true, nil
}

func modeOf(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		mode |= fs.ModeDir
	case unix.S_IFLNK:
		mode |= fs.ModeSymlink
	case unix.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		mode |= fs.ModeDevice
	case unix.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case unix.S_IFSOCK:
		mode |= fs.ModeSocket
	}
	return mode
}
