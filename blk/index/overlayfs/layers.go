package overlayfs

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"golang.org/x/sys/unix"
)

// FromLayers merges overlay layer directories, lowest first, as containerd's
// overlayfs snapshotter leaves them (each a snapshot's "fs" directory), with
// overlayfs semantics: a character device 0:0 is a whiteout, a directory
// with trusted.overlay.opaque=y hides everything below it, and an upper
// non-directory replaces a lower directory and vice versa. Overlay xattrs do
// not appear in the result. Each layer is one SourceDir whose ID is its
// absolute path; a bind rootfs is a single layer.
//
// With opts.CacheDir, a layer the caller vouches for with a key in
// opts.LayerKeys (a committed, immutable snapshot) has its index cached
// under that key, its path and its directory's device, inode and ctime, so
// a hit skips the walk. A layer without a key is mutable as far as we know
// (an upperdir, a bind-mounted rootfs) and is walked every time: no stamp
// short of a full walk sees a nested file change, and a stale index serves
// wrong data (a file's new bytes cut to its old size, new files missing).
// Not interpreted: redirect_dir, metacopy and xattr-based whiteouts, which
// containerd does not create in snapshot layers.
func FromLayers(ctx context.Context, layers []string, opts index.Options) (*index.Index, error) {
	if len(layers) == 0 {
		return nil, index.Invalidf("no layers")
	}
	if opts.LayerKeys != nil && len(opts.LayerKeys) != len(layers) {
		return nil, fmt.Errorf("%d layer keys for %d layers: %w", len(opts.LayerKeys), len(layers), index.ErrInvalid)
	}
	st := opts.Counters()
	cache := Cache{Dir: opts.CacheDir}
	idx := make([]*index.Index, len(layers))
	names := make([]string, len(layers))
	for i, l := range layers {
		abs, err := filepath.Abs(l)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", l, err)
		}
		names[i] = abs
		key, err := dirLayerKey(abs, opts.LayerKeys, i)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", abs, err)
		}
		if key != "" {
			if ix := cache.Load(key, index.Source{Kind: index.SourceDir, ID: abs}); ix != nil {
				idx[i] = ix
				st.LayersCached++
				continue
			}
		}
		// Not opts itself: this loop counts the layer in opts.Stats.
		ix, err := hostfs.FromDir(ctx, abs, index.Options{MaxEntries: opts.MaxEntries})
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w", i, err)
		}
		st.LayersIndexed++
		if key != "" {
			if err := cache.Store(key, ix); err != nil {
				return nil, fmt.Errorf("layer %s: %w", abs, err)
			}
		}
		idx[i] = ix
	}
	ix, err := Merge(ctx, idx, names, opts.EntryLimit())
	if err != nil {
		return nil, err
	}
	st.Entries = len(ix.Entries)
	return ix, nil
}

// dirLayerKey is the cache key of layer i, or "" when it has no caller key
// and so must not be cached. The stat stamp guards against a caller key
// reused for a directory that was removed and created again.
func dirLayerKey(abs string, keys []string, i int) (string, error) {
	if keys == nil || keys[i] == "" {
		return "", nil
	}
	var st unix.Stat_t
	if err := unix.Stat(abs, &st); err != nil {
		return "", fmt.Errorf("stat: %w", err)
	}
	return fmt.Sprintf("dir-key\x00%s\x00%s\x00%d\x00%d\x00%d.%09d", abs, keys[i], st.Dev, st.Ino, st.Ctim.Sec, st.Ctim.Nsec), nil
}
