// Package node owns the node's on-disk layout and its caches: where under
// the state and run directories each component keeps its files, and the
// list of node caches with their budgets, for `kata-fsx cache`, the
// shim's prune after a disk build and the snapshotter's periodic one. It
// is the one place that spells those paths, so moving one is one edit
// here (pinned by TestLayoutPaths), and the composition root that knows
// which package implements each cache.
package node

import (
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/config"
)

// Layout is the node's two directory trees. Each method names one place
// a component is handed; what a component keeps inside it is its own.
type Layout struct {
	// StateDir is kata_fsx.imagefs_blk.state_dir: what outlives pods and
	// reboots (the blk cache, lazy indexes, the content store).
	StateDir string
	// RunDir is kata_fsx.state_dir: one directory per sandbox, which a
	// reboot may clear.
	RunDir string
}

// LayoutOf is the layout configuration c names.
func LayoutOf(c *config.Config) Layout {
	return Layout{StateDir: c.KataFSX.ImagefsBlk.StateDir, RunDir: c.KataFSX.StateDir}
}

// BlkCache is imagefs-blk's cache directory (blk.Options.CacheDir): the
// image store, per-layer indexes and layer blobs below it.
func (l Layout) BlkCache() string { return filepath.Join(l.StateDir, "cache") }

// ImageStore is where synthesized image metadata is kept (the
// "metadata" cache).
func (l Layout) ImageStore() string { return blk.ImageStoreDir(l.BlkCache()) }

// LayerIndexes is where per-layer indexes of committed snapshots are
// cached (the "indexes" cache's layer/ part).
func (l Layout) LayerIndexes() string { return overlayfs.IndexDir(l.BlkCache()) }

// BlobCache is where uncompressed OCI layers are kept (the "blobs"
// cache), one file per diffID as index.BlobPath names it.
func (l Layout) BlobCache() string { return index.BlobDir(l.BlkCache()) }

// LazyIndexes is the lazy images' index cache (lazyimage.Options.CacheDir,
// the "indexes" cache's lazy/ and image/ parts).
func (l Layout) LazyIndexes() string { return filepath.Join(l.StateDir, "indexes") }

// ContentStore is the lazy content store every process of the node
// shares (the "content" cache).
func (l Layout) ContentStore() string { return filepath.Join(l.StateDir, "content") }

// PruneLock is the file automatic prunes hold, one process at a time.
func (l Layout) PruneLock() string { return filepath.Join(l.BlkCache(), pruneLockName) }

// Sandboxes is the directory holding one directory per sandbox.
func (l Layout) Sandboxes() string { return l.RunDir }

// Sandbox is the directory of sandbox id: everything the pod has on the
// host (QEMU's directory, sockets, the shared directory's mounts, disks).
func (l Layout) Sandbox(id string) string { return filepath.Join(l.RunDir, id) }
