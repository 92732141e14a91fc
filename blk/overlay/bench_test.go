package overlay

import (
	"bytes"
	"io"
	"path/filepath"
	"testing"
)

// zeroBase is a base device of zeros that costs nothing to read.
type zeroBase struct{}

func (zeroBase) ReadAt(p []byte, off int64) (int, error) {
	clear(p)
	return len(p), nil
}

var _ io.ReaderAt = zeroBase{}

// BenchmarkWrite1M writes 1 MiB requests arriving as 256 page-aligned 4 KiB
// buffers (a guest's scattered pages) over a 256 MiB overlay, flushing every
// 256 MiB: per buffer with WriteAt (the old request path) or in one
// WriteVecAt, buffered or with O_DIRECT.
func BenchmarkWrite1M(b *testing.B) {
	const size, req, seg = 256 << 20, 1 << 20, 4096
	for _, c := range []struct {
		name     string
		vec      bool
		buffered bool
	}{{"WriteAt-per-page/buffered", false, true}, {"WriteVecAt/buffered", true, true}, {"WriteVecAt/direct", true, false}} {
		b.Run(c.name, func(b *testing.B) {
			d, err := Open(zeroBase{}, size, filepath.Join(b.TempDir(), "ov"), Options{BufferedOnly: c.buffered})
			if err != nil {
				b.Fatal(err)
			}
			defer d.Close()
			segs, err := alignedBufs(req/seg, seg)
			if err != nil {
				b.Fatal(err)
			}
			for i, s := range segs {
				copy(s, bytes.Repeat([]byte{byte(i)}, seg))
			}
			b.SetBytes(req)
			b.ResetTimer()
			off := int64(0)
			for range b.N {
				if c.vec {
					if _, err := d.WriteVecAt(segs, off); err != nil {
						b.Fatal(err)
					}
				} else {
					for k, s := range segs {
						if _, err := d.WriteAt(s, off+int64(k*seg)); err != nil {
							b.Fatal(err)
						}
					}
				}
				off += req
				if off == size {
					off = 0
					if err := d.Flush(); err != nil {
						b.Fatal(err)
					}
				}
			}
			if err := d.Flush(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(d.directWrites.Load())/float64(b.N), "direct/op")
		})
	}
}
