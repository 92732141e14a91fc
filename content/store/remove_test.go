package store

import (
	"context"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func allocated(t *testing.T, p string) int64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Blocks * 512
}

func gone(t *testing.T, ps ...string) {
	t.Helper()
	for _, p := range ps {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s after RemoveLayer: %v, want it gone", p, err)
		}
	}
}

// TestRemoveLayer: the layer's files go; a Store that had them open reads
// on from its unlinked files; a new Store fetches the layer again.
func TestRemoveLayer(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 21))
	l := makeLayer(t, rng, 6, 6, 200*kib, 64*kib, 64*kib)
	dir := t.TempDir()
	s1 := openStore(t, Options{Dir: dir})
	r1 := layerReader(t, s1, l, newFake(l.blob))
	checkRead(t, r1, l.tar, 0, len(l.tar))
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	if n := allocated(t, base+".data"); n == 0 {
		t.Fatal("no bytes on disk after reading the whole layer")
	}
	if err := RemoveLayer(dir, digest.Digest(l.ix.Digest)); err != nil {
		t.Fatal(err)
	}
	gone(t, base+".data", base+".chunks")
	checkRead(t, r1, l.tar, 0, len(l.tar))

	fk := newFake(l.blob)
	s2 := openStore(t, Options{Dir: dir})
	r2 := layerReader(t, s2, l, fk)
	checkRead(t, r2, l.tar, 0, len(l.tar))
	if fk.requests.Load() == 0 {
		t.Fatal("a new store read the removed layer without fetching it")
	}
	if err := RemoveLayer(dir, digest.Digest("sha256:"+l.ix.Digest[7:17])); err == nil {
		t.Fatal("RemoveLayer of a malformed digest succeeded")
	}
	if err := RemoveLayer(dir, digest.FromString("never added")); err != nil {
		t.Fatalf("RemoveLayer of a layer with no files: %v", err)
	}
}

// TestRemoveLayerWaitsForFetch: a fetch (of another process) holding its
// chunks' lock keeps the files until it is done.
func TestRemoveLayerWaitsForFetch(t *testing.T) {
	rng := rand.New(rand.NewPCG(22, 22))
	l := makeLayer(t, rng, -1, 4, 300*kib, 64*kib, 0)
	dir := t.TempDir()
	s := openStore(t, Options{Dir: dir})
	layerReader(t, s, l, newFake(l.blob))
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	other, err := os.OpenFile(base+".data", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	start, end := l.ix.ChunkRange(1)
	unlock, err := lockRange(context.Background(), other, start, end-start)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- RemoveLayer(dir, digest.Digest(l.ix.Digest)) }()
	select {
	case err := <-done:
		t.Fatalf("RemoveLayer returned (%v) while a fetch held chunk 1", err)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := os.Stat(base + ".chunks"); err != nil {
		t.Fatalf("chunk map removed while a fetch held the data file: %v", err)
	}
	unlock()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	gone(t, base+".data", base+".chunks")
}

// TestOpenDuringRemove: a Store that opened a layer's files just before
// RemoveLayer unlinked them opens the new ones, never a removed data file
// with a new chunk map.
func TestOpenDuringRemove(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 23))
	l := makeLayer(t, rng, -1, 4, 300*kib, 64*kib, 0)
	dir := t.TempDir()
	s1 := openStore(t, Options{Dir: dir})
	layerReader(t, s1, l, newFake(l.blob))
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	// Hold the header lock as RemoveLayer does while it unlinks.
	cmap, err := os.OpenFile(base+".chunks", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cmap.Close()
	unlock, err := lockRange(context.Background(), cmap, 0, mapHeaderSize)
	if err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, Options{Dir: dir})
	added := make(chan error, 1)
	go func() { added <- s2.AddLayer(l.ix, newFake(l.blob)) }()
	// Wait until s2 has the files open (s1's two, ours, and s2's).
	testenv.Eventually(t, 5*time.Second, func() (bool, error) {
		return openCount(t, base+".chunks") >= 3, errors.New("the second store never opened the chunk map")
	})
	for _, p := range []string{base + ".chunks", base + ".data"} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	unlock()
	if err := <-added; err != nil {
		t.Fatal(err)
	}
	s2.mu.Lock()
	l2 := s2.layers[l.ix.DiffID]
	s2.mu.Unlock()
	if l2.data == nil || unlinked(l2.data) || unlinked(l2.cmap) {
		t.Fatal("the second store kept the removed files")
	}
	for _, p := range []string{base + ".chunks", base + ".data"} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("the second store did not create %s anew: %v", p, err)
		}
	}
}

// openCount counts this process's descriptors open on p.
func openCount(t *testing.T, p string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && target == p {
			n++
		}
	}
	return n
}

// TestAddLayerWaitsAlone: a Store adding a layer whose chunk map another
// process holds locked (a RemoveLayer waiting for a fetch, a Store
// initialising the map) waits for that lock alone: reads of its other
// layers go on meanwhile, and the new layer gets the node cache once the
// lock is free rather than giving up on it.
func TestAddLayerWaitsAlone(t *testing.T) {
	rng := rand.New(rand.NewPCG(24, 24))
	a := makeLayer(t, rng, -1, 4, 200*kib, 64*kib, 0)
	b := makeLayer(t, rng, -1, 4, 200*kib, 64*kib, 0)
	dir := t.TempDir()
	s := openStore(t, Options{Dir: dir})
	ra := layerReader(t, s, a, newFake(a.blob))
	base := filepath.Join(dir, "layers", b.ix.Digest[7:])
	cmap := holdHeader(t, base+".chunks")
	added := make(chan error, 1)
	go func() { added <- s.AddLayer(b.ix, newFake(b.blob)) }()
	// The Store opens the chunk map just before it waits for its lock.
	waitOpen(t, base+".chunks", 2)
	checkRead(t, ra, a.tar, 0, len(a.tar))
	select {
	case err := <-added:
		t.Fatalf("AddLayer returned (%v) while the chunk map's lock was held; the read of another layer waited for it", err)
	default:
	}
	cmap.Close()
	if err := <-added; err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	lb := s.layers[b.ix.DiffID]
	s.mu.Unlock()
	if !lb.onDisk() {
		t.Fatal("AddLayer gave up on the node cache while another process held the chunk map's lock")
	}
	checkRead(t, layerReader(t, s, b, newFake(b.blob)), b.tar, 0, len(b.tar))
}

// TestAddLayerTwiceAtOnce: two AddLayers of one layer that both opened its
// files (both waited for the chunk map's lock) register it once, and the
// one that lost leaves none of its files open.
func TestAddLayerTwiceAtOnce(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 25))
	l := makeLayer(t, rng, -1, 4, 200*kib, 64*kib, 0)
	dir := t.TempDir()
	s := openStore(t, Options{Dir: dir})
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	cmap := holdHeader(t, base+".chunks")
	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- s.AddLayer(l.ix, newFake(l.blob)) }()
	}
	waitOpen(t, base+".chunks", 3)
	cmap.Close() // lets both go on
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{base + ".chunks", base + ".data"} {
		if n := openCount(t, p); n != 1 {
			t.Fatalf("%s open %d times after two AddLayers of its layer, want once", p, n)
		}
	}
	s.mu.Lock()
	n := len(s.order)
	s.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d layers registered, want 1", n)
	}
	checkRead(t, layerReader(t, s, l, newFake(l.blob)), l.tar, 0, len(l.tar))
}

// holdHeader opens the chunk map p (created if need be) and locks its
// header as another process's Store or RemoveLayer would; closing the file
// unlocks it.
func holdHeader(t *testing.T, p string) *os.File {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if _, err := lockRange(context.Background(), f, 0, mapHeaderSize); err != nil {
		t.Fatal(err)
	}
	return f
}

// waitOpen waits until this process has p open n times; the bound only
// turns a hang into a failure.
func waitOpen(t *testing.T, p string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for openCount(t, p) < n {
		select {
		case <-ctx.Done():
			t.Fatalf("%s never open %d times", p, n)
		case <-time.After(time.Millisecond):
		}
	}
}
