package ext4

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// TestDiskReadAt compares random, concurrent reads through Disk with the
// exported raw image, and checks a source that shrank after indexing is an
// error rather than silent zeros.
func TestDiskReadAt(t *testing.T) {
	src := t.TempDir()
	for i, n := range []int{1, 4095, 4097, 100000, 300000} {
		b := make([]byte, n)
		rand.New(rand.NewSource(int64(i))).Read(b)
		writeFile(t, filepath.Join(src, "d", string(rune('a'+i))), b, 0o644)
	}
	idx := indexDir(t, src)
	img, raw := buildExport(t, idx, Options{Time: time.Unix(testTime, 0), WritableSize: 8 << 20}, t.TempDir())
	want, err := os.ReadFile(raw)
	must(t, err)
	d := NewDisk(img, dirOpener{})
	defer d.Close()
	dn := NewDisk(img, noFdOpener{})
	defer dn.Close()
	if d.Size() != int64(len(want)) {
		t.Fatalf("Size %d, raw %d", d.Size(), len(want))
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed))
			for i := 0; i < 300; i++ {
				// Bias reads toward the populated front of the disk.
				off := rng.Int63n(int64(len(want)) / int64(1+rng.Intn(64)))
				n := 1 + rng.Intn(3*4096)
				got := make([]byte, n)
				k, err := d.ReadAt(got, off)
				end := min(off+int64(n), int64(len(want)))
				if k != int(end-off) || (err != nil && err != io.EOF) {
					t.Errorf("ReadAt(%d, %d) = %d, %v", off, n, k, err)
					return
				}
				if !bytes.Equal(got[:k], want[off:end]) {
					t.Errorf("ReadAt(%d, %d) differs from the export", off, n)
					return
				}
				// The same bytes through ReadVecAt, split into buffers
				// as a guest's pages would be (empty ones included), on
				// the preadv path and on the ReadAt fallback.
				k = int(end - off)
				vec := randomSplit(rng, k)
				dv := d
				if i%2 == 1 {
					dv = dn
				}
				if m, err := dv.ReadVecAt(vec, off); m != k || err != nil {
					t.Errorf("ReadVecAt(%d, %d in %d buffers) = %d, %v", off, k, len(vec), m, err)
					return
				}
				if got := bytes.Join(vec, nil); !bytes.Equal(got, want[off:end]) {
					t.Errorf("ReadVecAt(%d, %d in %d buffers) differs from the export", off, k, len(vec))
					return
				}
			}
		}(int64(g))
	}
	wg.Wait()
	if _, err := d.ReadVecAt([][]byte{make([]byte, 10)}, d.Size()); err != io.EOF {
		t.Errorf("vectored read at end: %v, want EOF", err)
	}
	if _, err := d.ReadAt(make([]byte, 10), d.Size()); err != io.EOF {
		t.Errorf("read at end: %v, want EOF", err)
	}
	must(t, os.Truncate(filepath.Join(src, "d", "e"), 10))
	out, err := os.Create(filepath.Join(t.TempDir(), "again"))
	must(t, err)
	defer out.Close()
	if err := Export(context.Background(), img, dirOpener{}, out); !errors.Is(err, ErrShortSource) {
		t.Fatalf("export over a shrunken source: %v, want ErrShortSource", err)
	}
	for _, o := range []index.Opener{dirOpener{}, noFdOpener{}} {
		dd := NewDisk(img, o)
		whole := randomSplit(rand.New(rand.NewSource(9)), int(dd.Size()))
		if _, err := dd.ReadVecAt(whole, 0); !errors.Is(err, ErrShortSource) {
			t.Errorf("vectored read over a shrunken source (%T): %v, want ErrShortSource", o, err)
		}
		dd.Close()
	}
}

// randomSplit returns n zeroed bytes as buffers of random sizes, some empty.
func randomSplit(rng *rand.Rand, n int) [][]byte {
	var out [][]byte
	for n > 0 {
		m := min(n, rng.Intn(3*4096))
		out = append(out, make([]byte, m))
		n -= m
	}
	return out
}

// noFdOpener opens like dirOpener but hides the file behind a plain
// io.ReaderAt, as a reader that is not a file (a remote tier) would be.
type noFdOpener struct{}

func (noFdOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	r, err := dirOpener{}.Open(src, path)
	if err != nil {
		return nil, err
	}
	return readerOnly{r}, nil
}

type readerOnly struct{ io.ReaderAt }

func (r readerOnly) Close() error { return r.ReaderAt.(io.Closer).Close() }
