package store

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/nodecache"
	"github.com/kata-fsx/kata-fsx/test/helperproc"
)

// cacheHelperEnv makes the test binary a helper process
// (TestNodeCacheHelper): "hold DIR SEED" opens a Store on DIR with the
// layer makeLayer builds from SEED added and keeps it until killed;
// "prune DIR" prunes NodeCache(DIR) to 0 bytes, pausing between the
// unlinks of the first layer it removes.
const cacheHelperEnv = "STORE_NODECACHE_HELPER"

// nodeLayer is the layer of the tests below for a seed: the same bytes in
// every process.
func nodeLayer(t testing.TB, seed uint64) *testLayer {
	return makeLayer(t, rand.New(rand.NewPCG(seed, seed)), 6, 5, 150*kib, 64*kib, 64*kib)
}

// TestNodeCacheHelper is not a test: it is the helper process of the
// tests below and returns at once when cacheHelperEnv is unset.
func TestNodeCacheHelper(t *testing.T) {
	args := strings.Fields(os.Getenv(cacheHelperEnv))
	if len(args) == 0 {
		return
	}
	switch args[0] {
	case "hold":
		var seed uint64
		fmt.Sscan(args[2], &seed)
		l := nodeLayer(t, seed)
		s := openStore(t, Options{Dir: args[1]})
		layerReader(t, s, l, newFake(l.blob))
		fmt.Println("held")
		select {}
	case "prune":
		betweenUnlinks = func() { helperproc.Pause("content-remove") }
		r, err := nodecache.Prune(context.Background(), NodeCache(args[1]), 0, nodecache.PruneOptions{})
		fmt.Println(r.Summary(), err)
	}
}

// fillLayer reads the whole of l through a Store on dir, so that its
// chunks are on the node disk, and closes the Store; it stamps the layer
// last used at.
func fillLayer(t *testing.T, dir string, l *testLayer, at time.Time) {
	t.Helper()
	s, err := Open(Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	checkRead(t, layerReader(t, s, l, newFake(l.blob)), l.tar, 0, len(l.tar))
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(filepath.Join(dir, "layers", l.ix.Digest[7:]+".chunks"), at, at); err != nil {
		t.Fatal(err)
	}
}

func entryKeys(es []nodecache.Entry) string {
	var ks []string
	for _, e := range es {
		ks = append(ks, e.Key)
	}
	return strings.Join(ks, ",")
}

// TestNodeCachePrune: the disk tier lists a layer per entry with its
// allocated blocks; a prune removes the least recently used layer first
// and keeps a layer a Store has open, in this process or another, even
// over budget; a layer whose Store is gone (closed, or its process
// killed) goes; a Store that had a removed layer open reads on.
func TestNodeCachePrune(t *testing.T) {
	dir := t.TempDir()
	ls := []*testLayer{nodeLayer(t, 31), nodeLayer(t, 32), nodeLayer(t, 33), nodeLayer(t, 34)}
	hex := func(i int) string { return ls[i].ix.Digest[7:] }
	day := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i, l := range ls {
		fillLayer(t, dir, l, day.Add(time.Duration(i)*time.Hour))
	}
	c := NodeCache(dir)
	ctx := context.Background()
	es, err := c.Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 4 {
		t.Fatalf("%d entries, want 4", len(es))
	}
	var total int64
	for _, e := range es {
		want := allocated(t, filepath.Join(dir, "layers", e.Key+".data")) + allocated(t, filepath.Join(dir, "layers", e.Key+".chunks"))
		if e.Bytes != want || e.InUse || e.Note != "layer sha256:"+e.Key {
			t.Fatalf("entry %+v, want %d bytes, not in use", e, want)
		}
		total += e.Bytes
	}
	// Layer 1 open in this process (it was least recently used before,
	// and opening it stamps it used now), layer 2 in another.
	s := openStore(t, Options{Dir: dir})
	r1 := layerReader(t, s, ls[1], newFake(ls[1].blob))
	holder := helperproc.Start(t, "TestNodeCacheHelper", "held", cacheHelperEnv+"="+fmt.Sprintf("hold %s 33", dir))
	es, _ = c.Entries(ctx)
	for _, e := range es {
		if e.InUse != (e.Key == hex(1) || e.Key == hex(2)) {
			t.Fatalf("entry %s in use %v", e.Key, e.InUse)
		}
	}
	if err := c.Remove(ctx, hex(2)); !errors.Is(err, nodecache.ErrInUse) {
		t.Fatalf("Remove of a layer another process has open: %v, want ErrInUse", err)
	}
	total = 0
	var oldest int64
	for _, e := range es {
		total += e.Bytes
		if e.Key == hex(0) {
			oldest = e.Bytes
		}
	}
	budget := total - oldest // what layer 0, the oldest, frees
	r, err := nodecache.Prune(ctx, c, budget, nodecache.PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if entryKeys(r.Removed) != hex(0) || r.OverBudget() {
		t.Fatalf("removed %s, want the oldest layer %s alone", entryKeys(r.Removed), hex(0))
	}
	r, err = nodecache.Prune(ctx, c, 0, nodecache.PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if entryKeys(r.Removed) != hex(3) || !r.OverBudget() || len(r.KeptInUse) != 2 {
		t.Fatalf("removed %s kept %s: want %s removed, the two open layers kept", entryKeys(r.Removed), entryKeys(r.KeptInUse), hex(3))
	}
	checkRead(t, r1, ls[1].tar, 0, len(ls[1].tar))
	helperproc.Kill(t, holder)
	if err := c.Remove(ctx, hex(2)); err != nil {
		t.Fatalf("Remove once its process was killed: %v", err)
	}
	if err := c.Remove(ctx, hex(1)); !errors.Is(err, nodecache.ErrInUse) {
		t.Fatalf("Remove of a layer this process has open: %v, want ErrInUse", err)
	}
	s.Close()
	if err := c.Remove(ctx, hex(1)); err != nil {
		t.Fatalf("Remove once its Store closed: %v", err)
	}
	if es, _ := c.Entries(ctx); len(es) != 0 {
		t.Fatalf("left %s", entryKeys(es))
	}
}

// TestNodeCachePruneKilled: a prune killed between the two unlinks of a
// layer leaves that layer's data file with no chunk map, which a Store
// reopens clean (every chunk fetched again and verified, none served from
// the orphan), and every other layer whole (served from disk without a
// fetch); the next prune removes the orphan.
func TestNodeCachePruneKilled(t *testing.T) {
	dir := t.TempDir()
	ls := []*testLayer{nodeLayer(t, 41), nodeLayer(t, 42)}
	day := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i, l := range ls {
		fillLayer(t, dir, l, day.Add(time.Duration(i)*time.Hour))
	}
	// Damage what the orphan keeps, so that serving from it would show.
	base0 := filepath.Join(dir, "layers", ls[0].ix.Digest[7:])
	f, err := os.OpenFile(base0+".data", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	cmd := helperproc.Start(t, "TestNodeCacheHelper", "helperproc: paused at content-remove", cacheHelperEnv+"=prune "+dir)
	helperproc.Kill(t, cmd)
	gone(t, base0+".chunks")
	if _, err := os.Stat(base0 + ".data"); err != nil {
		t.Fatalf("the kill came before the data file's unlink, yet: %v", err)
	}
	es, err := NodeCache(dir).Entries(context.Background())
	if err != nil || len(es) != 2 || !strings.Contains(es[0].Note+es[1].Note, "data file only") {
		t.Fatalf("entries after the kill: %+v %v", es, err)
	}
	// The untouched layer: whole, from disk.
	fk := newFake(ls[1].blob)
	s := openStore(t, Options{Dir: dir})
	checkRead(t, layerReader(t, s, ls[1], fk), ls[1].tar, 0, len(ls[1].tar))
	if fk.requests.Load() != 0 {
		t.Fatalf("the layer the prune did not reach was fetched again (%d requests)", fk.requests.Load())
	}
	// The torn one: reopens clean.
	fk0 := newFake(ls[0].blob)
	checkRead(t, layerReader(t, s, ls[0], fk0), ls[0].tar, 0, len(ls[0].tar))
	if fk0.requests.Load() == 0 {
		t.Fatal("the layer whose chunk map was removed was served without a fetch")
	}
	s.Close()
	if r, err := nodecache.Prune(context.Background(), NodeCache(dir), 0, nodecache.PruneOptions{}); err != nil || len(r.Removed) != 2 {
		t.Fatalf("prune after: removed %s, %v", entryKeys(r.Removed), err)
	}
	des, _ := os.ReadDir(filepath.Join(dir, "layers"))
	if len(des) != 0 {
		t.Fatalf("%d files left in the layers directory", len(des))
	}
}

// TestNodeCacheOrphanData: a data file left with no chunk map is an entry
// (its blocks count) that Remove deletes.
func TestNodeCacheOrphanData(t *testing.T) {
	dir := t.TempDir()
	l := nodeLayer(t, 51)
	fillLayer(t, dir, l, time.Now())
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	if err := os.Remove(base + ".chunks"); err != nil {
		t.Fatal(err)
	}
	c := NodeCache(dir)
	es, err := c.Entries(context.Background())
	if err != nil || len(es) != 1 || es[0].Bytes != allocated(t, base+".data") || es[0].InUse {
		t.Fatalf("entries %+v %v", es, err)
	}
	if err := c.Remove(context.Background(), es[0].Key); err != nil {
		t.Fatal(err)
	}
	gone(t, base+".data")
	if err := c.Remove(context.Background(), "../../etc"); err == nil {
		t.Fatal("Remove of a bad key succeeded")
	}
}

// TestNodeCacheRemoveEndsWithContext: a prune's removal waiting for a
// layer's header lock (held by a Store opening the layer, or by another
// removal waiting for a fetch) gives up when the prune's context ends.
func TestNodeCacheRemoveEndsWithContext(t *testing.T) {
	dir := t.TempDir()
	l := nodeLayer(t, 41)
	fillLayer(t, dir, l, time.Now())
	holdHeader(t, filepath.Join(dir, "layers", l.ix.Digest[7:]+".chunks"))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := NodeCache(dir).Remove(ctx, l.ix.Digest[7:])
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("removal under a cancelled context while the header lock is held: %v, want context.Canceled", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "layers", l.ix.Digest[7:]+".data")); err != nil {
		t.Fatalf("the layer's data file after a removal that gave up: %v", err)
	}
}
