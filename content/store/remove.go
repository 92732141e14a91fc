package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// betweenUnlinks, set by tests only, runs in removeLayer between the
// unlinks of a layer's chunk map and its data file, where a test kills
// the process.
var betweenUnlinks func()

// RemoveLayer deletes the node disk tier's files of the layer blob from
// dir (a Store's Options.Dir), releasing its space. It takes the locks a
// Store takes: the chunk map's header lock, which a Store holds while it
// opens and checks a layer's files, then a lock of the whole data file,
// which waits out every fetch writing chunks; both files are unlinked
// under them. A Store opening the layer meanwhile finds its files gone
// once it holds the header lock and opens new ones, so it never pairs a
// removed data file with a new chunk map. A Store that had the layer open
// before keeps reading and writing its (now unlinked) files, consistent
// with each other, until it closes them; their space is freed then.
// A layer with no files is not an error.
func RemoveLayer(dir string, blob digest.Digest) error {
	return removeLayer(context.Background(), dir, blob, false)
}

// removeLayer is RemoveLayer, waiting for its locks until ctx ends or
// initLockWait passes; with unused, it removes nothing of a layer a Store
// has open (markInUse) and returns nodecache.ErrInUse.
func removeLayer(ctx context.Context, dir string, blob digest.Digest, unused bool) error {
	hex, err := blobHex(string(blob))
	if err != nil {
		return fmt.Errorf("content store: remove layer %q: %w", blob, err)
	}
	base := layerBase(dir, hex)
	ctx, cancel := context.WithTimeout(ctx, initLockWait)
	defer cancel()
	cmap, err := os.OpenFile(base+".chunks", os.O_RDWR, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// No chunk map claims anything in a data file left alone (a
		// crash between the two creations): it is dead bytes.
		if err := os.Remove(base + ".data"); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("content store: remove layer %s: %w", blob, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("content store: remove layer %s: %w", blob, err)
	}
	defer cmap.Close()
	unlock, err := lockRange(ctx, cmap, 0, mapHeaderSize)
	if err != nil {
		return fmt.Errorf("content store: remove layer %s: %w", blob, err)
	}
	defer unlock()
	if unused {
		if err := checkUnused(cmap, base+".chunks"); err != nil {
			return fmt.Errorf("content store: remove layer %s: %w", blob, err)
		}
	}
	data, err := os.OpenFile(base+".data", os.O_RDWR, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return fmt.Errorf("content store: remove layer %s: %w", blob, err)
	default:
		defer data.Close()
		// Len 0 locks to the end of the file and beyond: every chunk.
		unlockData, err := lockRange(ctx, data, 0, 0)
		if err != nil {
			return fmt.Errorf("content store: remove layer %s: a fetch holds its chunks: %w", blob, err)
		}
		defer unlockData()
	}
	var errs []error
	for i, p := range []string{base + ".chunks", base + ".data"} {
		if i == 1 {
			// A crash here leaves a data file no chunk map claims: dead
			// bytes, never served, removed by the next removal.
			if betweenUnlinks != nil {
				betweenUnlinks()
			}
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("content store: remove layer %s: %w", blob, err)
	}
	return nil
}

// errRemoved: a layer's files were removed while a Store was opening them.
var errRemoved = errors.New("layer files removed while opening them")

// unlinked reports whether f's file has no name left (RemoveLayer).
func unlinked(f *os.File) bool {
	var st unix.Stat_t
	return unix.Fstat(int(f.Fd()), &st) == nil && st.Nlink == 0
}

// layerBase is the path of a layer's files in a store directory, without
// their .data and .chunks suffixes.
func layerBase(dir, hex string) string {
	return filepath.Join(dir, "layers", hex)
}

// LayerDiskUsage is the disk space the layer blob's files take in dir (a
// Store's Options.Dir): the blocks allocated to its sparse data file and
// its chunk map, and how many of the two exist (none before the first
// fetch or after RemoveLayer).
func LayerDiskUsage(dir string, blob digest.Digest) (size, files int64) {
	hex, err := blobHex(string(blob))
	if err != nil {
		return 0, 0
	}
	for _, ext := range []string{".data", ".chunks"} {
		var st unix.Stat_t
		if unix.Stat(layerBase(dir, hex)+ext, &st) == nil {
			size += st.Blocks * 512
			files++
		}
	}
	return size, files
}
