package overlayfs

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// cacheVersion is folded into every cache key so that a change in how
// layers are indexed invalidates old entries even when the encoding stays.
const cacheVersion = "kata-fsx-index-cache-1"

// Cache stores per-layer indexes in Dir/index/<sha256(key)>.idx, so that a
// layer is walked or read once however many images use it. A source picks
// keys that change whenever the layer's content may (FromLayers: path and
// stat stamp or the caller's key; oci: the diffID). The zero Cache (no Dir)
// stores nothing.
type Cache struct {
	Dir string // Options.CacheDir
}

// IndexDir is the directory of a cache directory's per-layer indexes.
func IndexDir(cacheDir string) string { return filepath.Join(cacheDir, "index") }

func (c Cache) path(key string) string {
	sum := sha256.Sum256([]byte(cacheVersion + "\x00" + key))
	return filepath.Join(IndexDir(c.Dir), hex.EncodeToString(sum[:])+".idx")
}

// Load returns the cached per-layer index for key with the single source
// want, or nil when there is none or it is unusable: any damage is a miss,
// later overwritten.
func (c Cache) Load(key string, want index.Source) *index.Index {
	if c.Dir == "" {
		return nil
	}
	f, err := os.Open(c.path(key))
	if err != nil {
		return nil
	}
	defer f.Close()
	ix, err := index.DecodeLayer(bufio.NewReaderSize(f, 1<<16))
	if err != nil || len(ix.Sources) != 1 || ix.Sources[0] != want {
		return nil
	}
	nodecache.Touch(f.Name()) // the stamp a prune's least-recently-used order reads
	return ix
}

// beforeRename, set by tests only, runs in Store once the index is in its
// temporary file, where a test kills the process.
var beforeRename func()

// Store writes a per-layer index for key (atomicfile).
func (c Cache) Store(key string, ix *index.Index) error {
	if c.Dir == "" {
		return nil
	}
	p := c.path(key)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("index cache: %w", err)
	}
	err := atomicfile.Write(p, 0o600, func(w io.Writer) error {
		bw := bufio.NewWriterSize(w, 1<<16)
		err := index.EncodeLayer(bw, ix)
		if err == nil {
			err = bw.Flush()
		}
		if err == nil && beforeRename != nil {
			beforeRename() // a crash here leaves a temporary file, never an entry
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("index cache: %w", err)
	}
	return nil
}
