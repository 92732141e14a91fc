package ext4

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// syntheticIndex is n small files spread over dirs directories, with sizes
// drawn from a container-image-like mix (most under 16 KiB, some larger).
func syntheticIndex(n, dirs int) *index.Index {
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:00"}}}
	idx.Entries = append(idx.Entries, index.Entry{Path: ".", Type: index.TypeDir, Mode: 0o755})
	for d := 0; d < dirs; d++ {
		idx.Entries = append(idx.Entries, index.Entry{Path: fmt.Sprintf("dir%04d", d), Type: index.TypeDir, Mode: 0o755})
	}
	sizes := []int64{300, 1200, 2500, 4096, 7000, 12000, 30000, 90000}
	var off int64
	for i := 0; i < n; i++ {
		size := sizes[i%len(sizes)] + int64(i%97)
		idx.Entries = append(idx.Entries, index.Entry{
			Path: fmt.Sprintf("dir%04d/file-%06d.txt", i%dirs, i), Type: index.TypeRegular, Mode: 0o644,
			UID: 1000, GID: 1000, Size: size, Mtime: index.Timespec{Sec: 1700000000 + int64(i), Nsec: uint32(i)},
			Data: index.Data{Source: 0, Offset: off},
		})
		off += size + 512
	}
	return idx
}

func BenchmarkBuild100k(b *testing.B) {
	idx := syntheticIndex(100000, 1000)
	var data int64
	for i := range idx.Entries {
		data += idx.Entries[i].Size
	}
	b.ResetTimer()
	var img *Image
	for i := 0; i < b.N; i++ {
		var err error
		img, err = Build(context.Background(), idx, Options{Time: time.Unix(1700000000, 0)})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(img.Manifest.MetaBytes), "meta-bytes")
	b.ReportMetric(100*float64(img.Manifest.MetaBytes)/float64(data), "meta-%-of-data")
	b.ReportMetric(float64(data), "data-bytes")
}
