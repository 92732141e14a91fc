package overlayfs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"github.com/kata-fsx/kata-fsx/test/helperproc"
)

// cacheHelperEnv makes the test binary a helper (TestIndexCacheHelper):
// "prune CACHEDIR" prunes NodeCache(CACHEDIR) to 0, pausing after its
// first removal; "store CACHEDIR LAYERDIR" indexes LAYERDIR and stores it
// under the key "k-new", pausing before the rename.
const cacheHelperEnv = "OVERLAYFS_CACHE_HELPER"

// TestIndexCacheHelper is not a test: it is the helper process of the
// tests below and returns at once when cacheHelperEnv is unset.
func TestIndexCacheHelper(t *testing.T) {
	args := strings.Fields(os.Getenv(cacheHelperEnv))
	if len(args) == 0 {
		return
	}
	switch args[0] {
	case "prune":
		c := &pauseAfterRemove{Cache: NodeCache(args[1]), step: "prune"}
		r, err := nodecache.Prune(context.Background(), c, 0, nodecache.PruneOptions{})
		fmt.Println(r.Summary(), err)
	case "store":
		beforeRename = func() { helperproc.Pause("index-store") }
		ix, err := hostfs.FromDir(context.Background(), args[2], index.Options{})
		if err == nil {
			err = Cache{Dir: args[1]}.Store("k-new", ix)
		}
		fmt.Println("stored", err)
	}
}

// pauseAfterRemove is a nodecache.Cache whose first removal pauses the
// helper process (helperproc.Pause) once it is done.
type pauseAfterRemove struct {
	nodecache.Cache
	step string
}

func (p *pauseAfterRemove) Remove(ctx context.Context, key string) error {
	err := p.Cache.Remove(ctx, key)
	if err == nil {
		helperproc.Pause(p.step)
	}
	return err
}

// runKilled runs the helper doing what, which pauses at step, and kills
// it (SIGKILL) once it is there.
func runKilled(t *testing.T, what, step string) {
	t.Helper()
	cmd := helperproc.Start(t, "TestIndexCacheHelper", "helperproc: paused at "+step, cacheHelperEnv+"="+what)
	helperproc.Kill(t, cmd)
}

// TestIndexCacheKilled: a prune of the per-layer index cache killed after
// its first removal, and a store killed before its rename, leave every
// index file valid or absent: each key loads the index stored or
// misses, never a damaged one; the store's temporary file is kept while
// it may be a write in progress and pruned once stale.
func TestIndexCacheKilled(t *testing.T) {
	cache := t.TempDir()
	c := Cache{Dir: cache}
	want := map[string]*index.Index{}
	day := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 4 {
		layer := t.TempDir()
		indextest.WriteFile(t, filepath.Join(layer, fmt.Sprintf("f%d", i)), bytes.Repeat([]byte{byte(i)}, 100*i), 0o644)
		ix, err := hostfs.FromDir(context.Background(), layer, index.Options{})
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("k%d", i)
		if err := c.Store(key, ix); err != nil {
			t.Fatal(err)
		}
		at := day.Add(time.Duration(i) * time.Hour)
		indextest.Must(t, os.Chtimes(c.path(key), at, at))
		want[key] = ix
	}
	runKilled(t, "prune "+cache, "prune")
	loaded := 0
	for key, ix := range want {
		got := c.Load(key, ix.Sources[0])
		if _, err := os.Stat(c.path(key)); err == nil && got == nil {
			t.Fatalf("%s: its file is there but does not load", key)
		}
		if got != nil {
			loaded++
			if !reflect.DeepEqual(indextest.Normalize(got), indextest.Normalize(ix)) {
				t.Fatalf("%s loads an index that is not the one stored", key)
			}
		}
	}
	if loaded != 3 || c.Load("k0", want["k0"].Sources[0]) != nil {
		t.Fatalf("%d of 4 indexes load after a prune killed after its first removal, want all but the oldest (k0)", loaded)
	}

	layer := t.TempDir()
	indextest.WriteFile(t, filepath.Join(layer, "new"), []byte("new"), 0o644)
	runKilled(t, "store "+cache+" "+layer, "index-store")
	if ix := c.Load("k-new", index.Source{Kind: index.SourceDir, ID: layer}); ix != nil {
		t.Fatal("a store killed before its rename left an entry that loads")
	}
	nc := NodeCache(cache)
	r, err := nodecache.Prune(context.Background(), nc, 0, nodecache.PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Removed) != 3 || len(r.KeptInUse) != 1 || !strings.HasPrefix(r.KeptInUse[0].Key, nodecache.TempPrefix) {
		t.Fatalf("prune: %s; kept %v", r.Summary(), r.KeptInUse)
	}
	old := time.Now().Add(-2 * nodecache.StaleTemp)
	indextest.Must(t, os.Chtimes(filepath.Join(cache, "index", r.KeptInUse[0].Key), old, old))
	if r, err := nodecache.Prune(context.Background(), nc, 0, nodecache.PruneOptions{}); err != nil || len(r.Removed) != 1 {
		t.Fatalf("prune of the stale temporary file: %s %v", r.Summary(), err)
	}
	des, _ := os.ReadDir(filepath.Join(cache, "index"))
	if len(des) != 0 {
		t.Fatalf("%d files left", len(des))
	}
}

// TestIndexCacheLoadStamps: a load stamps the entry used now, the order a
// prune reads.
func TestIndexCacheLoadStamps(t *testing.T) {
	cache, layer := t.TempDir(), t.TempDir()
	indextest.WriteFile(t, filepath.Join(layer, "f"), []byte("x"), 0o644)
	ix, err := hostfs.FromDir(context.Background(), layer, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	c := Cache{Dir: cache}
	indextest.Must(t, c.Store("k", ix))
	old := time.Now().Add(-48 * time.Hour)
	indextest.Must(t, os.Chtimes(c.path("k"), old, old))
	if c.Load("k", ix.Sources[0]) == nil {
		t.Fatal("no load")
	}
	es, err := NodeCache(cache).Entries(context.Background())
	if err != nil || len(es) != 1 || time.Since(es[0].LastUsed) > time.Hour || es[0].InUse {
		t.Fatalf("entries %+v %v, want one used just now", es, err)
	}
}
