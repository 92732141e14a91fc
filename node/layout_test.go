package node

import (
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

// TestLayoutPaths pins where the node keeps each thing: a node upgraded
// in place finds its caches and content store where the last version left
// them only if none of these moves, so a move must be a deliberate edit
// here (and in docs/caches.md), with a migration or a word in the notes.
func TestLayoutPaths(t *testing.T) {
	c := config.Default()
	l := LayoutOf(c)
	for _, p := range []struct{ name, got, want string }{
		{"StateDir", l.StateDir, "/var/lib/kata-fsx/imagefs-blk"},
		{"RunDir", l.RunDir, "/run/kata-fsx"},
		{"BlkCache", l.BlkCache(), "/var/lib/kata-fsx/imagefs-blk/cache"},
		{"ImageStore", l.ImageStore(), "/var/lib/kata-fsx/imagefs-blk/cache/images"},
		{"LayerIndexes", l.LayerIndexes(), "/var/lib/kata-fsx/imagefs-blk/cache/index"},
		{"BlobCache", l.BlobCache(), "/var/lib/kata-fsx/imagefs-blk/cache/blobs/sha256"},
		{"LazyIndexes", l.LazyIndexes(), "/var/lib/kata-fsx/imagefs-blk/indexes"},
		{"ContentStore", l.ContentStore(), "/var/lib/kata-fsx/imagefs-blk/content"},
		{"PruneLock", l.PruneLock(), "/var/lib/kata-fsx/imagefs-blk/cache/.prune.lock"},
		{"Sandboxes", l.Sandboxes(), "/run/kata-fsx"},
		{"Sandbox", l.Sandbox("pod1"), "/run/kata-fsx/pod1"},
	} {
		if p.got != p.want {
			t.Errorf("%s = %q, want %q", p.name, p.got, p.want)
		}
	}
	c.KataFSX.ImagefsBlk.StateDir, c.KataFSX.StateDir = "/srv/blk", "/tmp/run"
	if l := LayoutOf(c); l.ContentStore() != "/srv/blk/content" || l.Sandbox("x") != "/tmp/run/x" {
		t.Errorf("configured directories not followed: %+v", l)
	}
	if o := LazyRootOptions(c, nil); o.IndexDir != "/srv/blk/indexes" || o.StoreDir != "/srv/blk/content" {
		t.Errorf("LazyRootOptions dirs %q %q, want the layout's", o.IndexDir, o.StoreDir)
	}
}
