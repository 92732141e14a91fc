package blk

import "time"

// BuildInfo says how a disk's image came to be, for metrics and logs.
type BuildInfo struct {
	// Index is the time spent indexing the rootfs (zero when the caller
	// passed an index).
	Index time.Duration
	// Synthesis is the time spent synthesizing the ext4 metadata (zero
	// when the node already had it).
	Synthesis time.Duration
	// Shared says the metadata was found in the node's image store, built
	// by an earlier or concurrent pod, rather than built by this one.
	Shared bool
}
