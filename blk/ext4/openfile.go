package ext4

import (
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Limits on an image directory's small files: a manifest is a few hundred
// bytes and a block map about 24 bytes per extent.
const (
	maxManifestBytes = 1 << 20
	maxMapBytes      = 1 << 30
)

// openRegular opens an image file without blocking (a FIFO or a device in
// its place would otherwise hang the open or the read) and without
// following a symlink, and refuses anything but a regular file.
func openRegular(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: not a regular file (mode %#o)", path, st.Mode&unix.S_IFMT)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// readRegular reads a regular file of at most max bytes.
func readRegular(path string, max int64) ([]byte, error) {
	f, err := openRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, max)
	}
	return b, nil
}

// mapRegular maps the regular file path (not following a symlink) read-only
// and shared; unmap releases it. The file must hold 1 to max bytes.
func mapRegular(path string, max int64) (b []byte, unmap func() error, err error) {
	f, err := openRegular(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close() // the mapping outlives the descriptor
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if st.Size() == 0 || st.Size() > max {
		return nil, nil, fmt.Errorf("%s: %d bytes, want 1 to %d", path, st.Size(), max)
	}
	b, err = unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, &os.PathError{Op: "mmap", Path: path, Err: err}
	}
	var once sync.Once
	return b, func() error {
		var err error
		once.Do(func() { err = unix.Munmap(b) })
		return err
	}, nil
}
