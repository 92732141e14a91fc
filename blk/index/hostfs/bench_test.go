package hostfs

import (
	"context"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
)

func BenchmarkFromDir100k(b *testing.B) {
	root := b.TempDir()
	indextest.GenFlat(b, root, 100000)
	b.ReportAllocs()
	var n int
	for b.Loop() {
		ix, err := FromDir(context.Background(), root, index.Options{})
		if err != nil {
			b.Fatal(err)
		}
		n = len(ix.Entries)
	}
	b.ReportMetric(float64(n), "entries")
}
