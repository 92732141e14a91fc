package rawimage_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/rawimage"
	"golang.org/x/sys/unix"
)

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// blobImage builds an image whose files, one of them sparse, all live in
// one random blob written to dir; it returns the image and the blob.
func blobImage(t *testing.T, dir string) (*ext4.Image, []byte) {
	t.Helper()
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:blob"}},
		Entries: []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}, {Path: "d", Type: index.TypeDir, Mode: 0o755}}}
	var off int64
	for i, n := range []int64{1, 4095, 4097, 100000, 300000} {
		idx.Entries = append(idx.Entries, index.Entry{Path: fmt.Sprintf("d/%c", 'a'+i), Type: index.TypeRegular, Mode: 0o644,
			Size: n, Data: index.Data{Offset: off}})
		off += n + 100
	}
	idx.Entries = append(idx.Entries, index.Entry{Path: "d/sparse", Type: index.TypeRegular, Mode: 0o644, Size: 1 << 20,
		Data: index.Data{Offset: off, Segments: []index.Range{{Off: 10, Len: 5000}, {Off: 500000, Len: 70000}}}})
	off += 1 << 20
	blob := make([]byte, off)
	rand.New(rand.NewSource(1)).Read(blob)
	must(t, os.WriteFile(filepath.Join(dir, "blob"), blob, 0o644))
	img, err := ext4.Build(context.Background(), idx, ext4.Options{Time: time.Unix(1700000000, 0), WritableSize: 8 << 20})
	must(t, err)
	return img, blob
}

// expected assembles the raw disk from the block map directly: metadata
// bytes, blob bytes for the valid part of data extents, zeros elsewhere.
func expected(t *testing.T, img *ext4.Image, blob []byte) []byte {
	t.Helper()
	m := img.Map
	bs := uint64(m.BlockSize())
	raw := make([]byte, m.Blocks()*bs)
	for i := 0; i < m.Len(); i++ {
		e := m.At(i)
		dst := raw[e.First*bs:][:e.Bytes]
		switch e.Kind {
		case blockmap.Meta:
			_, err := img.Meta().ReadAt(dst, e.Loc.Offset)
			must(t, err)
		case blockmap.Data:
			copy(dst, blob[e.Loc.Offset:])
		}
	}
	return raw
}

// fileOpener opens the blob file, so reads take the preadv path.
type fileOpener struct{ path string }

func (o fileOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	if src.Kind != index.SourceBlob || path != "" {
		return nil, fmt.Errorf("fileOpener: unexpected source %v %q", src, path)
	}
	return os.Open(o.path)
}

// noFdOpener hides the file behind a plain io.ReaderAt, as a reader that
// is not a file (a remote tier) would be, so reads take the ReadAt path.
type noFdOpener struct{ fileOpener }

func (o noFdOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	r, err := o.fileOpener.Open(src, path)
	if err != nil {
		return nil, err
	}
	return readerOnly{r}, nil
}

type readerOnly struct{ io.ReaderAt }

func (r readerOnly) Close() error { return r.ReaderAt.(io.Closer).Close() }

// TestReadAt compares random, concurrent reads through a Disk, plain and
// vectored, on the preadv path and the ReadAt fallback, with the disk
// assembled from the block map, and checks that a source that shrank after
// indexing is an error rather than silent zeros.
func TestReadAt(t *testing.T) {
	dir := t.TempDir()
	img, blob := blobImage(t, dir)
	want := expected(t, img, blob)
	fo := fileOpener{filepath.Join(dir, "blob")}
	d := rawimage.New(img, fo)
	defer d.Close()
	dn := rawimage.New(img, noFdOpener{fo})
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
					t.Errorf("ReadAt(%d, %d) differs from the block map's bytes", off, n)
					return
				}
				// The same bytes split into buffers as a guest's pages
				// would be (empty ones included).
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
					t.Errorf("ReadVecAt(%d, %d in %d buffers) differs from the block map's bytes", off, k, len(vec))
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
	if _, err := d.ReadAt(make([]byte, 10), -1); err == nil {
		t.Error("read at a negative offset succeeded")
	}

	// Export reads through a Disk too: same bytes, and the same error once
	// the blob has shrunk.
	out := filepath.Join(dir, "export")
	f, err := os.Create(out)
	must(t, err)
	must(t, ext4.Export(context.Background(), img, fo, f))
	must(t, f.Close())
	exported, err := os.ReadFile(out)
	must(t, err)
	if !bytes.Equal(exported, want) {
		t.Error("Export differs from the block map's bytes")
	}
	must(t, os.Truncate(fo.path, int64(len(blob))/2))
	f, err = os.Create(out)
	must(t, err)
	defer f.Close()
	if err := ext4.Export(context.Background(), img, fo, f); !errors.Is(err, rawimage.ErrShortSource) {
		t.Fatalf("export over a shrunken source: %v, want ErrShortSource", err)
	}
	for _, o := range []index.Opener{fo, noFdOpener{fo}} {
		dd := rawimage.New(img, o)
		whole := randomSplit(rand.New(rand.NewSource(9)), int(dd.Size()))
		if _, err := dd.ReadVecAt(whole, 0); !errors.Is(err, rawimage.ErrShortSource) {
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

// countingOpener serves every path of a directory source from memory and
// counts the readers open at a time.
type countingOpener struct {
	mu       sync.Mutex
	open     int
	maxOpen  int
	opens    int
	contents map[string][]byte
}

type countedReader struct {
	*bytes.Reader
	o *countingOpener
}

func (r countedReader) Close() error {
	r.o.mu.Lock()
	defer r.o.mu.Unlock()
	r.o.open--
	return nil
}

func (o *countingOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	b, ok := o.contents[path]
	if !ok {
		return nil, fmt.Errorf("no %q", path)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.open++
	o.opens++
	o.maxOpen = max(o.maxOpen, o.open)
	return countedReader{bytes.NewReader(b), o}, nil
}

// TestOpenSourceCache reads more files than a Disk keeps open: each file's
// bytes arrive, the number of open readers stays bounded, and Close closes
// every one.
func TestOpenSourceCache(t *testing.T) {
	const n = 600
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceDir, ID: "/mem"}},
		Entries: []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}}}
	o := &countingOpener{contents: make(map[string][]byte)}
	for i := 0; i < n; i++ {
		p := fmt.Sprintf("f%03d", i)
		o.contents[p] = bytes.Repeat([]byte{byte(i)}, 100+i)
		idx.Entries = append(idx.Entries, index.Entry{Path: p, Type: index.TypeRegular, Mode: 0o644,
			Size: int64(100 + i), Data: index.Data{Path: p}})
	}
	img, err := ext4.Build(context.Background(), idx, ext4.Options{WritableSize: -1, NoJournal: true})
	must(t, err)
	d := rawimage.New(img, o)
	m := img.Map
	bs := int64(m.BlockSize())
	var wg sync.WaitGroup
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < m.Len(); i++ {
				e := m.At(i)
				if e.Kind != blockmap.Data {
					continue
				}
				got := make([]byte, e.Bytes)
				if _, err := d.ReadAt(got, int64(e.First)*bs); err != nil {
					t.Errorf("read %s: %v", e.Loc.Path, err)
					return
				}
				if !bytes.Equal(got, o.contents[e.Loc.Path]) {
					t.Errorf("%s: wrong bytes", e.Loc.Path)
					return
				}
			}
		}()
	}
	wg.Wait()
	must(t, d.Close())
	if o.opens < n || o.maxOpen > 256+2 || o.open != 0 {
		t.Errorf("%d opens, at most %d open at once, %d left open after Close; want >= %d, <= 258, 0", o.opens, o.maxOpen, o.open, n)
	}
	if _, err := d.ReadAt(make([]byte, 1), 0); err != nil {
		t.Errorf("metadata read after Close: %v", err)
	}
}

// stallingOpener opens the file "stall" of a directory with a plain,
// blocking open of a FIFO, as an open stuck on a hung host file system
// would be, and every other file normally.
type stallingOpener struct {
	dir     string
	entered chan struct{} // receives once per open of "stall" begun
}

func (o stallingOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	if path == "stall" {
		o.entered <- struct{}{}
	}
	return os.Open(filepath.Join(o.dir, path))
}

// TestOpenDoesNotStallOtherReads: while the open of one content file is
// stuck, reads of every other file of the disk go on, and a second read of
// the stuck file waits for the same open rather than starting another.
// Opening under the Disk's lock made one stuck open stall every read of the
// pod.
func TestOpenDoesNotStallOtherReads(t *testing.T) {
	dir := t.TempDir()
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceDir, ID: dir}},
		Entries: []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}}}
	contents := map[string][]byte{}
	for i := 0; i < 8; i++ {
		p := fmt.Sprintf("f%d", i)
		contents[p] = bytes.Repeat([]byte{byte('a' + i)}, 5000+i)
		must(t, os.WriteFile(filepath.Join(dir, p), contents[p], 0o644))
		idx.Entries = append(idx.Entries, index.Entry{Path: p, Type: index.TypeRegular, Mode: 0o644,
			Size: int64(len(contents[p])), Data: index.Data{Path: p}})
	}
	idx.Entries = append(idx.Entries, index.Entry{Path: "stall", Type: index.TypeRegular, Mode: 0o644, Size: 10, Data: index.Data{Path: "stall"}})
	fifo := filepath.Join(dir, "stall")
	must(t, unix.Mkfifo(fifo, 0o644))
	img, err := ext4.Build(context.Background(), idx, ext4.Options{WritableSize: -1, NoJournal: true})
	must(t, err)
	o := stallingOpener{dir: dir, entered: make(chan struct{}, 4)}
	d := rawimage.New(img, o)
	bs := int64(img.Map.BlockSize())
	offset := map[string]int64{}
	for i := 0; i < img.Map.Len(); i++ {
		if e := img.Map.At(i); e.Kind == blockmap.Data {
			offset[e.Loc.Path] = int64(e.First) * bs
		}
	}
	stalled := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := d.ReadAt(make([]byte, 10), offset["stall"])
			stalled <- err
		}()
	}
	<-o.entered
	unblock := func() {
		// A writer that opens and closes at once: the stuck open returns.
		if fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
			unix.Close(fd)
		}
	}
	done := make(chan error, 1)
	go func() {
		for p, want := range contents {
			got := make([]byte, len(want))
			if _, err := d.ReadAt(got, offset[p]); err != nil {
				done <- fmt.Errorf("read %s: %w", p, err)
				return
			}
			if !bytes.Equal(got, want) {
				done <- fmt.Errorf("%s: wrong bytes", p)
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(10 * time.Second):
		unblock()
		t.Fatal("reads of other files stalled behind one stuck open")
	}
	select {
	case <-o.entered:
		unblock()
		t.Fatal("a second read of the stuck file started a second open")
	case <-time.After(200 * time.Millisecond):
	}
	// Let the stuck open finish; keep a writer trying until it has.
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
				unblock()
			}
		}
	}()
	for range 2 {
		// preadv on a FIFO fails: the read is an error, not zeros.
		if err := <-stalled; err == nil {
			t.Error("read of the FIFO once opened succeeded")
		}
	}
	close(stop)
	must(t, d.Close())
}
