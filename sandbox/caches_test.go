package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestDiskBuiltCaches: once a disk of an OCI image is built and served,
// the blob cache's prune after it (the shim's automatic one) removes an
// old unrelated blob to meet the budget and keeps the disk's blobs, in
// use for as long as the disk is served, though they are over the budget;
// when serving ends they are released.
func TestDiskBuiltCaches(t *testing.T) {
	layout, state := t.TempDir(), t.TempDir()
	l1, l2 := t.TempDir(), t.TempDir()
	for i, d := range []string{l1, l2} {
		// Distinct names: a file the upper layer shadowed would leave its
		// blob unreferenced by the disk, and so not held.
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%d", i)), bytes.Repeat([]byte{byte(i + 1)}, 3<<20), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	registrytest.WriteOCI(t, layout, "v1", registrytest.TarDir(t, l1), registrytest.TarDir(t, l2))
	cfg := config.Default()
	cfg.KataFSX.ImagefsBlk.StateDir = state
	cfg.KataFSX.Cache.BlobsMB = 1
	cfg.KataFSX.Cache.MinAgeMinutes = 0
	opts := blkOptions(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	idx, err := blk.IndexSource(ctx, "oci:"+layout+":v1", opts.CacheDir, opts.Budgets)
	if err != nil {
		t.Fatal(err)
	}
	// An old blob no disk reads, over the budget by itself.
	stale, err := index.BlobPath(opts.CacheDir, "sha256:"+string(bytes.Repeat([]byte("e"), 64)))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stale, bytes.Repeat([]byte{9}, 2<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-24 * time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	opts.Socket = filepath.Join(state, "b.sock")
	serveCtx, stopServing := context.WithCancel(ctx)
	d, err := blk.CreateFromIndex(serveCtx, idx, filepath.Join(state, "disk"), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Remove()
	s := &Sandbox{ID: "caches", cfg: cfg, life: ctx, pruneCaches: node.AutoPrune}
	<-s.diskBuilt(serveCtx, d, opts)

	blobs := hostfs.BlobCache(opts.CacheDir)
	es, err := blobs.Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 2 {
		t.Fatalf("%d blobs after the prune, want the disk's 2 (the stale one pruned)", len(es))
	}
	for _, e := range es {
		if !e.InUse {
			t.Fatalf("blob %s of the served disk is not in use", e.Key)
		}
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("the stale blob: %v, want it pruned", err)
	}
	// The disk's synthesized metadata: one entry of the metadata cache, in use.
	for _, b := range node.Caches(cfg) {
		if b.Cache.Name() != "metadata" {
			continue
		}
		es, err := b.Cache.Entries(ctx)
		if err != nil || len(es) != 1 || !es[0].InUse {
			t.Fatalf("metadata cache while the disk is served: %+v %v, want its image in use", es, err)
		}
	}
	stopServing()
	// The hold ends with serving (released by an AfterFunc): wait for it.
	testenv.Eventually(t, 30*time.Second, func() (bool, error) {
		r, err := nodecache.Prune(ctx, blobs, 0, nodecache.PruneOptions{DryRun: true})
		if err != nil {
			t.Fatal(err)
		}
		return len(r.KeptInUse) == 0, fmt.Errorf("blobs still held after serving stopped: %s", r.Summary())
	})
}
