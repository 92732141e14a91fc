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
	deadline := time.Now().Add(5 * time.Second)
	for openCount(t, base+".chunks") < 3 {
		if time.Now().After(deadline) {
			t.Fatal("the second store never opened the chunk map")
		}
		time.Sleep(5 * time.Millisecond)
	}
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
