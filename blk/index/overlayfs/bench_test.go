package overlayfs

import (
	"context"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
)

// BenchmarkFromLayersCached100k is the second pod on a 100k-entry layer:
// decode the cached index and merge. The layer carries a key, as a
// committed snapshot would: unkeyed layers are never cached.
func BenchmarkFromLayersCached100k(b *testing.B) {
	root := b.TempDir()
	indextest.GenFlat(b, root, 100000)
	opts := index.Options{CacheDir: b.TempDir(), LayerKeys: []string{"snapshot-1"}}
	if _, err := FromLayers(context.Background(), []string{root}, opts); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		var st index.Stats
		opts.Stats = &st
		if _, err := FromLayers(context.Background(), []string{root}, opts); err != nil {
			b.Fatal(err)
		}
		if st.LayersCached != 1 {
			b.Fatalf("not cached: %+v", st)
		}
	}
}
