package hostfs

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

func writeBlob(t *testing.T, cache string, fill byte) index.Source {
	t.Helper()
	id := "sha256:" + strings.Repeat(string([]byte{"0123456789abcdef"[fill&15]}), 64)
	p, err := index.BlobPath(cache, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, bytes.Repeat([]byte{fill}, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	return index.Source{Kind: index.SourceBlob, ID: id}
}

func inUse(t *testing.T, c nodecache.Cache) map[string]bool {
	t.Helper()
	es, err := c.Entries(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]bool{}
	for _, e := range es {
		m[e.Key] = e.InUse
	}
	return m
}

// TestBlobsInUse: a blob the Opener serves, and every blob HoldBlobs
// holds, is in use for the blob cache: a prune keeps it and the reader
// keeps reading; closed or released, it goes, and a later open fails
// rather than serve something else.
func TestBlobsInUse(t *testing.T) {
	cache := t.TempDir()
	a, b := writeBlob(t, cache, 1), writeBlob(t, cache, 2)
	hex := func(s index.Source) string { return s.ID[7:] }
	c := BlobCache(cache)
	op := Opener{CacheDir: cache}
	r, err := op.Open(a, "")
	if err != nil {
		t.Fatal(err)
	}
	if m := inUse(t, c); !m[hex(a)] || m[hex(b)] || len(m) != 2 {
		t.Fatalf("in use %v, want the served blob alone", m)
	}
	res, err := nodecache.Prune(context.Background(), c, 0, nodecache.PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Removed) != 1 || res.Removed[0].Key != hex(b) || len(res.KeptInUse) != 1 || !res.OverBudget() {
		t.Fatalf("prune: %s", res.Summary())
	}
	got := make([]byte, 8192)
	if _, err := r.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{1}, 8192)) {
		t.Fatalf("the served blob after the prune: %v", err)
	}
	r.(io.Closer).Close()
	if _, err := op.Open(b, ""); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("open of a pruned blob: %v, want not exist", err)
	}

	b = writeBlob(t, cache, 2)
	missing := index.Source{Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("f", 64)}
	release, err := HoldBlobs(cache, []index.Source{a, b, missing, {Kind: index.SourceDir, ID: "/"}})
	if err == nil || !strings.Contains(err.Error(), missing.ID) {
		t.Fatalf("HoldBlobs with a missing blob: %v, want it named", err)
	}
	if m := inUse(t, c); !m[hex(a)] || !m[hex(b)] {
		t.Fatalf("in use %v, want both held", m)
	}
	if err := c.Remove(context.Background(), hex(b)); !errors.Is(err, nodecache.ErrInUse) {
		t.Fatalf("Remove of a held blob: %v", err)
	}
	release()
	if res, err := nodecache.Prune(context.Background(), c, 0, nodecache.PruneOptions{}); err != nil || len(res.Removed) != 2 {
		t.Fatalf("prune after release: %s %v", res.Summary(), err)
	}
}
