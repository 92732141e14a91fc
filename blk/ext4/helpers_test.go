package ext4

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// dirOpener opens SourceDir files below their root without following
// symlinks anywhere on the path (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH,
// O_NOFOLLOW where openat2 is missing); it is the test stand-in until the
// index package has one.
type dirOpener struct{}

func (dirOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	if src.Kind != index.SourceDir {
		return nil, fmt.Errorf("dirOpener: source kind %d not supported", src.Kind)
	}
	rootFd, err := unix.Open(src.ID, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open source %s: %w", src.ID, err)
	}
	defer unix.Close(rootFd)
	fd, err := unix.Openat2(rootFd, path, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH,
	})
	if errors.Is(err, unix.ENOSYS) {
		fd, err = unix.Openat(rootFd, path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// exportMeta writes only the metadata blocks of img: e2fsck never reads
// file data, so this checks terabyte images without a terabyte of reads.
func exportMeta(t testing.TB, img *Image, p string) {
	t.Helper()
	f, err := os.Create(p)
	must(t, err)
	defer f.Close()
	must(t, f.Truncate(int64(img.Map.Blocks())*int64(img.Map.BlockSize())))
	for i := 0; i < img.Map.Len(); i++ {
		if e := img.Map.At(i); e.Kind == blockmap.Meta {
			b := make([]byte, e.Bytes)
			_, err := img.Meta().ReadAt(b, e.Loc.Offset)
			must(t, err)
			_, err = f.WriteAt(b, int64(e.First)*int64(img.Map.BlockSize()))
			must(t, err)
		}
	}
}

// indexDir builds an index of the tree at root by walking it with Lstat,
// the way a plain-directory indexer would.
func indexDir(t testing.TB, root string) *index.Index {
	t.Helper()
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceDir, ID: root}}}
	type devIno struct{ dev, ino uint64 }
	seen := make(map[devIno]string)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		e := index.Entry{
			Path: filepath.ToSlash(rel), Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid,
			Atime: index.Timespec{Sec: st.Atim.Sec, Nsec: uint32(st.Atim.Nsec)},
			Mtime: index.Timespec{Sec: st.Mtim.Sec, Nsec: uint32(st.Mtim.Nsec)},
			Ctime: index.Timespec{Sec: st.Ctim.Sec, Nsec: uint32(st.Ctim.Nsec)},
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			e.Type = index.TypeDir
		case unix.S_IFLNK:
			e.Type = index.TypeSymlink
			if e.Linkname, err = os.Readlink(p); err != nil {
				return err
			}
		case unix.S_IFCHR, unix.S_IFBLK:
			e.Type = index.TypeChar
			if st.Mode&unix.S_IFMT == unix.S_IFBLK {
				e.Type = index.TypeBlock
			}
			e.Devmajor, e.Devminor = unix.Major(st.Rdev), unix.Minor(st.Rdev)
		case unix.S_IFIFO:
			e.Type = index.TypeFifo
		case unix.S_IFSOCK:
			e.Type = index.TypeSocket
		case unix.S_IFREG:
			e.Type = index.TypeRegular
			e.Size = st.Size
			e.Data = index.Data{Source: 0, Path: e.Path}
			if st.Blocks*512 < st.Size {
				if e.Data.Segments, err = segments(p, st.Size); err != nil {
					return err
				}
			}
		}
		if e.Type != index.TypeDir && st.Nlink > 1 {
			k := devIno{st.Dev, st.Ino}
			if first, ok := seen[k]; ok {
				idx.Entries = append(idx.Entries, index.Entry{Path: e.Path, Type: index.TypeHardlink, Linkname: first})
				return nil
			}
			seen[k] = e.Path
		}
		if e.Xattrs, err = xattrs(p); err != nil {
			return err
		}
		idx.Entries = append(idx.Entries, e)
		return nil
	})
	if err != nil {
		t.Fatalf("index %s: %v", root, err)
	}
	return idx
}

// segments lists a sparse file's data ranges with SEEK_DATA/SEEK_HOLE.
func segments(p string, size int64) ([]index.Range, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	segs := []index.Range{}
	for off := int64(0); off < size; {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			return nil, err
		}
		h, err := unix.Seek(int(f.Fd()), d, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		segs = append(segs, index.Range{Off: d, Len: h - d})
		off = h
	}
	return segs, nil
}

// xattrs reads a path's extended attributes, sorted by name.
func xattrs(p string) ([]index.Xattr, error) {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		if errors.Is(err, unix.ENOTSUP) {
			err = nil
		}
		return nil, err
	}
	buf := make([]byte, sz)
	if sz, err = unix.Llistxattr(p, buf); err != nil {
		return nil, err
	}
	var out []index.Xattr
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		vs, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			return nil, err
		}
		v := make([]byte, vs)
		if vs, err = unix.Lgetxattr(p, name, v); err != nil {
			return nil, err
		}
		out = append(out, index.Xattr{Name: name, Value: v[:vs]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func TestDirOpenerRefusesSymlinks(t *testing.T) {
	root := t.TempDir()
	must(t, os.MkdirAll(filepath.Join(root, "real"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, "real", "f"), []byte("x"), 0o644))
	must(t, os.Symlink("real", filepath.Join(root, "link")))
	must(t, os.Symlink("f", filepath.Join(root, "real", "lf")))
	src := index.Source{Kind: index.SourceDir, ID: root}
	r, err := dirOpener{}.Open(src, "real/f")
	must(t, err)
	r.(io.Closer).Close()
	for _, p := range []string{"link/f", "real/lf", "../etc/passwd"} {
		if r, err := (dirOpener{}).Open(src, p); err == nil {
			r.(io.Closer).Close()
			t.Errorf("opened %q", p)
		}
	}
}
