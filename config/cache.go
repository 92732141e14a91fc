package config

import (
	"errors"
	"fmt"
	"time"
)

// Values of kata_fsx.cache.prune.
const (
	PruneAuto   = "auto"   // after each disk build (the shim) and periodically (the snapshotter)
	PruneManual = "manual" // only `kata-fsx cache prune`
)

// Cache is the [kata_fsx.cache] table: the budgets of the node caches
// under kata_fsx.imagefs_blk.state_dir and when they are pruned to them
// (docs/caches.md).
type Cache struct {
	// Budgets in MiB, 0 for none (the cache grows without bound).
	MetadataMB uint64 `toml:"metadata_mb"` // synthesized image metadata (cache/images)
	IndexesMB  uint64 `toml:"indexes_mb"`  // per-layer and lazy layer indexes (cache/index, indexes/)
	BlobsMB    uint64 `toml:"blobs_mb"`    // uncompressed OCI layer blobs (cache/blobs)
	ContentMB  uint64 `toml:"content_mb"`  // the lazy store's disk tier (content/layers)
	// Prune is PruneAuto or PruneManual.
	Prune string `toml:"prune"`
	// PruneIntervalMinutes is how often `kata-fsx snapshotter` prunes
	// (with Prune auto); 0: only at its start.
	PruneIntervalMinutes uint32 `toml:"prune_interval_minutes"`
	// MinAgeMinutes keeps entries used this recently from any prune: a
	// build may have written an entry and not yet marked it in use.
	MinAgeMinutes uint32 `toml:"min_age_minutes"`
}

// DefaultCache is the [kata_fsx.cache] table when the file has none.
func DefaultCache() Cache {
	return Cache{MetadataMB: 4 << 10, IndexesMB: 1 << 10, BlobsMB: 20 << 10, ContentMB: 20 << 10,
		Prune: PruneAuto, PruneIntervalMinutes: 30, MinAgeMinutes: 10}
}

// maxCacheMB bounds a budget (1 EiB) so that it converts to bytes in an int64.
const maxCacheMB = 1 << 40

// Budget returns the budget of the node cache name in bytes, and false
// when the cache has none (0) or the name is not a cache's.
func (c Cache) Budget(name string) (int64, bool) {
	var mb uint64
	switch name {
	case "metadata":
		mb = c.MetadataMB
	case "indexes":
		mb = c.IndexesMB
	case "blobs":
		mb = c.BlobsMB
	case "content":
		mb = c.ContentMB
	}
	if mb == 0 || mb > maxCacheMB {
		return 0, false
	}
	return int64(mb) << 20, true
}

// MinAge is MinAgeMinutes as a duration.
func (c Cache) MinAge() time.Duration { return time.Duration(c.MinAgeMinutes) * time.Minute }

// PruneInterval is PruneIntervalMinutes as a duration.
func (c Cache) PruneInterval() time.Duration {
	return time.Duration(c.PruneIntervalMinutes) * time.Minute
}

func validateCache(c *Cache, add func(*Error)) {
	def := DefaultCache()
	for _, b := range []struct {
		key string
		v   uint64
		def uint64
	}{
		{"metadata_mb", c.MetadataMB, def.MetadataMB},
		{"indexes_mb", c.IndexesMB, def.IndexesMB},
		{"blobs_mb", c.BlobsMB, def.BlobsMB},
		{"content_mb", c.ContentMB, def.ContentMB},
	} {
		if b.v > maxCacheMB {
			add(&Error{Key: "kata_fsx.cache." + b.key, Value: fmt.Sprint(b.v), Problem: fmt.Sprintf("budget over %d MiB (1 EiB)", uint64(maxCacheMB)),
				Fix: fmt.Sprintf("use %d (the default) or 0 for no budget", b.def)})
		}
	}
	if c.Prune != PruneAuto && c.Prune != PruneManual {
		add(&Error{Key: "kata_fsx.cache.prune", Value: c.Prune, Problem: `must be "auto" or "manual"`,
			Fix: `use "auto" (the default: after each disk build and periodically in kata-fsx snapshotter) or "manual" (only kata-fsx cache prune)`})
	}
	if c.PruneIntervalMinutes > 7*24*60 {
		add(&Error{Key: "kata_fsx.cache.prune_interval_minutes", Value: fmt.Sprint(c.PruneIntervalMinutes), Problem: "longer than a week",
			Fix: "use 30 (the default) or 0 to prune only when the snapshotter starts"})
	}
	if c.MinAgeMinutes > 7*24*60 {
		add(&Error{Key: "kata_fsx.cache.min_age_minutes", Value: fmt.Sprint(c.MinAgeMinutes), Problem: "longer than a week: nothing recent could ever be pruned",
			Fix: "use 10 (the default)"})
	}
}

// ValidateCache checks the [kata_fsx.cache] table, naming each bad key.
func ValidateCache(c *Config) error {
	var errs []error
	validateCache(&c.KataFSX.Cache, func(e *Error) { errs = append(errs, e) })
	return errors.Join(errs...)
}
