package hostfs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"golang.org/x/sys/unix"
)

// FromDir indexes the host directory root. Symlinks are never followed: the
// walk opens every directory relative to its parent with O_NOFOLLOW (and
// O_NOATIME, so reading does not change what is indexed), stats with
// AT_SYMLINK_NOFOLLOW and reads xattrs through /proc/self/fd of the parent.
// Names that share a (device, inode) become hard links of the first in
// index order, except character devices 0:0 (overlay whiteouts, which the
// kernel may create as links of one inode). Regular files reference root as
// their only Source; Segments are filled only for files with fewer
// allocated blocks than their size (the only ones that can have holes), and
// are empty but non-nil for a file that is all hole. All xattrs are kept,
// overlay ones included. A symlink's times are read after its target, since
// readlink itself may update the atime under relatime.
func FromDir(ctx context.Context, root string, opts index.Options) (*index.Index, error) {
	ix, err := walkDir(ctx, root, &opts)
	if err != nil {
		return nil, err
	}
	opts.Counters().LayersIndexed++
	opts.Counters().Entries = len(ix.Entries)
	return ix, nil
}

type devIno struct{ dev, ino uint64 }

// walker is the state shared by the goroutines of one walk. Directories
// are read in parallel (a goroutine per directory while workers are free,
// inline otherwise, so open descriptors stay bounded by workers x depth);
// their results are stitched together in Index order afterwards, which is
// also when hard links are resolved, so the output does not depend on
// scheduling.
type walker struct {
	ctx     context.Context
	cancel  context.CancelFunc
	max     int64
	count   atomic.Int64
	sem     chan struct{}
	wg      sync.WaitGroup
	noatime int // O_NOATIME when permitted, decided on the root
}

// scratch is one goroutine's reusable buffers.
type scratch struct {
	dirbuf []byte
	xbuf   []byte
	names  []string
}

func newScratch() *scratch {
	return &scratch{dirbuf: make([]byte, 32<<10), xbuf: make([]byte, 1024)}
}

// dirOut is what walking one directory produced: its children in name
// order and, for each child directory, the walk of that directory.
type dirOut struct {
	entries []index.Entry
	links   []devIno  // per entry; zero unless a non-directory with nlink > 1
	kids    []*dirOut // per entry; nil unless a directory
	done    chan struct{}
	err     error
}

func walkDir(ctx context.Context, root string, opts *index.Options) (*index.Index, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("index %s: %w", root, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w := &walker{
		ctx:     ctx,
		cancel:  cancel,
		max:     int64(opts.EntryLimit()),
		sem:     make(chan struct{}, max(runtime.GOMAXPROCS(0)*2, 2)),
		noatime: unix.O_NOATIME,
	}
	fd, err := openDir(unix.AT_FDCWD, abs, w.noatime)
	if err == unix.EPERM {
		w.noatime = 0
		fd, err = openDir(unix.AT_FDCWD, abs, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("index %s: %w", abs, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("index %s: %w", abs, err)
	}
	sc := newScratch()
	rootEntry := index.Entry{Path: "."}
	if err := w.fill(sc, &rootEntry, fd, ".", &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("index %s: %w", abs, err)
	}
	w.count.Add(1)
	out := &dirOut{}
	w.dir(sc, fd, ".", out) // closes fd
	w.wg.Wait()
	entries := make([]index.Entry, 0, w.count.Load())
	entries = append(entries, rootEntry)
	a := assembler{entries: entries, links: map[devIno]int{}}
	if err := a.add(out); err != nil {
		return nil, fmt.Errorf("index %s: %w", abs, err)
	}
	return &index.Index{Sources: []index.Source{{Kind: index.SourceDir, ID: abs}}, Entries: a.entries}, nil
}

// openDir opens a directory without following a final symlink and, with
// O_NOATIME, without updating its atime (reading it would otherwise change
// the very metadata being indexed).
func openDir(dirfd int, name string, noatime int) (int, error) {
	for {
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC|noatime, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// readNames returns the names in the directory fd, sorted in byte order;
// the slice is reused by the next call.
func (sc *scratch) readNames(fd int) ([]string, error) {
	names := sc.names[:0]
	for {
		n, err := unix.Getdents(fd, sc.dirbuf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("getdents: %w", err)
		}
		if n <= 0 {
			break
		}
		_, _, names = unix.ParseDirent(sc.dirbuf[:n], -1, names)
	}
	slices.Sort(names)
	sc.names = names[:0]
	return names, nil
}

// dir walks the directory open as fd (and closes it), filling out.
func (w *walker) dir(sc *scratch, fd int, rel string, out *dirOut) {
	defer unix.Close(fd)
	if out.err = w.ctx.Err(); out.err != nil {
		return
	}
	names, err := sc.readNames(fd)
	if err != nil {
		out.err = fmt.Errorf("%s: %w", rel, err)
		return
	}
	if n := w.count.Add(int64(len(names))); n > w.max {
		out.err = index.Invalidf("more than %d entries (in %q): over the entries budget (kata_fsx.imagefs_blk.max_entries)", w.max, index.Trunc(rel))
		w.cancel()
		return
	}
	out.entries = make([]index.Entry, len(names))
	out.links = make([]devIno, len(names))
	// Child directories are walked after this loop so that sc.names, which
	// names aliases, is not reused while it is still being read.
	var subdirs []int
	var st unix.Stat_t
	for i, name := range names {
		p := index.JoinPath(rel, name)
		if len(p) > index.MaxPathLen || len(name) > index.MaxNameLen {
			out.err = index.Invalidf("path %q longer than %d bytes", index.Trunc(p), index.MaxPathLen)
			w.cancel()
			return
		}
		if err := fstatat(fd, name, &st); err != nil {
			out.err = fmt.Errorf("%s: %w", p, err)
			w.cancel()
			return
		}
		e := &out.entries[i]
		e.Path = p
		if err := w.fill(sc, e, fd, name, &st); err != nil {
			out.err = fmt.Errorf("%s: %w", p, err)
			w.cancel()
			return
		}
		switch {
		case e.Type == index.TypeDir:
			subdirs = append(subdirs, i)
		case index.IsWhiteout(e):
			// overlayfs may create whiteouts as links of one shared 0:0
			// inode; each name must stay a whiteout, not a hard link.
		case st.Nlink > 1:
			out.links[i] = devIno{st.Dev, st.Ino}
		}
	}
	if len(subdirs) == 0 {
		return
	}
	out.kids = make([]*dirOut, len(names))
	for _, i := range subdirs {
		p := out.entries[i].Path
		cfd, err := openDir(fd, index.BaseName(p), w.noatime)
		if err != nil {
			out.err = fmt.Errorf("%s: open: %w", p, err)
			w.cancel()
			return
		}
		kid := &dirOut{}
		out.kids[i] = kid
		select {
		case w.sem <- struct{}{}:
			kid.done = make(chan struct{})
			w.wg.Add(1)
			go func() {
				defer w.wg.Done()
				defer close(kid.done)
				defer func() { <-w.sem }()
				w.dir(newScratch(), cfd, p, kid)
			}()
		default:
			w.dir(sc, cfd, p, kid)
		}
	}
}

// assembler concatenates directory results in Index order and turns every
// later name of a (device, inode) into a hard link to the first.
type assembler struct {
	entries []index.Entry
	links   map[devIno]int
}

func (a *assembler) add(d *dirOut) error {
	if d.done != nil {
		<-d.done
	}
	if d.err != nil {
		return d.err
	}
	for i := range d.entries {
		e := d.entries[i]
		if k := d.links[i]; k != (devIno{}) {
			if first, ok := a.links[k]; ok {
				t := &a.entries[first]
				e = index.Entry{Path: e.Path, Type: index.TypeHardlink, Linkname: t.Path, Mode: t.Mode, UID: t.UID, GID: t.GID,
					Atime: t.Atime, Mtime: t.Mtime, Ctime: t.Ctime, Size: t.Size, Xattrs: t.Xattrs}
			} else {
				a.links[k] = len(a.entries)
			}
		}
		a.entries = append(a.entries, e)
		if d.kids != nil && d.kids[i] != nil {
			if err := a.add(d.kids[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

func fstatat(fd int, name string, st *unix.Stat_t) error {
	for {
		err := unix.Fstatat(fd, name, st, unix.AT_SYMLINK_NOFOLLOW)
		if err != unix.EINTR {
			return err
		}
	}
}

func timespec(t unix.Timespec) index.Timespec {
	return index.Timespec{Sec: t.Sec, Nsec: uint32(t.Nsec)}
}

// fill sets e's metadata from st and reads what stat does not carry: xattrs,
// the symlink target, the data layout.
func (w *walker) fill(sc *scratch, e *index.Entry, dirfd int, name string, st *unix.Stat_t) error {
	e.Mode = st.Mode & 07777
	e.UID, e.GID = st.Uid, st.Gid
	e.Atime, e.Mtime, e.Ctime = timespec(st.Atim), timespec(st.Mtim), timespec(st.Ctim)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		e.Type = index.TypeDir
	case unix.S_IFREG:
		e.Type = index.TypeRegular
		e.Size = st.Size
		e.Data.Path = e.Path
	case unix.S_IFLNK:
		e.Type = index.TypeSymlink
	case unix.S_IFCHR:
		e.Type = index.TypeChar
	case unix.S_IFBLK:
		e.Type = index.TypeBlock
	case unix.S_IFIFO:
		e.Type = index.TypeFifo
	case unix.S_IFSOCK:
		e.Type = index.TypeSocket
	default:
		return index.Invalidf("unknown file type %#o", st.Mode&unix.S_IFMT)
	}
	if err := sc.xattrs(e, dirfd, name); err != nil {
		return err
	}
	switch e.Type {
	case index.TypeSymlink:
		t, err := readlinkat(dirfd, name, sc.xbuf)
		if err != nil {
			return err
		}
		if t == "" || len(t) > index.MaxSymlinkLen {
			return index.Invalidf("symlink target of %d bytes", len(t))
		}
		e.Linkname = t
		// readlink may itself update the link's atime (relatime): take the
		// times after it so the index matches the host and repeated walks
		// agree.
		var st2 unix.Stat_t
		if err := fstatat(dirfd, name, &st2); err != nil {
			return err
		}
		e.Atime, e.Mtime, e.Ctime = timespec(st2.Atim), timespec(st2.Mtim), timespec(st2.Ctim)
	case index.TypeChar, index.TypeBlock:
		maj, mnr := uint64(unix.Major(st.Rdev)), uint64(unix.Minor(st.Rdev))
		if err := index.CheckDev(maj, mnr); err != nil {
			return err
		}
		e.Devmajor, e.Devminor = uint32(maj), uint32(mnr)
	case index.TypeRegular:
		if st.Blocks*512 < st.Size {
			segs, err := segments(dirfd, name, st.Size, w.noatime)
			if err != nil {
				return err
			}
			e.Data.Segments = segs
		}
	}
	return nil
}

func readlinkat(dirfd int, name string, buf []byte) (string, error) {
	for {
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("readlink: %w", err)
		}
		if n < len(buf) {
			return string(buf[:n]), nil
		}
		if len(buf) > 2*index.MaxPathLen {
			return "", index.Invalidf("symlink target too long")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// segments maps a possibly sparse file's data ranges with SEEK_DATA and
// SEEK_HOLE; nil means the file turned out to be all data.
func segments(dirfd int, name string, size int64, noatime int) ([]index.Range, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK|noatime, 0)
	if err != nil {
		return nil, fmt.Errorf("open for SEEK_DATA: %w", err)
	}
	defer unix.Close(fd)
	// The entry was a regular file when listed; it may have been swapped.
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("open for SEEK_DATA: %w", &NotRegularError{Kind: TypeName(st.Mode)})
	}
	var segs []index.Range
	for off := int64(0); off < size; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if err != nil {
			return nil, fmt.Errorf("SEEK_DATA: %w", err)
		}
		if d >= size {
			break
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("SEEK_HOLE: %w", err)
		}
		h = min(h, size)
		if h <= d {
			break
		}
		segs = append(segs, index.Range{Off: d, Len: h - d})
		off = h
	}
	if len(segs) == 1 && segs[0].Off == 0 && segs[0].Len == size {
		return nil, nil
	}
	if segs == nil {
		segs = []index.Range{} // all hole: non-nil and empty
	}
	return segs, nil
}

// xattrs reads all extended attributes of dirfd/name without following a
// symlink, through the /proc/self/fd link of the directory so the lookup
// stays relative to the already opened parent.
func (sc *scratch) xattrs(e *index.Entry, dirfd int, name string) error {
	p := "/proc/self/fd/" + strconv.Itoa(dirfd) + "/" + name
	var n int
	var err error
	for {
		n, err = unix.Llistxattr(p, sc.xbuf)
		if err == unix.ERANGE {
			sz, err2 := unix.Llistxattr(p, nil)
			if err2 != nil {
				return fmt.Errorf("llistxattr: %w", err2)
			}
			sc.xbuf = make([]byte, sz+1024)
			continue
		}
		if err != unix.EINTR {
			break
		}
	}
	if errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("llistxattr: %w", err)
	}
	if n == 0 {
		return nil
	}
	list := strings.Split(strings.TrimSuffix(string(sc.xbuf[:n]), "\x00"), "\x00")
	slices.Sort(list)
	xs := make([]index.Xattr, 0, len(list))
	for _, k := range list {
		if k == "" {
			continue
		}
		v, err := lgetxattr(p, k)
		if errors.Is(err, unix.ENODATA) {
			continue // removed since listed
		}
		if err != nil {
			return fmt.Errorf("lgetxattr %s: %w", k, err)
		}
		if len(k) > index.MaxXattrNameLen || len(v) > index.MaxXattrSize {
			return index.Invalidf("xattr %q too large", k)
		}
		xs = append(xs, index.Xattr{Name: k, Value: v})
	}
	if len(xs) > 0 {
		e.Xattrs = xs
	}
	return nil
}

func lgetxattr(p, name string) ([]byte, error) {
	var small [256]byte
	for {
		n, err := unix.Lgetxattr(p, name, small[:])
		if err == nil {
			return append([]byte{}, small[:n]...), nil
		}
		if err == unix.EINTR {
			continue
		}
		if err != unix.ERANGE {
			return nil, err
		}
		sz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, sz)
		n, err = unix.Lgetxattr(p, name, buf)
		if err == unix.ERANGE {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
