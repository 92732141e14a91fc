package hostfs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"golang.org/x/sys/unix"
)

// Opener reads sources from this host: SourceDir files beneath their
// directory without following any symlink, SourceBlob content from the blob
// cache (index.BlobPath) that oci.FromOCI fills. The returned readers are
// *os.File; close them.
type Opener struct {
	// CacheDir is the Options.CacheDir the index was built with; it is only
	// needed for SourceBlob.
	CacheDir string
}

var _ index.Opener = Opener{}

// Open implements Opener.
func (o Opener) Open(src index.Source, path string) (io.ReaderAt, error) {
	switch src.Kind {
	case index.SourceDir:
		if err := index.CheckPath(path); err != nil || path == "." {
			return nil, fmt.Errorf("open %q in %s: %w", index.Trunc(path), src.ID, index.Invalidf("bad path"))
		}
		if !filepath.IsAbs(src.ID) {
			return nil, fmt.Errorf("open source %q: %w", src.ID, index.Invalidf("directory source is not an absolute path"))
		}
		dfd, err := unix.Open(src.ID, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("open source %s: %w", src.ID, err)
		}
		defer unix.Close(dfd)
		f, err := OpenBeneath(dfd, path)
		if err != nil {
			return nil, fmt.Errorf("open %q in %s: %w", index.Trunc(path), src.ID, err)
		}
		return f, nil
	case index.SourceBlob:
		if path != "" {
			return nil, fmt.Errorf("open blob %s: %w", src.ID, index.Invalidf("path %q given for a blob", index.Trunc(path)))
		}
		if o.CacheDir == "" {
			return nil, fmt.Errorf("open blob %s: %w", src.ID, index.Invalidf("no cache directory"))
		}
		p, err := index.BlobPath(o.CacheDir, src.ID)
		if err != nil {
			return nil, err
		}
		f, err := openBlob(p)
		if err != nil {
			return nil, fmt.Errorf("open blob %s: %w", src.ID, err)
		}
		return f, nil
	}
	return nil, fmt.Errorf("open source %q: %w", src.ID, index.Invalidf("unknown source kind %d", src.Kind))
}

// NotRegularError reports a file that is not a regular file where one is
// expected (a FIFO as an image's index.json, a device as a layer).
type NotRegularError struct {
	Kind string // "a FIFO", "a directory", ...
}

func (e *NotRegularError) Error() string { return "is " + e.Kind + ", not a regular file" }

// Unwrap makes the error an index.ErrInvalid: the input is at fault.
func (e *NotRegularError) Unwrap() error { return index.ErrInvalid }

// TypeName names the file type in a stat mode, for errors.
func TypeName(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "a regular file"
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFSOCK:
		return "a socket"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFLNK:
		return "a symlink"
	}
	return fmt.Sprintf("of file type %#o", mode&unix.S_IFMT)
}

// regularFile checks that fd, opened with O_NONBLOCK so that a FIFO or a
// device cannot stall the open, is a regular file before anything reads
// it, then clears O_NONBLOCK; it closes fd on error.
func regularFile(fd int, name string) (*os.File, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	if err == nil && st.Mode&unix.S_IFMT != unix.S_IFREG {
		err = &NotRegularError{Kind: TypeName(st.Mode)}
	}
	if err == nil {
		err = unix.SetNonblock(fd, false)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), name), nil
}

// OpenBeneath opens the regular file at the relative path name read-only
// beneath dirfd with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS); on
// kernels without openat2 it walks component by component with O_NOFOLLOW
// instead. The open never blocks: anything but a regular file (a FIFO that
// would wait for a writer, a device) is a *NotRegularError.
func OpenBeneath(dirfd int, name string) (*os.File, error) {
	how := unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	// Serving reads must not dirty host inodes with atime updates;
	// O_NOATIME needs ownership or CAP_FOWNER, so drop it when refused.
	how.Flags |= unix.O_NOATIME
	for {
		fd, err := unix.Openat2(dirfd, name, &how)
		if err == nil {
			return regularFile(fd, name)
		}
		switch {
		case err == unix.EINTR || err == unix.EAGAIN:
			continue
		case err == unix.EPERM && how.Flags&unix.O_NOATIME != 0:
			how.Flags &^= unix.O_NOATIME
			continue
		case errors.Is(err, unix.ENOSYS):
			return openWalk(dirfd, name)
		}
		return nil, err
	}
}

// openWalk is OpenBeneath without openat2.
func openWalk(dirfd int, name string) (*os.File, error) {
	if strings.HasPrefix(name, "/") {
		return nil, index.Invalidf("absolute path")
	}
	parts := strings.Split(name, "/")
	cur := dirfd
	defer func() {
		if cur != dirfd {
			unix.Close(cur)
		}
	}()
	for i, c := range parts {
		if c == "" || c == "." || c == ".." {
			return nil, index.Invalidf("bad path component %q", c)
		}
		flags := unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK
		if i < len(parts)-1 {
			flags |= unix.O_DIRECTORY
		}
		fd, err := unix.Openat(cur, c, flags, 0)
		if err != nil {
			return nil, err
		}
		if cur != dirfd {
			unix.Close(cur)
		}
		cur = fd
	}
	fd := cur
	cur = dirfd
	return regularFile(fd, name)
}
