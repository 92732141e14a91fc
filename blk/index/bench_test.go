package index

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// genFlat writes n entries: 1 in 50 a directory, the rest small files,
// some with an xattr, in directories of 50.
func genFlat(b testing.TB, root string, n int) {
	b.Helper()
	dir := root
	for i := 0; i < n; i++ {
		if i%50 == 0 {
			dir = filepath.Join(root, fmt.Sprintf("d%04d", i/50))
			must(b, os.Mkdir(dir, 0o755))
			continue
		}
		p := filepath.Join(dir, fmt.Sprintf("file-%06d.txt", i))
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o644)
		must(b, err)
		if i%3 == 0 {
			_, err = f.Write([]byte("data"))
			must(b, err)
		}
		must(b, f.Close())
		if i%10 == 0 {
			must(b, unix.Setxattr(p, "user.k", []byte("v"), 0))
		}
	}
}

func BenchmarkFromDir100k(b *testing.B) {
	root := b.TempDir()
	genFlat(b, root, 100000)
	b.ReportAllocs()
	var n int
	for b.Loop() {
		ix, err := FromDir(context.Background(), root, Options{})
		if err != nil {
			b.Fatal(err)
		}
		n = len(ix.Entries)
	}
	b.ReportMetric(float64(n), "entries")
}

// BenchmarkFromLayersCached100k is the second pod on a 100k-entry layer:
// decode the cached index and merge.
func BenchmarkFromLayersCached100k(b *testing.B) {
	root := b.TempDir()
	genFlat(b, root, 100000)
	opts := Options{CacheDir: b.TempDir()}
	if _, err := FromLayers(context.Background(), []string{root}, opts); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		var st Stats
		opts.Stats = &st
		if _, err := FromLayers(context.Background(), []string{root}, opts); err != nil {
			b.Fatal(err)
		}
		if st.LayersCached != 1 {
			b.Fatalf("not cached: %+v", st)
		}
	}
}
