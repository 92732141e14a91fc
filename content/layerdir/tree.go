package layerdir

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// The tree is written with *at calls relative to directories this run
// created and holds open, each name checked to be one plain component and
// created with O_EXCL or O_NOFOLLOW semantics: a symlink of the layer is
// only ever written, never followed, whatever the index says.

// frame is a directory being written; the entries that follow it in the
// tree's order up to the end of its subtree go into it.
type frame struct {
	path string
	fd   int          // the directory, open
	pfd  int          // its parent (the snapshot directory for the root)
	name string       // its name in the parent
	meta *index.Entry // its metadata; the times are set when it is left
}

// writeStage writes the per-layer tree t into the stage directory.
func (m *materializer) writeStage(t *index.Index) (err error) {
	es := t.Entries
	if len(es) == 0 || es[0].Path != "." || es[0].Type != index.TypeDir {
		return errors.New("the layer's tree has no root directory")
	}
	lowerLinks := 0
	for i := range es {
		e := &es[i]
		switch {
		case e.Type == index.TypeRegular:
			if !m.leaveOut(e.Path, e.Size) {
				m.total += e.Size
			}
		case isLowerLink(e):
			lowerLinks++
			if le, err := m.lowerEntry(e.Linkname); err != nil {
				return err
			} else if le != nil && le.Type == index.TypeRegular {
				m.total += le.Size
			}
		}
	}
	if m.total >= progressMin {
		m.logf("layer %s of %s: materializing %d entries, %s of file data", m.remote.Layer, m.remote.Ref, len(es), mib(m.total))
	}
	if err := unix.Mkdirat(m.sd, m.stage, 0o700); err != nil {
		return fmt.Errorf("create %s in %s: %w", m.stage, m.snap, err)
	}
	rootfd, err := unix.Openat(m.sd, m.stage, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", m.stage, err)
	}
	rootMeta, err := m.dirMeta(&es[0])
	if err != nil {
		unix.Close(rootfd)
		return err
	}
	stack := []frame{{path: ".", fd: rootfd, pfd: m.sd, name: m.stage, meta: rootMeta}}
	defer func() {
		for _, f := range stack {
			unix.Close(f.fd)
		}
	}()
	if err := m.setMetaFd(rootfd, ".", rootMeta); err != nil {
		return err
	}
	leave := func() error {
		f := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		defer unix.Close(f.fd)
		return setTimes(f.pfd, f.name, f.path, f.meta)
	}
	// Copies of files of lower layers that hard links of this layer name,
	// by their lower path: a second link to one becomes a link to the copy.
	copied := map[string]string{}
	// Files a skeleton leaves out, by path: hard links to them are left
	// out too.
	leftOut := map[string]bool{}
	for i := 1; i < len(es); i++ {
		if i&1023 == 0 {
			if err := m.ctx.Err(); err != nil {
				return err
			}
		}
		e := &es[i]
		pp := index.ParentPath(e.Path)
		for len(stack) > 0 && stack[len(stack)-1].path != pp {
			if err := leave(); err != nil {
				return err
			}
		}
		if len(stack) == 0 {
			return fmt.Errorf("entry %q: its parent is not a directory of the layer", index.Trunc(e.Path))
		}
		name := index.BaseName(e.Path)
		if !plainName(name) {
			return fmt.Errorf("entry %q: bad name", index.Trunc(e.Path))
		}
		pfd := stack[len(stack)-1].fd
		switch {
		case e.Type == index.TypeDir:
			meta, err := m.dirMeta(e)
			if err != nil {
				return err
			}
			if err := unix.Mkdirat(pfd, name, 0o700); err != nil {
				return fmt.Errorf("entry %q: mkdir: %w", index.Trunc(e.Path), err)
			}
			fd, err := unix.Openat(pfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("entry %q: open: %w", index.Trunc(e.Path), err)
			}
			stack = append(stack, frame{path: e.Path, fd: fd, pfd: pfd, name: name, meta: meta})
			if err := m.setMetaFd(fd, e.Path, meta); err != nil {
				return err
			}
		case isLowerLink(e):
			le, err := m.lowerEntry(e.Linkname)
			if err != nil {
				return err
			}
			if le == nil || le.Type == index.TypeDir {
				return fmt.Errorf("entry %q: hard link to %q, which is no file of the layers below", index.Trunc(e.Path), index.Trunc(e.Linkname))
			}
			if le.Type == index.TypeRegular && m.leaveOut(e.Path, le.Size) {
				if err := m.writeLeftOut(pfd, name, e.Path); err != nil {
					return err
				}
				continue
			}
			if first, ok := copied[le.Path]; ok {
				if err := link(rootfd, first, pfd, name); err != nil {
					return fmt.Errorf("entry %q: %w", index.Trunc(e.Path), err)
				}
				continue
			}
			// A layer directory cannot link into another layer: the link
			// becomes a copy of its target, as extracting the layer over
			// its parents would have made it.
			c := *le
			c.Path = e.Path
			if c.Type == index.TypeRegular {
				if err := m.addLayer(int(le.Data.Source)); err != nil {
					return err
				}
				err = m.writeFile(pfd, name, &c, m.below.Sources)
			} else {
				err = m.writeNode(pfd, name, &c)
			}
			if err != nil {
				return err
			}
			copied[le.Path] = e.Path
		case e.Type == index.TypeHardlink && leftOut[e.Linkname]:
			if err := m.writeLeftOut(pfd, name, e.Path); err != nil {
				return err
			}
		case e.Type == index.TypeHardlink:
			if err := link(rootfd, e.Linkname, pfd, name); err != nil {
				return fmt.Errorf("entry %q: %w", index.Trunc(e.Path), err)
			}
		case e.Type == index.TypeRegular && m.leaveOut(e.Path, e.Size):
			leftOut[e.Path] = true
			if err := m.writeLeftOut(pfd, name, e.Path); err != nil {
				return err
			}
		case e.Type == index.TypeRegular:
			if err := m.writeFile(pfd, name, e, t.Sources); err != nil {
				return err
			}
		default:
			if err := m.writeNode(pfd, name, e); err != nil {
				return err
			}
		}
	}
	if lowerLinks > 0 {
		m.logf("layer %s: %d hard links into lower layers written as copies", m.remote.Layer, lowerLinks)
	}
	for len(stack) > 0 {
		if err := leave(); err != nil {
			return err
		}
	}
	if m.total >= progressMin && m.done < m.total {
		m.progress(0)
	}
	return nil
}

func isLowerLink(e *index.Entry) bool {
	return e.Type == index.TypeHardlink && index.HasXattr(e.Xattrs, index.XattrLowerLink)
}

// plainName reports whether name is one path component that names no
// other directory.
func plainName(name string) bool {
	return name != "" && name != "." && name != ".." && !strings.ContainsAny(name, "/\x00")
}

// dirMeta is the metadata to give the directory e: its own, or for a
// directory the layer only implies, the directory's of the layers below
// (as extracting the layer over them leaves it), with the layer's opaque
// marker.
func (m *materializer) dirMeta(e *index.Entry) (*index.Entry, error) {
	meta := *e
	if index.HasXattr(e.Xattrs, index.XattrImplicit) {
		le, err := m.lowerEntry(e.Path)
		if err != nil {
			return nil, err
		}
		if le != nil && le.Type == index.TypeDir {
			meta = *le
		} else {
			meta = index.ImpliedDir()
		}
		meta.Path = e.Path
		meta.Xattrs = nil
		if le != nil && le.Type == index.TypeDir {
			meta.Xattrs = le.Xattrs
		}
	}
	xs := make([]index.Xattr, 0, len(meta.Xattrs)+1)
	for _, x := range meta.Xattrs {
		if !strings.HasPrefix(x.Name, index.XattrOverlayPrefix) {
			xs = append(xs, x)
		}
	}
	if index.IsOpaque(e) {
		xs = append(xs, index.Xattr{Name: index.XattrOpaque, Value: []byte("y")})
	}
	meta.Xattrs = xs
	return &meta, nil
}

// link makes name in pfd a hard link to target, a path of the stage
// resolved beneath rootfd without following any symlink.
func link(rootfd int, target string, pfd int, name string) error {
	if index.CheckPath(target) != nil || target == "." {
		return fmt.Errorf("hard link target %q: bad path", index.Trunc(target))
	}
	dfd := rootfd
	if dir := index.ParentPath(target); dir != "." {
		fd, err := openBeneath(rootfd, dir)
		if err != nil {
			return fmt.Errorf("hard link target %q: %w", index.Trunc(target), err)
		}
		defer unix.Close(fd)
		dfd = fd
	}
	if err := unix.Linkat(dfd, index.BaseName(target), pfd, name, 0); err != nil {
		return fmt.Errorf("hard link to %q: %w", index.Trunc(target), err)
	}
	return nil
}

// openBeneath opens the directory dir (a clean relative path) beneath
// rootfd without following a symlink or leaving rootfd's tree: openat2
// where the kernel has it (5.6), else one O_NOFOLLOW component at a time.
func openBeneath(rootfd int, dir string) (int, error) {
	fd, err := unix.Openat2(rootfd, dir, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV})
	if !errors.Is(err, unix.ENOSYS) {
		return fd, err
	}
	return walkBeneath(rootfd, dir)
}

// walkBeneath is openBeneath without openat2.
func walkBeneath(rootfd int, dir string) (int, error) {
	cur := rootfd
	for _, c := range strings.Split(dir, "/") {
		if !plainName(c) {
			if cur != rootfd {
				unix.Close(cur)
			}
			return -1, fmt.Errorf("path component %q: %w", index.Trunc(c), unix.EINVAL)
		}
		next, err := unix.Openat(cur, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if cur != rootfd {
			unix.Close(cur)
		}
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// writeFile writes the regular file e as name in pfd, its data read from
// the store (src are the sources of the tree e is from).
func (m *materializer) writeFile(pfd int, name string, e *index.Entry, src []index.Source) error {
	fd, err := unix.Openat(pfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("entry %q: create: %w", index.Trunc(e.Path), err)
	}
	f := os.NewFile(uintptr(fd), name)
	err = m.fileData(f, e, src)
	if err == nil {
		err = m.setMetaFd(fd, e.Path, e)
	}
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("entry %q: %w", index.Trunc(e.Path), cerr)
	}
	if err != nil {
		return err
	}
	return setTimes(pfd, name, e.Path, e)
}

func (m *materializer) fileData(f *os.File, e *index.Entry, src []index.Source) error {
	if e.Size == 0 {
		return nil
	}
	ra, err := m.readerFor(src, e)
	if err != nil {
		return err
	}
	if c, ok := ra.(io.Closer); ok {
		defer c.Close()
	}
	segs := e.Data.Segments
	if segs == nil {
		segs = []index.Range{{Off: 0, Len: e.Size}}
	} else if err := f.Truncate(e.Size); err != nil {
		// The file's holes are what the truncate leaves unwritten.
		return fmt.Errorf("entry %q: %w", index.Trunc(e.Path), err)
	}
	if m.buf == nil {
		m.buf = make([]byte, copyBuf)
	}
	for _, s := range segs {
		for off, end := s.Off, s.Off+s.Len; off < end; {
			if err := m.ctx.Err(); err != nil {
				return err
			}
			b := m.buf[:min(int64(len(m.buf)), end-off)]
			n, err := ra.ReadAt(b, e.Data.Offset+off)
			if n < len(b) {
				if err == nil || errors.Is(err, io.EOF) {
					err = io.ErrUnexpectedEOF
				}
				return fmt.Errorf("entry %q: read [%d, %d) of its data: %w (the data comes from the registry of %s through the node's content store: check that it is reachable from this node with the registry configuration of %s)",
					index.Trunc(e.Path), off, off+int64(len(b)), err, m.remote.Ref, m.opts.Registry.ConfigPath)
			}
			if _, err := f.WriteAt(b, off); err != nil {
				return fmt.Errorf("entry %q: %w", index.Trunc(e.Path), err)
			}
			off += int64(len(b))
			m.progress(int64(len(b)))
		}
	}
	return nil
}

// writeNode writes a symlink, device, fifo or socket (a whiteout is a
// character device 0:0).
func (m *materializer) writeNode(pfd int, name string, e *index.Entry) error {
	var err error
	switch e.Type {
	case index.TypeSymlink:
		err = unix.Symlinkat(e.Linkname, pfd, name)
	case index.TypeChar:
		err = unix.Mknodat(pfd, name, unix.S_IFCHR|e.Mode&07777, int(unix.Mkdev(e.Devmajor, e.Devminor)))
	case index.TypeBlock:
		err = unix.Mknodat(pfd, name, unix.S_IFBLK|e.Mode&07777, int(unix.Mkdev(e.Devmajor, e.Devminor)))
	case index.TypeFifo:
		err = unix.Mknodat(pfd, name, unix.S_IFIFO|e.Mode&07777, 0)
	case index.TypeSocket:
		err = unix.Mknodat(pfd, name, unix.S_IFSOCK|e.Mode&07777, 0)
	default:
		return fmt.Errorf("entry %q: unexpected type %s", index.Trunc(e.Path), e.Type)
	}
	if err != nil {
		return fmt.Errorf("entry %q: create %s: %w", index.Trunc(e.Path), e.Type, err)
	}
	if err := unix.Fchownat(pfd, name, int(e.UID), int(e.GID), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("entry %q: chown: %w", index.Trunc(e.Path), err)
	}
	if e.Type != index.TypeSymlink {
		// The node was just made by mknodat in a directory of this run, so
		// the name is no symlink to follow; the umask made its mode.
		if err := unix.Fchmodat(pfd, name, e.Mode&07777, 0); err != nil {
			return fmt.Errorf("entry %q: chmod: %w", index.Trunc(e.Path), err)
		}
	}
	// No fd of its own can carry a symlink's or a device's xattrs: they go
	// through the parent's fd in /proc, the last component not followed.
	p := "/proc/self/fd/" + strconv.Itoa(pfd) + "/" + name
	for _, x := range e.Xattrs {
		if strings.HasPrefix(x.Name, index.XattrOverlayPrefix) {
			continue
		}
		if err := unix.Lsetxattr(p, x.Name, x.Value, 0); err != nil {
			if err := m.xattrErr(e, x, err); err != nil {
				return err
			}
		}
	}
	return setTimes(pfd, name, e.Path, e)
}

// setMetaFd gives the open file or directory fd e's owner, mode and
// xattrs, in that order: chown clears the setuid bits and capabilities.
func (m *materializer) setMetaFd(fd int, p string, e *index.Entry) error {
	if err := unix.Fchown(fd, int(e.UID), int(e.GID)); err != nil {
		return fmt.Errorf("entry %q: chown: %w", index.Trunc(p), err)
	}
	if err := unix.Fchmod(fd, e.Mode&07777); err != nil {
		return fmt.Errorf("entry %q: chmod: %w", index.Trunc(p), err)
	}
	for _, x := range e.Xattrs {
		if strings.HasPrefix(x.Name, index.XattrOverlayPrefix) && x.Name != index.XattrOpaque {
			continue
		}
		if err := unix.Fsetxattr(fd, x.Name, x.Value, 0); err != nil {
			if x.Name == index.XattrOpaque {
				return fmt.Errorf("entry %q: opaque marker %s: %w (the snapshot directory's file system must support trusted xattrs, and the helper run as root)",
					index.Trunc(p), x.Name, err)
			}
			if err := m.xattrErr(e, x, err); err != nil {
				return err
			}
		}
	}
	return nil
}

// xattrErr passes over an xattr the file system refuses to hold here, as
// containerd's layer extraction does, and fails on any other error.
func (m *materializer) xattrErr(e *index.Entry, x index.Xattr, err error) error {
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EPERM) {
		m.logf("layer %s: entry %q: xattr %s not kept: %v", m.remote.Layer, index.Trunc(e.Path), index.Trunc(x.Name), err)
		return nil
	}
	return fmt.Errorf("entry %q: xattr %s: %w", index.Trunc(e.Path), index.Trunc(x.Name), err)
}

func setTimes(pfd int, name, p string, e *index.Entry) error {
	ts := []unix.Timespec{
		{Sec: e.Atime.Sec, Nsec: int64(e.Atime.Nsec)},
		{Sec: e.Mtime.Sec, Nsec: int64(e.Mtime.Nsec)},
	}
	if err := unix.UtimesNanoAt(pfd, name, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("entry %q: set times: %w", index.Trunc(p), err)
	}
	return nil
}
