package lazyimage

import (
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/nodecache"
)

// IndexNodeCache is the layer indexes of the node cache in cacheDir
// (Options.CacheDir) for `kata-fsx cache` and pruning: one encoded index
// per layer blob, keyed by the blob digest's hex. An index is read whole
// when an image is opened, so none is in use beyond that read; removing
// one costs a fetch or rebuild of it next time.
func IndexNodeCache(cacheDir string) nodecache.Cache {
	return &nodecache.Dir{CacheName: "indexes", Path: filepath.Join(cacheDir, "index", "sha256"),
		Note: func(key string) string { return "lazy index of layer sha256:" + key }}
}

// ImageNodeCache is the image records (manifest and config of an image
// named by digest) of the node cache in cacheDir, keyed by the reference
// digest's hex; small, and as safe to remove as the indexes.
func ImageNodeCache(cacheDir string) nodecache.Cache {
	return &nodecache.Dir{CacheName: "indexes", Path: filepath.Join(cacheDir, "image", "sha256"),
		Note: func(key string) string { return "manifest and config of image sha256:" + key }}
}
