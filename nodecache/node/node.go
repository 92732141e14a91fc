// Package node lists this node's caches (nodecache.Cache) with their
// budgets from the configuration, for `kata-fsx cache`, the shim's prune
// after a disk build and the snapshotter's periodic one. It is the one
// place that knows where under kata_fsx.imagefs_blk.state_dir each cache
// lives and which package implements it.
package node

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/imagestore"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// Caches returns the node's caches under c's imagefs_blk state_dir, each
// with its [kata_fsx.cache] budget (nodecache.Unlimited for 0).
func Caches(c *config.Config) []nodecache.Budgeted {
	state := c.KataFSX.ImagefsBlk.StateDir
	blkCache := filepath.Join(state, "cache")      // blk.Options.CacheDir, as the shim and cli set it
	lazyIndexes := filepath.Join(state, "indexes") // lazyroot's index cache
	caches := []nodecache.Cache{
		imagestore.NodeCache(blk.ImageStoreDir(blkCache)),
		&nodecache.Union{CacheName: "indexes", Parts: []nodecache.Part{
			{Prefix: "layer", Cache: overlayfs.NodeCache(blkCache)},
			{Prefix: "lazy", Cache: lazyimage.IndexNodeCache(lazyIndexes)},
			{Prefix: "image", Cache: lazyimage.ImageNodeCache(lazyIndexes)},
		}},
		index.BlobCache(blkCache),
		store.NodeCache(filepath.Join(state, "content")), // lazyroot.StoreDir
	}
	out := make([]nodecache.Budgeted, 0, len(caches))
	for _, k := range caches {
		b, ok := c.KataFSX.Cache.Budget(k.Name())
		if !ok {
			b = nodecache.Unlimited
		}
		out = append(out, nodecache.Budgeted{Cache: k, Budget: b})
	}
	return out
}

// lockName is the file under the blk cache directory that automatic
// prunes hold, one process at a time. It is only ever tried (TryLock),
// never waited for, so a prune holding it across PruneAll, whose waits
// are the content store's bounded ones and ctx, keeps no one waiting;
// a manual `kata-fsx cache prune` does not take it, and two prunes at
// once only race to ErrInUse or to a removal already done.
const lockName = ".prune.lock"

// AutoPrune prunes every cache to its budget if c's prune is "auto" and
// no other process is pruning now; it reports whether it ran. Entries
// used within min_age_minutes are kept.
func AutoPrune(ctx context.Context, c *config.Config, logf func(string, ...any)) (ran bool, _ []nodecache.Result, _ error) {
	if c.KataFSX.Cache.Prune != config.PruneAuto {
		return false, nil, nil
	}
	p := filepath.Join(c.KataFSX.ImagefsBlk.StateDir, "cache", lockName)
	unlock, ok, err := nodecache.TryLock(p)
	if err != nil {
		return false, nil, fmt.Errorf("node caches: %w", err)
	}
	if !ok {
		return false, nil, nil
	}
	defer unlock()
	rs, err := nodecache.PruneAll(ctx, Caches(c), nodecache.PruneOptions{MinAge: c.KataFSX.Cache.MinAge(), Logf: logf})
	return true, rs, err
}
