package overlayfs

import (
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// NodeCache is the per-layer index cache of cacheDir (Cache{Dir:
// cacheDir}) for `kata-fsx cache` and pruning: one index file per entry.
// An index is read whole when a build loads it, so none is ever in use
// beyond that read and no lock guards it (Cache.Store renames a whole
// file into place); removing one costs a walk of its layer next time.
func NodeCache(cacheDir string) nodecache.Cache {
	return &nodecache.Dir{CacheName: "indexes", Path: IndexDir(cacheDir), Suffix: ".idx",
		Note: func(string) string { return "per-layer index" }}
}
