package lazyroot

import (
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/store"
)

// ImageOptions are the lazyimage options Open resolves images with: the
// node cache of indexes in IndexDir, so that every process of the node
// (the shim, the snapshotter, its mount helper) finds the indexes one of
// them resolved.
func ImageOptions(o Options) lazyimage.Options {
	return lazyimage.Options{Client: lazyimage.ClientFromConfig(o.Registry), MaxEntries: o.MaxEntries,
		CacheDir: o.IndexDir, Logf: o.Logf, MaxIndexBytes: int64(o.Registry.MaxIndexMB) << 20}
}

// OpenStore opens the node's content store as Open does (StoreDir
// and the registry table's bounds), so that chunks fetched by one process
// of the node are on disk for the others.
func OpenStore(o Options) (*store.Store, error) {
	reg := o.Registry
	return store.Open(store.Options{Dir: o.StoreDir, MemoryBytes: int64(reg.CacheMemoryMB) << 20,
		ReadTimeout: reg.ReadDeadline(), MaxFetch: int64(reg.MaxFetchMB) << 20, Logf: o.Logf})
}
