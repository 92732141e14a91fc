package hostfs

import (
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// BlobCache is the blob cache of cacheDir (index.BlobPath's files) as the
// node cache "blobs": one uncompressed layer per entry, keyed by its
// diffID's hex. A blob is in use while a disk serving it holds its shared
// lock (Opener and HoldBlobs hold blobs so), and a removal is one unlink,
// made only when it can take the exclusive lock without waiting: see
// nodecache's lock order. It lives here, beside the locks it checks, so
// that the index format itself knows nothing of pruning.
func BlobCache(cacheDir string) nodecache.Cache {
	return &nodecache.Dir{CacheName: "blobs", Path: index.BlobDir(cacheDir), Locked: true,
		Note: func(key string) string { return "layer sha256:" + key }}
}
