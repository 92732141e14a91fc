package index

import "path/filepath"

// DefaultMaxBlobSize is the per-layer inflated-bytes budget unless Options
// says otherwise: it stops a decompression bomb from filling the cache
// disk, while the largest real layers (CUDA and ML runtimes) are a few GiB.
const DefaultMaxBlobSize = 16 << 30

// Options tunes index building for every source. The zero value is usable:
// no cache, default limits.
type Options struct {
	// CacheDir holds per-layer indexes (CacheDir/index/) and decompressed
	// layer blobs (CacheDir/blobs/sha256/<diffID hex>). overlayfs.FromLayers
	// without it does not cache; oci.FromOCI requires it.
	CacheDir string
	// LayerKeys, when set, has one caller-chosen cache key per FromLayers
	// layer (e.g. a committed containerd snapshot's ID); a key vouches that
	// the layer never changes. A layer with an empty key is mutable (an
	// upperdir, a bind-mounted rootfs) and is never cached.
	LayerKeys []string
	// MaxEntries bounds the entries of any one layer and of the merged
	// tree; zero means DefaultMaxEntries.
	MaxEntries int
	// MaxBlobSize is the per-layer inflated-bytes budget: the most bytes one
	// layer may inflate to (the blob cache's file for it); zero means
	// DefaultMaxBlobSize.
	MaxBlobSize int64
	// Stats, when non-nil, receives counters of the work done; it is not
	// safe to share between concurrent calls.
	Stats *Stats
}

// Stats counts the work an index build did, so callers and tests can see
// whether caches were used.
type Stats struct {
	LayersIndexed int // layers walked on the host or read from a tar
	LayersCached  int // layer indexes loaded from the cache
	BlobsWritten  int // layer blobs decompressed or copied into the cache
	Entries       int // entries of the result
}

// EntryLimit returns MaxEntries, or DefaultMaxEntries when it is zero.
func (o *Options) EntryLimit() int {
	if o.MaxEntries > 0 {
		return o.MaxEntries
	}
	return DefaultMaxEntries
}

// Counters returns Stats, or a throwaway Stats when it is nil, so that a
// source can count without checking.
func (o *Options) Counters() *Stats {
	if o.Stats != nil {
		return o.Stats
	}
	return &Stats{}
}

// BlobSizeLimit returns MaxBlobSize, or DefaultMaxBlobSize when it is zero.
func (o *Options) BlobSizeLimit() int64 {
	if o.MaxBlobSize > 0 {
		return o.MaxBlobSize
	}
	return DefaultMaxBlobSize
}

// BlobPath returns where the uncompressed layer with the given diffID
// ("sha256:<hex>") lives in a cache directory. It is here, not in a source,
// because the sources that fill the blob cache and the openers that read it
// must agree on it.
func BlobPath(cacheDir, digest string) (string, error) {
	h, err := BlobHex(digest)
	if err != nil {
		return "", err
	}
	return filepath.Join(BlobDir(cacheDir), h), nil
}

// BlobDir is the directory of a cache directory's blobs, one file per
// diffID's hex.
func BlobDir(cacheDir string) string { return filepath.Join(cacheDir, "blobs", "sha256") }
