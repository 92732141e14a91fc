package node

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// oldBlob writes a blob of n bytes last used a day ago into the blob cache.
func oldBlob(t *testing.T, state string, fill byte, n int) string {
	t.Helper()
	p, err := index.BlobPath(Layout{StateDir: state}.BlkCache(), "sha256:"+string(bytes.Repeat([]byte{"0123456789abcdef"[fill&15]}, 64)))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, bytes.Repeat([]byte{fill}, n), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-24 * time.Hour)
	if err := os.Chtimes(p, old, old); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCaches: every cache is listed under its configured name with its
// budget; 0 is none.
func TestCaches(t *testing.T) {
	c := config.Default()
	c.KataFSX.ImagefsBlk.StateDir = t.TempDir()
	c.KataFSX.Cache.BlobsMB = 0
	got := map[string]int64{}
	for _, b := range Caches(c) {
		got[b.Cache.Name()] = b.Budget
		if es, err := b.Cache.Entries(context.Background()); err != nil || len(es) != 0 {
			t.Fatalf("%s on an empty state directory: %v %v", b.Cache.Name(), es, err)
		}
	}
	want := map[string]int64{"metadata": 4 << 30, "indexes": 1 << 30, "blobs": nodecache.Unlimited, "content": 20 << 30}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("cache %s budget %d, want %d", k, got[k], v)
		}
	}
}

// TestAutoPrune: with prune "auto" an automatic prune removes what is
// over budget; "manual" and a prune another process runs (its lock held)
// leave it.
func TestAutoPrune(t *testing.T) {
	state := t.TempDir()
	c := config.Default()
	c.KataFSX.ImagefsBlk.StateDir = state
	c.KataFSX.Cache.BlobsMB = 1
	a, b := oldBlob(t, state, 1, 1<<20), oldBlob(t, state, 2, 1<<20)
	// b newer: a goes first.
	now := time.Now()
	if err := os.Chtimes(b, now, now); err != nil {
		t.Fatal(err)
	}
	c.KataFSX.Cache.Prune = config.PruneManual
	if ran, _, err := AutoPrune(context.Background(), c, nil); ran || err != nil {
		t.Fatalf("manual: ran %v %v", ran, err)
	}
	c.KataFSX.Cache.Prune = config.PruneAuto
	unlock, ok, err := nodecache.TryLock(LayoutOf(c).PruneLock())
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	if ran, _, err := AutoPrune(context.Background(), c, nil); ran || err != nil {
		t.Fatalf("while another prune holds the lock: ran %v %v", ran, err)
	}
	unlock()
	ran, rs, err := AutoPrune(context.Background(), c, nil)
	if !ran || err != nil {
		t.Fatalf("auto: ran %v %v", ran, err)
	}
	for _, r := range rs {
		if r.Cache == "blobs" && (len(r.Removed) != 1 || r.OverBudget()) {
			t.Fatalf("blobs: %s", r.Summary())
		}
	}
	if _, err := os.Stat(a); !os.IsNotExist(err) {
		t.Fatalf("the older blob: %v, want it pruned", err)
	}
	if _, err := os.Stat(b); err != nil {
		t.Fatalf("the blob used within min_age_minutes: %v", err)
	}
}

// TestLazyRootOptionsIndexBound: the registry table's max_index_mb reaches
// the lazyimage options every process of the node resolves images with.
func TestLazyRootOptionsIndexBound(t *testing.T) {
	c := config.Default()
	if got := lazyroot.ImageOptions(LazyRootOptions(c, nil)).MaxIndexBytes; got != 64<<20 {
		t.Errorf("default configuration: MaxIndexBytes %d, want 64 MiB", got)
	}
	c.KataFSX.Registry.MaxIndexMB = 3
	if got := lazyroot.ImageOptions(LazyRootOptions(c, nil)).MaxIndexBytes; got != 3<<20 {
		t.Errorf("max_index_mb = 3: MaxIndexBytes %d, want 3 MiB", got)
	}
}
