package hostfs

import (
	"errors"
	"fmt"
	"os"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"golang.org/x/sys/unix"
)

// openBlob opens the cached blob p for serving, holding its shared lock
// (nodecache.LockShared) while the file stays open, so that a prune of
// the blob cache leaves it alone; a blob a prune replaced between the
// open and the lock is opened again.
func openBlob(p string) (*os.File, error) {
	const flags = unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC | unix.O_NONBLOCK
	for try := 0; ; try++ {
		fd, err := unix.Open(p, flags|unix.O_NOATIME, 0)
		if err == unix.EPERM {
			fd, err = unix.Open(p, flags, 0)
		}
		if err != nil {
			return nil, err
		}
		f, err := regularFile(fd, p)
		if err != nil {
			return nil, err
		}
		if err = nodecache.LockShared(f, p); err == nil {
			return f, nil
		}
		f.Close()
		if try == 3 || errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
	}
}

// HoldBlobs marks the blobs that srcs name in cacheDir's blob cache as in
// use until release is called: it holds each one's shared lock, so that a
// prune keeps them for a disk that serves them, including the blobs the
// disk has not opened yet. Blobs it could not hold (gone already) are
// named in err; release is valid either way.
func HoldBlobs(cacheDir string, srcs []index.Source) (release func(), err error) {
	var (
		held []*os.File
		errs []error
	)
	for _, src := range srcs {
		if src.Kind != index.SourceBlob {
			continue
		}
		p, perr := index.BlobPath(cacheDir, src.ID)
		if perr != nil {
			errs = append(errs, perr)
			continue
		}
		f, oerr := openBlob(p)
		if oerr != nil {
			errs = append(errs, fmt.Errorf("hold blob %s: %w", src.ID, oerr))
			continue
		}
		held = append(held, f)
	}
	return func() {
		for _, f := range held {
			f.Close()
		}
	}, errors.Join(errs...)
}
