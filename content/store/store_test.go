package store

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"golang.org/x/sys/unix"
)

const (
	kib = 1 << 10
	mib = 1 << 20
)

// checkRead reads [off, off+n) through r and compares it with the plain
// tar, including io.EOF at the end.
func checkRead(t testing.TB, r io.ReaderAt, tb []byte, off int64, n int) {
	t.Helper()
	p := make([]byte, n)
	got, err := r.ReadAt(p, off)
	want := tb[min(off, int64(len(tb))):min(off+int64(n), int64(len(tb)))]
	if got != len(want) || !bytes.Equal(p[:got], want) {
		t.Fatalf("ReadAt(%d bytes at %d) = %d bytes (%v), differ from the layer's %d", n, off, got, err, len(want))
	}
	if off+int64(n) > int64(len(tb)) && n > 0 {
		if err != io.EOF {
			t.Fatalf("ReadAt(%d bytes at %d) past the end: %v, want io.EOF", n, off, err)
		}
	} else if err != nil {
		t.Fatalf("ReadAt(%d bytes at %d): %v", n, off, err)
	}
}

// TestReadMatchesLayer is the read path's property: random reads of plain
// and gzip layers (several levels) give the plain tar's bytes, through a
// memory tier small enough to evict, with and without the disk tier, and
// with one too small to keep spans.
func TestReadMatchesLayer(t *testing.T) {
	for _, level := range []int{-1, 1, 6, 9} {
		for _, tier := range []string{"memory", "disk", "small"} {
			name := "plain"
			if level >= 0 {
				name = "gzip" + string(rune('0'+level))
			}
			name += "/" + tier
			t.Run(name, func(t *testing.T) {
				rng := rand.New(rand.NewPCG(uint64(level+2), 7))
				l := makeLayer(t, rng, level, 24, 200*kib, 64*kib, 64*kib)
				opts := Options{MemoryBytes: 512 * kib, MaxFetch: 256 * kib}
				switch tier {
				case "disk":
					opts.Dir = t.TempDir()
				case "small":
					// Spans larger than a quarter of the memory tier are
					// inflated up to the bytes read, not kept.
					opts.MemoryBytes = 128 * kib
				}
				s := openStore(t, opts)
				r := layerReader(t, s, l, newFake(l.blob))
				size := int64(len(l.tar))
				for i := 0; i < 300; i++ {
					off := rng.Int64N(size + 10)
					n := rng.IntN(300 * kib)
					if i%3 == 0 {
						n = rng.IntN(5000)
					}
					checkRead(t, r, l.tar, off, n)
				}
				for _, f := range l.files[:4] {
					checkRead(t, r, l.tar, f.off, len(f.data))
				}
				st := s.Stats()
				if st.MemoryBytes > opts.MemoryBytes {
					t.Fatalf("memory tier holds %d bytes, bound %d", st.MemoryBytes, opts.MemoryBytes)
				}
				if st.ReadErrors != 0 || st.VerifyFailures != 0 {
					t.Fatalf("stats %+v", st)
				}
				if tier == "small" && level >= 0 && st.SpansInflated < 300 {
					t.Fatalf("%d inflations for 304 reads with no room for spans: spans kept?", st.SpansInflated)
				}
				t.Logf("%s: tar %d, blob %d bytes: %+v", name, size, len(l.blob), st)
			})
		}
	}
}

// FuzzReadPath reads random ranges of plain and gzip layers through the
// store (a small memory tier) and compares them with the plain tar.
func FuzzReadPath(f *testing.F) {
	f.Add(uint8(0), uint64(0), uint32(1))
	f.Add(uint8(1), uint64(65535), uint32(70000))
	f.Add(uint8(2), uint64(1<<20), uint32(1))
	f.Add(uint8(2), uint64(300000), uint32(400000))
	var ls []*testLayer
	for i, level := range []int{-1, 1, 9} {
		rng := rand.New(rand.NewPCG(uint64(i), 99))
		ls = append(ls, makeLayer(f, rng, level, 8, 150*kib, 64*kib, 64*kib))
	}
	f.Fuzz(func(t *testing.T, which uint8, off uint64, n uint32) {
		l := ls[int(which)%len(ls)]
		s := openStore(t, Options{MemoryBytes: 256 * kib})
		r := layerReader(t, s, l, newFake(l.blob))
		size := uint64(len(l.tar))
		o := int64(off % (size + 100))
		checkRead(t, r, l.tar, o, int(n%(512*kib)))
		checkRead(t, r, l.tar, max(o-1000, 0), 4096)
	})
}

// TestSpanInflatedOnce: consecutive small reads of one span inflate it
// once (the span cache), and the chunks are fetched once.
func TestSpanInflatedOnce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	l := makeLayer(t, rng, 6, 6, 400*kib, 64*kib, 256*kib)
	if len(l.ix.Checkpoints) < 3 {
		t.Fatalf("%d checkpoints, want several", len(l.ix.Checkpoints))
	}
	s := openStore(t, Options{MemoryBytes: 8 * mib})
	r := layerReader(t, s, l, newFake(l.blob))
	cp1 := l.ix.Checkpoints[1]
	end := l.ix.Checkpoints[2].Out
	for off := cp1.Out; off < end; off += 4 * kib {
		checkRead(t, r, l.tar, off, int(min(4*kib, end-off)))
	}
	st := s.Stats()
	if st.SpansInflated != 1 {
		t.Fatalf("%d inflations for %d 4 KiB reads of one span, want 1", st.SpansInflated, (end-cp1.Out)/(4*kib))
	}
	if st.MemoryHits < (end-cp1.Out)/(4*kib)-1 {
		t.Fatalf("memory hits %d", st.MemoryHits)
	}
}

// TestCoalesce: concurrent reads of one chunk make one request.
func TestCoalesce(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	l := makeLayer(t, rng, -1, 4, 300*kib, 64*kib, 0)
	s := openStore(t, Options{Dir: t.TempDir()})
	fk := newFake(l.blob)
	gate := make(chan struct{})
	fk.setGate(gate)
	r := layerReader(t, s, l, fk)
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			checkRead(t, r, l.tar, 100*kib+int64(i)*100, 1000)
		}()
	}
	time.Sleep(100 * time.Millisecond)
	close(gate)
	wg.Wait()
	if n := fk.requests.Load(); n != 1 {
		t.Fatalf("32 concurrent reads of one chunk made %d requests, want 1", n)
	}
}

// TestMergeAdjacent: one read of several missing chunks makes Range
// requests of up to MaxFetch each.
func TestMergeAdjacent(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	l := makeLayer(t, rng, -1, 4, 600*kib, 64*kib, 0)
	s := openStore(t, Options{MaxFetch: 256 * kib})
	fk := newFake(l.blob)
	r := layerReader(t, s, l, fk)
	checkRead(t, r, l.tar, 0, 512*kib) // chunks 0-7
	if st := s.Stats(); st.RangeRequests != 2 || st.FetchedChunks != 8 {
		t.Fatalf("a read of 8 chunks with MaxFetch of 4: %d requests, %d chunks; want 2, 8", st.RangeRequests, st.FetchedChunks)
	}
	// A held chunk in the middle splits the next run.
	checkRead(t, r, l.tar, 10*64*kib, 10)
	checkRead(t, r, l.tar, 8*64*kib, 4*64*kib) // 8, 9 missing, 10 held, 11 missing
	if st := s.Stats(); st.RangeRequests != 5 || st.FetchedChunks != 12 {
		t.Fatalf("%d requests, %d chunks; want 5, 12", st.RangeRequests, st.FetchedChunks)
	}
}

func TestRetries(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	l := makeLayer(t, rng, 6, 4, 100*kib, 64*kib, 64*kib)
	t.Run("recovers", func(t *testing.T) {
		s := openStore(t, Options{})
		fk := newFake(l.blob)
		fk.fail.Store(2)
		r := layerReader(t, s, l, fk)
		start := time.Now()
		checkRead(t, r, l.tar, 0, 1000)
		if n := fk.requests.Load(); n != 3 {
			t.Fatalf("%d requests, want 3 (two failures, then success)", n)
		}
		if d := time.Since(start); d < 300*time.Millisecond {
			t.Fatalf("retried after %v, want the backoff of 100 ms + 200 ms", d)
		}
	})
	t.Run("none", func(t *testing.T) {
		s := openStore(t, Options{Retries: -1})
		fk := newFake(l.blob)
		fk.fail.Store(1)
		r := layerReader(t, s, l, fk)
		if _, err := r.ReadAt(make([]byte, 10), 0); !errors.Is(err, errFakeDown) {
			t.Fatalf("read with a failing fetch and no retries: %v", err)
		}
		if n := fk.requests.Load(); n != 1 {
			t.Fatalf("%d requests, want 1", n)
		}
		checkRead(t, r, l.tar, 0, 1000) // the next read tries again
		if st := s.Stats(); st.ReadErrors != 1 || st.FetchErrors != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestReadTimeout: a registry that does not answer fails the reads that
// need it at their deadline, not others; its late answer serves the reads
// after it without another request.
func TestReadTimeout(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	l := makeLayer(t, rng, -1, 4, 300*kib, 64*kib, 0)
	s := openStore(t, Options{Dir: t.TempDir(), ReadTimeout: 500 * time.Millisecond})
	fk := newFake(l.blob)
	r := layerReader(t, s, l, fk)
	checkRead(t, r, l.tar, 0, 1000) // chunk 0 held
	gate := make(chan struct{})
	fk.setGate(gate)
	start := time.Now()
	_, err := r.ReadAt(make([]byte, 1000), 500*kib)
	d := time.Since(start)
	if !errors.Is(err, ErrReadTimeout) || d < 500*time.Millisecond || d > 2*time.Second {
		t.Fatalf("read of a chunk the registry does not send: %v after %v, want ErrReadTimeout after 500ms", err, d)
	}
	checkRead(t, r, l.tar, 10, 1000) // held: served while the registry hangs
	req := fk.requests.Load()
	close(gate)
	testenv.Eventually(t, 5*time.Second, func() (bool, error) {
		_, err := r.ReadAt(make([]byte, 1000), 500*kib)
		return err == nil, err
	})
	checkRead(t, r, l.tar, 500*kib, 1000)
	if n := fk.requests.Load(); n != req {
		t.Fatalf("%d requests after the registry answered, want %d (the late fetch serves later reads)", n, req)
	}
}

// TestInflateStopsAtDeadline: a read whose deadline has passed, of a
// large span whose compressed bytes are all held (so no wait for a chunk
// notices the deadline), fails with ErrReadTimeout instead of inflating
// the span, through the span cache and around it (a memory tier too small
// for the span); the next read with time to spare is served.
func TestInflateStopsAtDeadline(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	zeros := make([]byte, 15*mib)
	if err := tw.WriteHeader(&tar.Header{Name: "zeros", Mode: 0o644, Size: int64(len(zeros)), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write(zeros)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	l := indexLayer(t, buf.Bytes(), nil, 9, 64*kib, 16*mib)
	if len(l.ix.Checkpoints) != 1 {
		t.Fatalf("%d checkpoints, want one span", len(l.ix.Checkpoints))
	}
	for _, c := range []struct {
		name   string
		memory int64
	}{{"span cache", 128 * mib}, {"too large to cache", 4 * mib}} {
		t.Run(c.name, func(t *testing.T) {
			s := openStore(t, Options{MemoryBytes: c.memory})
			r := layerReader(t, s, l, newFake(l.blob))
			ly := s.layers[l.ix.DiffID]
			if err := s.ensure(context.Background(), ly, 0, l.ix.NumChunks(), true); err != nil {
				t.Fatal(err)
			}
			off := int64(len(l.tar)) - 8*kib
			timeout := s.readTimeout
			s.readTimeout = -1 // every read's deadline has passed when it starts
			if n, err := r.ReadAt(make([]byte, 4*kib), off); n != 0 || !errors.Is(err, ErrReadTimeout) {
				t.Fatalf("read of a held span past its deadline: %d bytes, %v; want ErrReadTimeout", n, err)
			}
			s.readTimeout = timeout
			checkRead(t, r, l.tar, off, 4*kib)
			if st := s.Stats(); st.FetchedChunks != l.ix.NumChunks() || st.ReadErrors != 1 {
				t.Fatalf("stats %+v: want the %d chunks fetched once and one read error", st, l.ix.NumChunks())
			}
		})
	}
}

// TestVerifyFailure: bytes that do not match the index are an error and
// one log line naming layer and chunk, never data; other chunks are fine.
func TestVerifyFailure(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 6))
	for _, level := range []int{-1, 6} {
		l := makeLayer(t, rng, level, 6, 200*kib, 64*kib, 64*kib)
		var log logBuf
		s := openStore(t, Options{Dir: t.TempDir(), Logf: log.logf})
		fk := newFake(l.blob)
		bad := int64(len(l.blob) / 2)
		fk.corrupt.Store(bad)
		r := layerReader(t, s, l, fk)
		chunk := bad / l.ix.ChunkSize
		// A read over the whole layer needs the bad chunk.
		p := make([]byte, len(l.tar))
		n, err := r.ReadAt(p, 0)
		if !errors.Is(err, lazyindex.ErrChunkDigest) || n != 0 {
			t.Fatalf("read over a corrupted chunk: %d bytes, %v; want 0 and ErrChunkDigest", n, err)
		}
		if st := s.Stats(); st.VerifyFailures < 1 || st.ReadErrors != 1 {
			t.Fatalf("stats %+v", st)
		}
		lines := log.matching("does not match the index")
		if len(lines) == 0 || !strings.Contains(lines[0], l.ix.Digest) || !strings.Contains(lines[0], "chunk "+itoa(chunk)) {
			t.Fatalf("log %q, want a line naming layer %s chunk %d", log.lines, l.ix.Digest, chunk)
		}
		// Nothing of the bad chunk went to disk.
		m, _ := os.ReadFile(filepath.Join(s.opts.Dir, "layers", l.ix.Digest[7:]+".chunks"))
		if m[mapHeaderSize+chunk] != 0 {
			t.Fatalf("corrupted chunk %d marked held on disk", chunk)
		}
		fk.corrupt.Store(-1)
		checkRead(t, r, l.tar, 0, len(l.tar))
	}
}

func itoa(i int64) string { return strconv.FormatInt(i, 10) }

// TestRestart: a second Store on the same Dir serves fetched chunks
// without the network.
func TestRestart(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for _, level := range []int{-1, 6} {
		l := makeLayer(t, rng, level, 6, 200*kib, 64*kib, 64*kib)
		dir := t.TempDir()
		s1, _ := Open(Options{Dir: dir})
		r1 := layerReader(t, s1, l, newFake(l.blob))
		checkRead(t, r1, l.tar, 0, len(l.tar)/2)
		if err := s1.Close(); err != nil {
			t.Fatal(err)
		}
		down := newFake(l.blob)
		down.fail.Store(-1)
		s2 := openStore(t, Options{Dir: dir, Retries: -1})
		r2 := layerReader(t, s2, l, down)
		checkRead(t, r2, l.tar, 0, len(l.tar)/2)
		if st := s2.Stats(); st.RangeRequests != 0 || st.DiskHits == 0 {
			t.Fatalf("restarted store: %+v; want disk hits and no requests", st)
		}
		if _, err := r2.ReadAt(make([]byte, 10), int64(len(l.tar))-10); !errors.Is(err, errFakeDown) {
			t.Fatalf("read of a chunk never fetched, registry down: %v", err)
		}
	}
}

// TestTornChunk: a marked chunk whose bytes are wrong on disk (a torn
// write, a crash) is fetched again, never served; a written but unmarked
// chunk does not count.
func TestTornChunk(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 8))
	l := makeLayer(t, rng, 6, 6, 200*kib, 64*kib, 64*kib)
	dir := t.TempDir()
	s1, _ := Open(Options{Dir: dir})
	r1 := layerReader(t, s1, l, newFake(l.blob))
	checkRead(t, r1, l.tar, 0, len(l.tar))
	s1.Close()
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	data, err := os.OpenFile(base+".data", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Chunk 2: zeroed half way, as a write torn by a crash.
	start, end := l.ix.ChunkRange(2)
	data.WriteAt(make([]byte, (end-start)/2), start+(end-start)/4)
	data.Close()
	// Chunk 3: bytes there but not marked, as a crash before the mark.
	cm, _ := os.OpenFile(base+".chunks", os.O_RDWR, 0)
	cm.WriteAt([]byte{0}, mapHeaderSize+3)
	cm.Close()

	t.Run("registry down", func(t *testing.T) {
		var log logBuf
		down := newFake(l.blob)
		down.fail.Store(-1)
		s := openStore(t, Options{Dir: dir, Retries: -1, Logf: log.logf})
		r := layerReader(t, s, l, down)
		for _, c := range []int64{2, 3} {
			start, _ := l.ix.ChunkRange(c)
			p := make([]byte, len(l.tar))
			if n, err := r.ReadAt(p, 0); err == nil || n != 0 {
				t.Fatalf("read over chunk %d (torn or unmarked, registry down) at %d: %d bytes, %v", c, start, n, err)
			}
		}
		if s.Stats().VerifyFailures == 0 || len(log.matching("on disk does not verify")) == 0 {
			t.Fatalf("torn chunk not reported: %+v %q", s.Stats(), log.lines)
		}
		checkRead(t, r, l.tar, 0, 1000) // chunk 0 is fine
	})
	t.Run("registry up", func(t *testing.T) {
		fk := newFake(l.blob)
		s := openStore(t, Options{Dir: dir})
		r := layerReader(t, s, l, fk)
		checkRead(t, r, l.tar, 0, len(l.tar))
		if st := s.Stats(); st.FetchedChunks != 2 {
			t.Fatalf("refetched %d chunks, want 2 (the torn and the unmarked one): %+v", st.FetchedChunks, st)
		}
	})
	t.Run("repaired", func(t *testing.T) {
		down := newFake(l.blob)
		down.fail.Store(-1)
		s := openStore(t, Options{Dir: dir})
		r := layerReader(t, s, l, down)
		checkRead(t, r, l.tar, 0, len(l.tar))
	})
}

// TestDiskFull: a node cache on a full filesystem (a small tmpfs) serves
// reads from memory, logs one clear line, and leaves no chunk marked
// whose bytes are not there.
func TestDiskFull(t *testing.T) {
	testenv.Root(t, "mounts a small tmpfs as a full node disk")
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=256k"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	rng := rand.New(rand.NewPCG(9, 9))
	l := makeLayer(t, rng, 1, 12, 200*kib, 64*kib, 64*kib) // a blob of about 1 MiB
	if len(l.blob) < 700*kib {
		t.Fatalf("blob of %d bytes does not overflow the 256 KiB tmpfs", len(l.blob))
	}
	var log logBuf
	// A memory tier smaller than the layer, so that reads after the disk
	// has room again must fetch (and write) again.
	s := openStore(t, Options{Dir: dir, Logf: log.logf, MaxFetch: 64 * kib, MemoryBytes: 256 * kib})
	s.diskRetry = time.Second
	r := layerReader(t, s, l, newFake(l.blob))
	checkRead(t, r, l.tar, 0, len(l.tar))
	checkRead(t, r, l.tar, int64(len(l.tar))/3, 100*kib)
	st := s.Stats()
	lines := log.matching("node cache " + dir + " full: serving layer " + l.ix.Digest + " from memory")
	if st.DiskFull == 0 || len(lines) != 1 {
		t.Fatalf("stats %+v, log %q: want one 'node cache full' line", st, log.lines)
	}
	t.Log(lines[0])
	// Every chunk marked on disk verifies; some made it, not all.
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	heldChunks := func() int {
		m, _ := os.ReadFile(base + ".chunks")
		data, _ := os.ReadFile(base + ".data")
		held := 0
		for i := int64(0); i < l.ix.NumChunks(); i++ {
			if m[mapHeaderSize+i] == 1 {
				held++
				a, b := l.ix.ChunkRange(i)
				if err := l.ix.VerifyChunk(i, data[a:b]); err != nil {
					t.Fatalf("chunk %d marked held: %v", i, err)
				}
			}
		}
		return held
	}
	held := heldChunks()
	if held == 0 || held == int(l.ix.NumChunks()) {
		t.Fatalf("%d of %d chunks held on a 256 KiB disk", held, l.ix.NumChunks())
	}
	t.Logf("%d of %d chunks on disk", held, l.ix.NumChunks())

	// Space freed (the tmpfs grown): after the retry interval the same
	// Store writes to disk again, and the whole layer survives a restart.
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_REMOUNT, "size=4m"); err != nil {
		t.Fatalf("grow tmpfs: %v", err)
	}
	time.Sleep(time.Second)
	checkRead(t, r, l.tar, 0, len(l.tar))
	if n := heldChunks(); n <= held {
		t.Fatalf("after space was freed, reads wrote no chunks: %d of %d on disk", n, l.ix.NumChunks())
	}
	// The chunks still in memory are written by the fill.
	if err := s.Fill(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	// Fill returns once its last chunks are handed over, and their run
	// is written to disk just after: wait for it, bounded.
	testenv.Eventually(t, 10*time.Second, func() (bool, error) {
		n := heldChunks()
		return n == int(l.ix.NumChunks()), fmt.Errorf("after space was freed, %d of %d chunks on disk", n, l.ix.NumChunks())
	})
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	down := newFake(l.blob)
	down.fail.Store(-1)
	s3 := openStore(t, Options{Dir: dir, Retries: -1})
	checkRead(t, layerReader(t, s3, l, down), l.tar, 0, len(l.tar))
	s3.Close()
}

// TestTwoStoresOneDir: two Stores on one directory (two pods' shims)
// reading the same layer at once fetch each chunk once between them.
func TestTwoStoresOneDir(t *testing.T) {
	rng := rand.New(rand.NewPCG(10, 10))
	l := makeLayer(t, rng, 6, 8, 300*kib, 64*kib, 64*kib)
	dir := t.TempDir()
	fk := newFake(l.blob)
	var wg sync.WaitGroup
	stores := make([]*Store, 2)
	for k := range stores {
		stores[k] = openStore(t, Options{Dir: dir, MaxFetch: 128 * kib})
		r := layerReader(t, stores[k], l, fk)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20; i++ {
				off := int64((i*7919 + k*104729) % len(l.tar))
				checkRead(t, r, l.tar, off, 64*kib)
			}
			checkRead(t, r, l.tar, 0, len(l.tar))
		}()
	}
	wg.Wait()
	total := stores[0].Stats().FetchedChunks + stores[1].Stats().FetchedChunks
	if total != l.ix.NumChunks() || fk.bytes.Load() != int64(len(l.blob)) {
		t.Fatalf("two stores fetched %d chunks, %d bytes; the layer has %d chunks, %d bytes", total, fk.bytes.Load(), l.ix.NumChunks(), len(l.blob))
	}
}

// TestTwoProcessesOneDir is TestTwoStoresOneDir with the second store in
// another process (the test binary run again), as two shims are.
func TestTwoProcessesOneDir(t *testing.T) {
	if os.Getenv("STORE_TEST_CHILD") != "" {
		return
	}
	rng := rand.New(rand.NewPCG(11, 11))
	l := makeLayer(t, rng, 6, 8, 300*kib, 64*kib, 64*kib)
	dir := t.TempDir()
	ixb, _ := l.ix.MarshalBinary()
	os.WriteFile(filepath.Join(dir, "index"), ixb, 0o600)
	os.WriteFile(filepath.Join(dir, "blob"), l.blob, 0o600)
	os.WriteFile(filepath.Join(dir, "tar"), l.tar, 0o600)
	cache := filepath.Join(dir, "cache")
	cmd := exec.Command(os.Args[0], "-test.run=^TestChildReader$", "-test.count=1")
	cmd.Env = append(os.Environ(), "STORE_TEST_CHILD="+dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fk := newFake(l.blob)
	s := openStore(t, Options{Dir: cache, MaxFetch: 128 * kib})
	r := layerReader(t, s, l, &slowFetcher{fk})
	checkRead(t, r, l.tar, 0, len(l.tar))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v\n%s", err, out.String())
	}
	var childChunks int64
	if _, err := fmt.Sscan(lastLine(out.String()), &childChunks); err != nil {
		t.Fatalf("child output %q: %v", out.String(), err)
	}
	mine := s.Stats().FetchedChunks
	t.Logf("this process fetched %d chunks, the other %d, of %d", mine, childChunks, l.ix.NumChunks())
	if mine+childChunks != l.ix.NumChunks() {
		t.Fatalf("two processes fetched %d + %d chunks of a layer of %d", mine, childChunks, l.ix.NumChunks())
	}
	if childChunks == 0 || mine == 0 {
		t.Logf("one process fetched everything: no overlap this run")
	}
}

// slowFetcher delays every request so that two processes' reads overlap.
type slowFetcher struct{ f Fetcher }

func (s *slowFetcher) FetchRange(ctx context.Context, p []byte, off int64) error {
	time.Sleep(30 * time.Millisecond)
	return s.f.FetchRange(ctx, p, off)
}

// TestChildReader is the second process of TestTwoProcessesOneDir.
func TestChildReader(t *testing.T) {
	dir := os.Getenv("STORE_TEST_CHILD")
	if dir == "" {
		return // only as TestTwoProcessesOneDir's second process
	}
	ixb, _ := os.ReadFile(filepath.Join(dir, "index"))
	ix, err := lazyindex.Decode(bytes.NewReader(ixb))
	if err != nil {
		t.Fatal(err)
	}
	blob, _ := os.ReadFile(filepath.Join(dir, "blob"))
	tb, _ := os.ReadFile(filepath.Join(dir, "tar"))
	s := openStore(t, Options{Dir: filepath.Join(dir, "cache"), MaxFetch: 128 * kib})
	r := layerReader(t, s, &testLayer{ix: ix}, &slowFetcher{newFake(blob)})
	// From the end backwards, to meet the parent in the middle.
	for off := int64(len(tb)) - 64*kib; off > -64*kib; off -= 64 * kib {
		checkRead(t, r, tb, max(off, 0), 64*kib)
	}
	os.Stdout.WriteString(itoa(s.Stats().FetchedChunks) + "\n")
}

// TestFill: the background fill fetches the rest of the layer at the rate
// given, skips held chunks and stops when its context ends.
func TestFill(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 12))
	l := makeLayer(t, rng, -1, 8, 200*kib, 64*kib, 0) // about 800 KiB
	s := openStore(t, Options{Dir: t.TempDir(), MaxFetch: 128 * kib})
	fk := newFake(l.blob)
	r := layerReader(t, s, l, fk)
	checkRead(t, r, l.tar, 0, 200*kib) // 4 chunks held
	held := s.Stats().FetchedBytes

	// At 512 KiB/s, runs of 128 KiB start at 250 ms, 500 ms, 750 ms...
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	err := s.Fill(ctx, 512*kib)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fill cut short: %v", err)
	}
	time.Sleep(100 * time.Millisecond) // a fetch in flight at the deadline completes
	part := s.Stats().FetchedBytes - held
	if part == 0 || part > 3*128*kib || part >= int64(len(l.blob))-held {
		t.Fatalf("Fill at 512 KiB/s for 600 ms fetched %d bytes of the %d missing", part, int64(len(l.blob))-held)
	}
	rest := int64(len(l.blob)) - held - part
	start := time.Now()
	if err := s.Fill(context.Background(), 1*mib); err != nil {
		t.Fatal(err)
	}
	d := time.Since(start)
	if want := time.Duration(float64(rest) / mib * float64(time.Second)); d < want*8/10 {
		t.Fatalf("Fill of %d bytes at 1 MiB/s took %v, want at least %v", rest, d, want)
	}
	if got := fk.bytes.Load(); got != int64(len(l.blob)) {
		t.Fatalf("fetched %d bytes of a blob of %d: held chunks fetched again", got, len(l.blob))
	}
	// Everything is on disk now: an unlimited Fill fetches nothing.
	if err := s.Fill(context.Background(), 0); err != nil || fk.bytes.Load() != int64(len(l.blob)) {
		t.Fatalf("second Fill: %v, %d bytes fetched", err, fk.bytes.Load())
	}
	fk.fail.Store(-1)
	checkRead(t, r, l.tar, 0, len(l.tar))
}

// TestTracePrefetch: a trace records the chunks reads need in order, once
// each, survives encoding, and Prefetch makes a new node hold them.
func TestTracePrefetch(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 13))
	a := makeLayer(t, rng, -1, 6, 200*kib, 64*kib, 0)
	b := makeLayer(t, rng, 6, 6, 200*kib, 64*kib, 64*kib)
	s := openStore(t, Options{Dir: t.TempDir()})
	ra := layerReader(t, s, a, newFake(a.blob))
	rb := layerReader(t, s, b, newFake(b.blob))
	checkRead(t, ra, a.tar, 0, 10) // before the trace: not in it
	s.StartTrace()
	checkRead(t, ra, a.tar, 3*64*kib+5, 100)  // chunk 3
	checkRead(t, ra, a.tar, 0, 10)            // chunk 0, held already
	checkRead(t, ra, a.tar, 3*64*kib+900, 10) // chunk 3 again
	f := b.files[3]
	checkRead(t, rb, b.tar, f.off, len(f.data))
	tr := s.StopTrace()
	checkRead(t, ra, a.tar, 5*64*kib, 10) // after: not in it
	if len(tr.Entries) < 3 || tr.Entries[0] != (TraceEntry{a.ix.Digest, 3}) || tr.Entries[1] != (TraceEntry{a.ix.Digest, 0}) {
		t.Fatalf("trace %v", tr.Entries)
	}
	seen := map[TraceEntry]bool{}
	for _, e := range tr.Entries[2:] {
		if e.Layer != b.ix.Digest || seen[e] {
			t.Fatalf("trace %v: entry %v", tr.Entries, e)
		}
		seen[e] = true
	}
	enc, err := tr.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	tr2, err := DecodeTrace(enc)
	if err != nil || len(tr2.Entries) != len(tr.Entries) {
		t.Fatalf("decode: %v, %v", err, tr2)
	}
	for i := range tr.Entries {
		if tr.Entries[i] != tr2.Entries[i] {
			t.Fatalf("entry %d: %v, decoded %v", i, tr.Entries[i], tr2.Entries[i])
		}
	}

	// Another node: prefetch, then read with the registry gone.
	tr2.Entries = append(tr2.Entries, TraceEntry{"sha256:" + strings.Repeat("ab", 32), 1}, TraceEntry{"sha256:" + strings.Repeat("ab", 32), 2}, TraceEntry{a.ix.Digest, 1 << 30})
	var log logBuf
	s2 := openStore(t, Options{Dir: t.TempDir(), Logf: log.logf})
	fa, fb := newFake(a.blob), newFake(b.blob)
	ra2 := layerReader(t, s2, a, fa)
	rb2 := layerReader(t, s2, b, fb)
	if err := s2.Prefetch(context.Background(), tr2, 0); err != nil {
		t.Fatal(err)
	}
	if st := s2.Stats(); st.FetchedChunks != int64(len(tr.Entries)) {
		t.Fatalf("prefetch fetched %d chunks for a trace of %d", st.FetchedChunks, len(tr.Entries))
	}
	if n := len(log.matching("skipped")); n != 2 {
		t.Fatalf("log %q: want one line per skipped layer", log.lines)
	}
	fa.fail.Store(-1)
	fb.fail.Store(-1)
	checkRead(t, ra2, a.tar, 3*64*kib+5, 100)
	checkRead(t, ra2, a.tar, 0, 10)
	checkRead(t, rb2, b.tar, f.off, len(f.data))
}

// TestPrefetchBound: a replayed trace fetches each chunk once however
// often it names it, so never more than the layers hold even through a
// memory tier that cannot keep them, and no more than its byte bound,
// trimmed with one log line.
func TestPrefetchBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 14))
	a := makeLayer(t, rng, -1, 6, 200*kib, 64*kib, 0)
	n := a.ix.NumChunks()
	if n < 5 {
		t.Fatalf("layer of %d chunks, want several", n)
	}
	var tr Trace
	for range 3 {
		for i := range n {
			tr.Entries = append(tr.Entries, TraceEntry{a.ix.Digest, i})
		}
	}

	// Memory only, room for two chunks: what the trace names again has
	// been evicted by then.
	s := openStore(t, Options{MemoryBytes: 128 * kib})
	layerReader(t, s, a, newFake(a.blob))
	if err := s.Prefetch(context.Background(), tr, 0); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.FetchedChunks != n || st.FetchedBytes != int64(len(a.blob)) {
		t.Fatalf("a trace naming each of %d chunks three times fetched %d chunks, %d bytes of a %d-byte layer", n, st.FetchedChunks, st.FetchedBytes, len(a.blob))
	}

	// A bound of three chunks and a half: the first three, and one line.
	var log logBuf
	s2 := openStore(t, Options{Dir: t.TempDir(), Logf: log.logf})
	fk := newFake(a.blob)
	r2 := layerReader(t, s2, a, fk)
	if err := s2.Prefetch(context.Background(), tr, 3*64*kib+32*kib); err != nil {
		t.Fatal(err)
	}
	if st := s2.Stats(); st.FetchedChunks != 3 || st.FetchedBytes != 3*64*kib {
		t.Fatalf("a replay bounded to 3.5 chunks fetched %d chunks, %d bytes", st.FetchedChunks, st.FetchedBytes)
	}
	if got := log.matching("trimmed"); len(got) != 1 || !strings.Contains(got[0], "first 3 chunks") {
		t.Fatalf("log %q: want one line saying the trace was trimmed to 3 chunks", log.lines)
	}
	fk.fail.Store(-1)
	checkRead(t, r2, a.tar, 0, 3*64*kib)
	if _, err := r2.ReadAt(make([]byte, 10), 3*64*kib); !errors.Is(err, errFakeDown) {
		t.Fatalf("chunk 3, past the bound, with the registry down: %v; want it not prefetched", err)
	}
}

// TestOpenerFallback: sources the store does not hold go to the fallback.
func TestOpenerFallback(t *testing.T) {
	s := openStore(t, Options{})
	var got index.Source
	o := s.Opener(openerFunc(func(src index.Source, path string) (io.ReaderAt, error) {
		got = src
		return bytes.NewReader(nil), nil
	}))
	src := index.Source{Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("0", 64)}
	if _, err := o.Open(src, ""); err != nil || got != src {
		t.Fatalf("fallback got %v, %v", got, err)
	}
	if _, err := s.Opener(nil).Open(src, ""); err == nil {
		t.Fatal("unknown source without a fallback opened")
	}
}

type openerFunc func(index.Source, string) (io.ReaderAt, error)

func (f openerFunc) Open(src index.Source, path string) (io.ReaderAt, error) { return f(src, path) }

func TestAddLayerRefusesBadIndex(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 14))
	l := makeLayer(t, rng, -1, 2, 10*kib, 64*kib, 0)
	s := openStore(t, Options{})
	bad := *l.ix
	bad.Chunks = nil
	if err := s.AddLayer(&bad, newFake(l.blob)); err == nil || !strings.Contains(err.Error(), "chunk digests") {
		t.Fatalf("index without chunk digests: %v", err)
	}
	bad = *l.ix
	bad.Digest = "sha256:../../x"
	if err := s.AddLayer(&bad, newFake(l.blob)); err == nil {
		t.Fatal("index with a bad digest added")
	}
	if err := s.AddLayer(l.ix, newFake(l.blob)); err != nil {
		t.Fatal(err)
	}
	if err := s.AddLayer(l.ix, newFake(l.blob)); err != nil {
		t.Fatalf("the same layer twice: %v", err)
	}
}

// lastLine is the child's report; go test prints its own lines after it.
func lastLine(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if _, err := strconv.Atoi(strings.TrimSpace(l)); err == nil {
			return l
		}
	}
	return out
}

// TestConcurrentReads: 32 readers (a vhost-user queue's executors) read
// random ranges of a gzip layer at once, through a memory tier that
// evicts, and all get the layer's bytes; each chunk is fetched once.
func TestConcurrentReads(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 15))
	l := makeLayer(t, rng, 6, 16, 300*kib, 64*kib, 64*kib)
	s := openStore(t, Options{Dir: t.TempDir(), MemoryBytes: 512 * kib, MaxFetch: 256 * kib})
	fk := newFake(l.blob)
	r := layerReader(t, s, l, fk)
	var wg sync.WaitGroup
	for g := 0; g < 32; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 16))
			for i := 0; i < 40; i++ {
				checkRead(t, r, l.tar, rng.Int64N(int64(len(l.tar))), 1+rng.IntN(128*kib))
			}
		}()
	}
	wg.Wait()
	if st := s.Stats(); fk.bytes.Load() > int64(len(l.blob)) || st.ReadErrors != 0 {
		t.Fatalf("fetched %d bytes of a blob of %d: %+v", fk.bytes.Load(), len(l.blob), st)
	}
}

// TestLockedByOtherProcess plays the other process with its own open file
// description: while it holds a chunk's lock, a read waits no longer than
// its deadline; when it writes the chunk, marks it and unlocks, the read
// takes the chunk from disk without a request.
func TestLockedByOtherProcess(t *testing.T) {
	rng := rand.New(rand.NewPCG(16, 16))
	l := makeLayer(t, rng, -1, 4, 300*kib, 64*kib, 0)
	dir := t.TempDir()
	s := openStore(t, Options{Dir: dir, ReadTimeout: 300 * time.Millisecond})
	fk := newFake(l.blob)
	r := layerReader(t, s, l, fk)
	base := filepath.Join(dir, "layers", l.ix.Digest[7:])
	other, err := os.OpenFile(base+".data", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	otherMap, err := os.OpenFile(base+".chunks", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer otherMap.Close()
	start, end := l.ix.ChunkRange(2)
	unlock, err := lockRange(context.Background(), other, start, end-start)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err = r.ReadAt(make([]byte, 100), start+10)
	if d := time.Since(t0); !errors.Is(err, ErrReadTimeout) || d > time.Second {
		t.Fatalf("read of a chunk another process is fetching: %v after %v, want ErrReadTimeout after 300ms", err, d)
	}
	if fk.requests.Load() != 0 {
		t.Fatal("fetched a chunk another process holds the lock of")
	}
	// The other process's fetch lands: bytes, durable, then the mark.
	other.WriteAt(l.blob[start:end], start)
	other.Sync()
	otherMap.WriteAt([]byte{1}, mapHeaderSize+2)
	unlock()
	testenv.Eventually(t, 5*time.Second, func() (bool, error) {
		_, err := r.ReadAt(make([]byte, 100), start+10)
		if err != nil {
			err = fmt.Errorf("read after the other process's chunk landed: %w", err)
		}
		return err == nil, err
	})
	checkRead(t, r, l.tar, start, int(end-start))
	if st := s.Stats(); fk.requests.Load() != 0 || st.DiskHits == 0 {
		t.Fatalf("%d requests, stats %+v: want the chunk from disk", fk.requests.Load(), st)
	}
}
