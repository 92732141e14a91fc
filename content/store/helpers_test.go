package store

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
)

// testFile is one regular file of a test layer and where its bytes sit in
// the uncompressed tar.
type testFile struct {
	name string
	data []byte
	off  int64
}

// testLayer is a layer as the store sees it: the stored blob, its index
// and the uncompressed tar a plain reading gives.
type testLayer struct {
	tar   []byte
	blob  []byte
	ix    *lazyindex.Index
	files []testFile
}

// randomTar writes a tar of n files of random sizes up to maxSize; half
// the files are random bytes, half compressible text, so that gzip levels
// differ.
func randomTar(t testing.TB, rng *rand.Rand, n, maxSize int) ([]byte, []testFile) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	var files []testFile
	for i := 0; i < n; i++ {
		data := make([]byte, rng.IntN(maxSize)+1)
		if i%2 == 0 {
			for j := range data {
				data[j] = byte(rng.Uint32())
			}
		} else {
			words := []string{"kata ", "lazy ", "chunk ", "span\n", "layer "}
			var sb strings.Builder
			for sb.Len() < len(data) {
				sb.WriteString(words[rng.IntN(len(words))])
			}
			copy(data, sb.String())
		}
		name := fmt.Sprintf("dir/f%03d", i)
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
		files = append(files, testFile{name: name, data: data})
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), files
}

func gzipBytes(t testing.TB, b []byte, level int) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := gzip.NewWriterLevel(&buf, level)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// level -1 means a plain tar layer; otherwise a gzip level.
func makeLayer(t testing.TB, rng *rand.Rand, level, nfiles, maxSize int, chunk, span int64) *testLayer {
	t.Helper()
	tb, files := randomTar(t, rng, nfiles, maxSize)
	return indexLayer(t, tb, files, level, chunk, span)
}

func indexLayer(t testing.TB, tb []byte, files []testFile, level int, chunk, span int64) *testLayer {
	t.Helper()
	blob := tb
	if level >= 0 {
		blob = gzipBytes(t, tb, level)
	}
	ix, err := lazyindex.Build(context.Background(), bytes.NewReader(blob), lazyindex.Options{ChunkSize: chunk, Span: span, Layer: "test"})
	if err != nil {
		t.Fatal(err)
	}
	l := &testLayer{tar: tb, blob: blob, ix: ix}
	for _, f := range files {
		i := ix.Tree.Lookup(f.name)
		if i < 0 {
			t.Fatalf("%s not in the index", f.name)
		}
		f.off = ix.Tree.Entries[i].Data.Offset
		if !bytes.Equal(tb[f.off:f.off+int64(len(f.data))], f.data) {
			t.Fatalf("index offset %d of %s is wrong", f.off, f.name)
		}
		l.files = append(l.files, f)
	}
	return l
}

// fakeFetcher serves a blob from memory, as a registry would, counting
// requests; fail makes requests fail, corrupt flips a byte of what it
// returns, gate (when set) holds every request until it is closed.
type fakeFetcher struct {
	blob     []byte
	requests atomic.Int64
	bytes    atomic.Int64
	fail     atomic.Int64 // requests left to fail; <0: all
	corrupt  atomic.Int64 // blob offset to flip in answers, -1: none
	mu       sync.Mutex
	gate     chan struct{}
}

func newFake(blob []byte) *fakeFetcher {
	f := &fakeFetcher{blob: blob}
	f.corrupt.Store(-1)
	return f
}

var errFakeDown = errors.New("fake registry down")

func (f *fakeFetcher) FetchRange(ctx context.Context, p []byte, off int64) error {
	f.requests.Add(1)
	f.mu.Lock()
	gate := f.gate
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if n := f.fail.Load(); n != 0 {
		if n > 0 {
			f.fail.Add(-1)
		}
		return errFakeDown
	}
	if off < 0 || off+int64(len(p)) > int64(len(f.blob)) {
		return fmt.Errorf("range [%d, %d) outside blob of %d", off, off+int64(len(p)), len(f.blob))
	}
	copy(p, f.blob[off:])
	if c := f.corrupt.Load(); c >= off && c < off+int64(len(p)) {
		p[c-off] ^= 0xff
	}
	f.bytes.Add(int64(len(p)))
	return nil
}

func (f *fakeFetcher) setGate(g chan struct{}) {
	f.mu.Lock()
	f.gate = g
	f.mu.Unlock()
}

// logBuf collects a Store's log lines.
type logBuf struct {
	mu    sync.Mutex
	lines []string
}

func (b *logBuf) logf(format string, args ...any) {
	b.mu.Lock()
	b.lines = append(b.lines, fmt.Sprintf(format, args...))
	b.mu.Unlock()
}

func (b *logBuf) matching(sub string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, l := range b.lines {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return out
}

func openStore(t testing.TB, opts Options) *Store {
	t.Helper()
	s, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// layerReader adds l to s with f and opens it through the Opener as the
// block device does.
func layerReader(t testing.TB, s *Store, l *testLayer, f Fetcher) interface {
	ReadAt([]byte, int64) (int, error)
} {
	t.Helper()
	if err := s.AddLayer(l.ix, f); err != nil {
		t.Fatal(err)
	}
	r, err := s.Opener(nil).Open(index.Source{Kind: index.SourceBlob, ID: l.ix.DiffID}, "")
	if err != nil {
		t.Fatal(err)
	}
	return r
}
