package lazyimage

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// The node cache (Options.CacheDir) holds
//
//	index/sha256/<layer blob hex>   a layer's encoded index (lazyindex)
//	image/sha256/<reference hex>    the manifest and config of an image
//	                                named by digest (imageRecord, JSON)
//
// Files are written whole and renamed into place, and no lock guards them:
// a reader opens the old file or the new one, never part of either; two
// writers of one name write the same bytes (the name is a digest) and the
// last rename wins; a prune removes a file with one unlink (IndexNodeCache),
// after which a reader that has it open still reads it whole and the next
// one misses. Nothing here waits for anyone. Everything read back is
// checked as an artifact is (a damaged file is a miss, logged, and later
// overwritten), except that the cache is trusted to have picked the
// platform manifest of an index digest: it is the node's own root-owned
// state, as blk/index's cache is.

func indexCachePath(dir string, d digest.Digest) string {
	return filepath.Join(dir, "index", d.Algorithm().String(), d.Encoded())
}

func imageCachePath(dir string, d digest.Digest) string {
	return filepath.Join(dir, "image", d.Algorithm().String(), d.Encoded())
}

// imageRecord is what the cache keeps of an image named by digest.
type imageRecord struct {
	ManifestDesc ocispec.Descriptor `json:"manifest_descriptor"`
	Manifest     ocispec.Manifest   `json:"manifest"`
	Config       []byte             `json:"config"`
}

// loadCachedIndex returns l's index from the node cache, or nil.
func loadCachedIndex(opts *Options, l *layer) (*lazyindex.Index, []byte) {
	if opts.CacheDir == "" {
		return nil, nil
	}
	p := indexCachePath(opts.CacheDir, l.desc.Digest)
	b, err := readBounded(p, maxIndexSize(l.desc.Size))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	var ix *lazyindex.Index
	if err == nil {
		ix, err = lazyindex.Decode(bytes.NewReader(b))
	}
	if err == nil {
		err = checkIndex(ix, l, opts.maxEntries())
	}
	if err != nil {
		opts.logf("node cache index %s of %s unusable, ignored: %v", p, l, err)
		return nil, nil
	}
	nodecache.Touch(p) // the stamp a prune's least-recently-used order reads
	return ix, b
}

// storeCachedIndex keeps layer i's index in the node cache; a failure is
// logged, not returned: the index in hand is good either way.
func storeCachedIndex(opts *Options, img *Image, i int) {
	if opts.CacheDir == "" {
		return
	}
	b, err := img.encodedIndex(i)
	if err == nil {
		err = writeFileAtomic(indexCachePath(opts.CacheDir, img.Manifest.Layers[i].Digest), b)
	}
	if err != nil {
		opts.logf("node cache: layer %d/%d %s not stored: %v", i+1, len(img.Layers), img.Manifest.Layers[i].Digest, err)
	}
}

// loadCachedImage fills img's manifest and config from the cache when its
// reference is by digest and the cache has it.
func loadCachedImage(opts *Options, img *Image) bool {
	if opts.CacheDir == "" || img.Ref.Digest == "" || checkSHA256(img.Ref.Digest) != nil {
		return false
	}
	p := imageCachePath(opts.CacheDir, img.Ref.Digest)
	b, err := readBounded(p, 3*maxConfigSize) // a config (base64 in JSON) and a manifest
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	var rec imageRecord
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err == nil {
		if derr := checkSHA256(rec.ManifestDesc.Digest); derr != nil {
			err = fmt.Errorf("manifest %w", derr)
		}
	}
	if err == nil && digest.SHA256.FromBytes(rec.Config) != rec.Manifest.Config.Digest {
		err = fmt.Errorf("config does not match its digest %s", rec.Manifest.Config.Digest)
	}
	var cfg ocispec.Image
	if err == nil {
		err = json.Unmarshal(rec.Config, &cfg)
	}
	if err != nil {
		opts.logf("node cache image %s unusable, ignored: %v", p, err)
		return false
	}
	nodecache.Touch(p)
	img.Manifest, img.ManifestDesc, img.Config = rec.Manifest, rec.ManifestDesc, cfg
	opts.logf("%s: manifest %s and config from the node cache", img.Ref, rec.ManifestDesc.Digest)
	return true
}

func storeCachedImage(opts *Options, img *Image, config []byte) {
	if opts.CacheDir == "" || img.Ref.Digest == "" || checkSHA256(img.Ref.Digest) != nil {
		return
	}
	b, err := json.Marshal(imageRecord{ManifestDesc: img.ManifestDesc, Manifest: img.Manifest, Config: config})
	if err == nil {
		err = writeFileAtomic(imageCachePath(opts.CacheDir, img.Ref.Digest), b)
	}
	if err != nil {
		opts.logf("node cache: image %s not stored: %v", img.Ref, err)
	}
}

// readBounded reads a regular file of at most max bytes.
func readBounded(p string, max int64) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", p)
	}
	if st.Size() > max {
		return nil, fmt.Errorf("%s has %d bytes, over the %d limit", p, st.Size(), max)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err == nil && int64(len(b)) > max {
		err = fmt.Errorf("%s grew over the %d limit", p, max)
	}
	return b, err
}

// writeFileAtomic writes b to p (atomicfile), making p's directory if
// need be.
func writeFileAtomic(p string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	return atomicfile.WriteFile(p, b, 0o600)
}
