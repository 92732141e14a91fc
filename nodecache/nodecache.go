// Package nodecache keeps the node's caches (synthesized metadata, layer
// indexes, layer blobs, the lazy store's disk tier) within their budgets:
// each cache lists its entries with their size, last use and whether a
// running pod holds them, and Prune removes the least recently used
// entries nobody holds until the cache fits. Each cache's own package
// implements Cache, because only it knows its files and its locks.
//
// Lock order. A cache's users hold its entries' locks shared (a flock, or
// the content store's OFD read lock on a chunk map) for as long as they
// use them, and wait for them only while a removal holds them exclusive.
// A removal (Cache.Remove, HeldShared, Entries' in-use checks) takes the
// exclusive lock without waiting, an entry held shared being ErrInUse,
// and keeps it only to rename or unlink what it names. So a user waits
// only for a removal that waits for nothing, and a removal never waits for
// a user: neither can wait, through the other, on a holder of its own.
// Prune takes no lock of its own; an automatic prune holds the node's
// prune lock (node.AutoPrune in package node), which everyone else tries without waiting.
// The one removal that waits is the content store's, for its layer's
// header and chunk locks, which users hold only while they open the layer
// or fetch a chunk: within initLockWait in all and the prune's context.
package nodecache

import (
	"context"
	"errors"
	"time"
)

// ErrInUse is returned by Cache.Remove for an entry a running pod (or a
// build) holds; Prune skips it.
var ErrInUse = errors.New("in use")

// Entry is one evictable unit of a node cache.
type Entry struct {
	// Key names the entry within its cache (a digest, a key hash).
	Key string
	// Bytes is the disk space the entry holds (allocated blocks).
	Bytes int64
	// LastUsed is when a pod or build last used it.
	LastUsed time.Time
	// InUse says a running pod or a build holds it now.
	InUse bool
	// Note is a human hint for `kata-fsx cache ls` (an image, a layer); may be empty.
	Note string
}

// Cache is one node cache as listing and pruning see it.
type Cache interface {
	// Name is the cache's name in configuration keys and in `kata-fsx
	// cache`: "metadata", "indexes", "blobs" or "content".
	Name() string
	// Entries lists the cache's complete entries.
	Entries(ctx context.Context) ([]Entry, error)
	// Remove deletes one entry unless something holds it (ErrInUse). A
	// process killed in the middle must leave either the whole entry or
	// nothing a later open would serve: never a torn entry.
	Remove(ctx context.Context, key string) error
}
