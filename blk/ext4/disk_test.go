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
			}
		}(int64(g))
	}
	wg.Wait()
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
}
