package index

import (
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/nodecache"
)

// BlobCache is the blob cache of cacheDir (BlobPath's files) as the node
// cache "blobs": one uncompressed layer per entry, keyed by its diffID's
// hex. A blob is in use while a disk serving it holds its shared lock
// (hostfs opens and holds blobs so), and a removal is one unlink, made
// only when it can take the exclusive lock without waiting: see
// nodecache's lock order.
func BlobCache(cacheDir string) nodecache.Cache {
	return &nodecache.Dir{CacheName: "blobs", Path: filepath.Join(cacheDir, "blobs", "sha256"), Locked: true,
		Note: func(key string) string { return "layer sha256:" + key }}
}
