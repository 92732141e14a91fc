package index

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
)

// cacheVersion is folded into every cache key so that a change in how
// layers are indexed invalidates old entries even when the encoding stays.
const cacheVersion = "kata-fsx-index-cache-1"

// indexCache stores per-layer indexes in dir/index/<sha256(key)>.idx.
type indexCache struct{ dir string }

func (c indexCache) path(key string) string {
	sum := sha256.Sum256([]byte(cacheVersion + "\x00" + key))
	return filepath.Join(c.dir, "index", hex.EncodeToString(sum[:])+".idx")
}

// load returns the cached layer index for key, or nil when there is none or
// it is unusable (any damage is treated as a miss and later overwritten).
func (c indexCache) load(key string, want Source) *Index {
	if c.dir == "" {
		return nil
	}
	f, err := os.Open(c.path(key))
	if err != nil {
		return nil
	}
	defer f.Close()
	ix, err := DecodeLayer(bufio.NewReaderSize(f, 1<<16))
	if err != nil || len(ix.Sources) != 1 || ix.Sources[0] != want {
		return nil
	}
	return ix
}

// store writes a layer index atomically (temp file, then rename).
func (c indexCache) store(key string, ix *Index) error {
	if c.dir == "" {
		return nil
	}
	p := c.path(key)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("index cache: %w", err)
	}
	f, err := os.CreateTemp(filepath.Dir(p), ".tmp-*")
	if err != nil {
		return fmt.Errorf("index cache: %w", err)
	}
	defer os.Remove(f.Name())
	bw := bufio.NewWriterSize(f, 1<<16)
	err = EncodeLayer(bw, ix)
	if err == nil {
		err = bw.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), p)
	}
	if err != nil {
		return fmt.Errorf("index cache %s: %w", p, err)
	}
	return nil
}
