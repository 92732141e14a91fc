package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/nodecache"
)

// inUseOffset is the byte of a chunk map on which every Store that has
// the layer open holds an OFD read lock, and on which a prune tries a
// write lock: far beyond any map's end (a map is a header and a byte per
// chunk), so it never meets the header or chunk locks, and released by
// the kernel when the Store closes the file or its process dies.
const inUseOffset = 1 << 62

// markInUse marks the layer whose chunk map is cmap in use for as long as
// cmap stays open.
func markInUse(cmap *os.File) error {
	lk := unix.Flock_t{Type: unix.F_RDLCK, Whence: io.SeekStart, Start: inUseOffset, Len: 1}
	if err := unix.FcntlFlock(cmap.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		return fmt.Errorf("mark %s in use: %w", cmap.Name(), err)
	}
	return nil
}

// checkUnused returns nodecache.ErrInUse when a Store has the layer whose
// chunk map is cmap (opened at path p) open, or when p no longer names
// cmap's file (another removal came first and a Store made new files).
// The caller holds the map's header lock, under which Stores mark the
// layer, so the answer holds until it lets go.
func checkUnused(cmap *os.File, p string) error {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: inUseOffset, Len: 1}
	err := unix.FcntlFlock(cmap.Fd(), unix.F_OFD_SETLK, &lk)
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
		return nodecache.ErrInUse
	}
	if err != nil {
		return fmt.Errorf("lock %s: %w", p, err)
	}
	// Released with cmap; held meanwhile, so no Store marks it.
	var a, b unix.Stat_t
	if err := unix.Fstat(int(cmap.Fd()), &a); err != nil {
		return err
	}
	if err := unix.Stat(p, &b); err != nil || a.Ino != b.Ino || a.Dev != b.Dev {
		return nodecache.ErrInUse
	}
	return nil
}

// inUse reports whether a Store has the layer whose chunk map is at p open.
func inUse(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: inUseOffset, Len: 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		return false
	}
	return lk.Type != unix.F_UNLCK
}

// NodeCache is the node disk tier in dir (a Store's Options.Dir) as the
// node cache "content": one entry per layer blob (its sparse data file and
// chunk map), keyed by the blob digest's hex, taking its allocated
// blocks. A layer is in use while a Store, in any process, has it open;
// its last use is when one last opened it or wrote a chunk to it. Remove
// is RemoveLayer's removal, refused for a layer in use: a crash during it
// leaves at most a data file no chunk map claims, which is never served.
func NodeCache(dir string) nodecache.Cache { return &diskCache{dir: dir} }

type diskCache struct{ dir string }

func (c *diskCache) Name() string { return "content" }

func (c *diskCache) Entries(ctx context.Context) ([]nodecache.Entry, error) {
	layers := filepath.Join(c.dir, "layers")
	des, err := os.ReadDir(layers)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cache content: %w", err)
	}
	byHex := map[string]*nodecache.Entry{}
	var order []string
	for _, de := range des {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		name := de.Name()
		hex, ext, ok := strings.Cut(name, ".")
		if !ok || (ext != "data" && ext != "chunks") || !de.Type().IsRegular() {
			continue
		}
		if _, err := blobHex("sha256:" + hex); err != nil {
			continue
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(layers, name), &st); err != nil {
			continue
		}
		e := byHex[hex]
		if e == nil {
			e = &nodecache.Entry{Key: hex, Note: "data file only (removal interrupted)"}
			byHex[hex] = e
			order = append(order, hex)
		}
		n, mt := nodecache.Usage(&st)
		e.Bytes += n
		if ext == "chunks" {
			e.LastUsed = mt
			e.Note = "layer sha256:" + hex
			e.InUse = inUse(filepath.Join(layers, name))
		} else if e.LastUsed.IsZero() {
			e.LastUsed = mt
		}
	}
	out := make([]nodecache.Entry, 0, len(order))
	for _, h := range order {
		out = append(out, *byHex[h])
	}
	return out, nil
}

func (c *diskCache) Remove(ctx context.Context, key string) error {
	return removeLayer(ctx, c.dir, digest.Digest("sha256:"+key), true)
}
