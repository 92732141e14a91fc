package node

import (
	"context"
	"fmt"

	"github.com/kata-fsx/kata-fsx/blk/imagestore"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// Caches returns the node's caches under c's imagefs_blk state_dir, each
// with its [kata_fsx.cache] budget (nodecache.Unlimited for 0).
func Caches(c *config.Config) []nodecache.Budgeted {
	l := LayoutOf(c)
	caches := []nodecache.Cache{
		imagestore.NodeCache(l.ImageStore()),
		&nodecache.Union{CacheName: "indexes", Parts: []nodecache.Part{
			{Prefix: "layer", Cache: overlayfs.NodeCache(l.BlkCache())},
			{Prefix: "lazy", Cache: lazyimage.IndexNodeCache(l.LazyIndexes())},
			{Prefix: "image", Cache: lazyimage.ImageNodeCache(l.LazyIndexes())},
		}},
		hostfs.BlobCache(l.BlkCache()),
		store.NodeCache(l.ContentStore()),
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

// pruneLockName is the file under the blk cache directory that automatic
// prunes hold, one process at a time. It is only ever tried (TryLock),
// never waited for, so a prune holding it across PruneAll, whose waits
// are the content store's bounded ones and ctx, keeps no one waiting;
// a manual `kata-fsx cache prune` does not take it, and two prunes at
// once only race to ErrInUse or to a removal already done.
const pruneLockName = ".prune.lock"

// AutoPrune prunes every cache to its budget if c's prune is "auto" and
// no other process is pruning now; it reports whether it ran. Entries
// used within min_age_minutes are kept.
func AutoPrune(ctx context.Context, c *config.Config, logf func(string, ...any)) (ran bool, _ []nodecache.Result, _ error) {
	if c.KataFSX.Cache.Prune != config.PruneAuto {
		return false, nil, nil
	}
	unlock, ok, err := nodecache.TryLock(LayoutOf(c).PruneLock())
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

// LazyRootOptions are the lazyroot options configuration c gives: its
// [kata_fsx.registry] table, the imagefs-blk entry budget, and the node's
// index cache and content store, so that every process of the node (the
// shim, `kata-fsx run`, the snapshotter and its mount helper) finds what
// another one fetched.
func LazyRootOptions(c *config.Config, logf func(format string, args ...any)) lazyroot.Options {
	l := LayoutOf(c)
	entries, _, _, _ := c.KataFSX.ImagefsBlk.Budgets()
	o := lazyroot.Options{Registry: c.KataFSX.Registry, MaxEntries: entries, Logf: logf}
	if l.StateDir != "" {
		o.IndexDir, o.StoreDir = l.LazyIndexes(), l.ContentStore()
	}
	return o
}
