package overlay

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// model is the reference disk the device must agree with.
type model struct{ data []byte }

func checkEqual(t *testing.T, d *Device, m *model, what string) {
	t.Helper()
	got := make([]byte, len(m.data))
	if _, err := d.ReadAt(got, 0); err != nil {
		t.Fatalf("%s: ReadAt: %v", what, err)
	}
	firstDiff(t, d, got, m.data, what)
	// The same disk through ReadVecAt, in buffers of random sizes (some
	// empty) at a few offsets, as a guest's scattered pages would ask.
	rng := rand.New(rand.NewPCG(uint64(len(what)), 7))
	for _, off := range []int{0, 1, d.BlockSize() - 1, len(m.data) / 3} {
		if off >= len(m.data) {
			continue
		}
		var vec [][]byte
		for left := len(m.data) - off; left > 0; {
			n := min(left, rng.IntN(3*d.BlockSize()))
			vec = append(vec, make([]byte, n))
			left -= n
		}
		if n, err := d.ReadVecAt(vec, int64(off)); err != nil || n != len(m.data)-off {
			t.Fatalf("%s: ReadVecAt at %d: %d, %v", what, off, n, err)
		}
		firstDiff(t, d, bytes.Join(vec, nil), m.data[off:], fmt.Sprintf("%s (ReadVecAt at %d)", what, off))
	}
}

func firstDiff(t *testing.T, d *Device, got, want []byte, what string) {
	t.Helper()
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s: first difference at byte %d (block %d): got %#x want %#x", what, i, i/d.BlockSize(), got[i], want[i])
			}
		}
	}
}

func openT(t *testing.T, base []byte, path string, opts Options) *Device {
	t.Helper()
	d, err := Open(bytes.NewReader(base), int64(len(base)), path, opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return d
}

func TestFreshReadsBase(t *testing.T) {
	base := randomBytes(1, 64*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	checkEqual(t, d, &model{data: base}, "fresh")
	if r := d.DirtyRanges(); len(r) != 0 {
		t.Fatalf("fresh overlay has dirty ranges %v", r)
	}
	// Unaligned reads across block boundaries.
	got := make([]byte, 5000)
	if _, err := d.ReadAt(got, 4000); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, base[4000:9000]) {
		t.Fatal("unaligned read differs from base")
	}
}

func TestWritePathsAgainstModel(t *testing.T) {
	for _, bs := range []int{4096, 512, 65536} {
		t.Run(fmt.Sprint(bs), func(t *testing.T) {
			// A size that is not a multiple of the block size exercises the short last block.
			size := 40*bs + 1024
			if bs == 512 {
				size = 40 * bs
			}
			base := randomBytes(uint64(bs), size)
			m := &model{data: bytes.Clone(base)}
			path := filepath.Join(t.TempDir(), "ov")
			d := openT(t, base, path, Options{BlockSize: bs})
			r := rand.New(rand.NewPCG(uint64(bs), 7))
			for i := range 300 {
				off := r.IntN(size)
				n := 1 + r.IntN(min(size-off, 3*bs))
				switch r.IntN(6) {
				case 0, 1, 2:
					p := randomBytes(uint64(i)+1000, n)
					if _, err := d.WriteAt(p, int64(off)); err != nil {
						t.Fatalf("op %d WriteAt(%d,%d): %v", i, off, n, err)
					}
					copy(m.data[off:], p)
				case 3:
					if err := d.Discard(int64(off), int64(n)); err != nil {
						t.Fatalf("op %d Discard: %v", i, err)
					}
					clear(m.data[off : off+n])
				case 4:
					if err := d.WriteZeroes(int64(off), int64(n), false); err != nil {
						t.Fatalf("op %d WriteZeroes: %v", i, err)
					}
					clear(m.data[off : off+n])
				case 5:
					if err := d.WriteZeroes(int64(off), int64(n), true); err != nil {
						t.Fatalf("op %d WriteZeroes unmap: %v", i, err)
					}
					clear(m.data[off : off+n])
				}
				if i%50 == 0 {
					checkEqual(t, d, m, fmt.Sprintf("after op %d", i))
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
				}
			}
			checkEqual(t, d, m, "end")
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			d = openT(t, base, path, Options{BlockSize: bs})
			defer d.Close()
			checkEqual(t, d, m, "reopened")
		})
	}
}

// TestWriteVecAtAgainstModel drives WriteVecAt with requests split into
// buffers the way a virtio request's data is: page-aligned whole pages
// (eligible for O_DIRECT) and arbitrary pieces, with partial blocks at
// either end, interleaved with plain writes and discards.
func TestWriteVecAtAgainstModel(t *testing.T) {
	for _, bs := range []int{4096, 512, 65536} {
		for _, buffered := range []bool{false, true} {
			t.Run(fmt.Sprintf("bs%d/buffered=%t", bs, buffered), func(t *testing.T) {
				size := 64 * max(bs, 4096)
				base := randomBytes(uint64(bs)+3, size)
				m := &model{data: bytes.Clone(base)}
				path := filepath.Join(t.TempDir(), "ov")
				d := openT(t, base, path, Options{BlockSize: bs, BufferedOnly: buffered})
				arena, err := alignedBufs(1, 1<<20)
				if err != nil {
					t.Fatal(err)
				}
				r := rand.New(rand.NewPCG(uint64(bs), 11))
				for i := range 400 {
					var off, n int
					var bufs [][]byte
					if r.IntN(2) == 0 {
						// Aligned: whole pages at a page-aligned offset.
						pages := 1 + r.IntN(64)
						off = r.IntN(size/4096-pages+1) * 4096
						n = pages * 4096
						for at := 0; at < n; {
							seg := min(n-at, 4096*(1+r.IntN(4)))
							p := r.IntN(len(arena[0])/4096-seg/4096+1) * 4096
							b := arena[0][p : p+seg]
							fill(b, uint64(i))
							bufs = append(bufs, b)
							at += seg
						}
					} else {
						off = r.IntN(size)
						n = 1 + r.IntN(min(size-off, 3*max(bs, 4096)))
						for at := 0; at < n; {
							seg := min(n-at, 1+r.IntN(5000))
							p := r.IntN(len(arena[0]) - seg + 1)
							b := arena[0][p : p+seg]
							fill(b, uint64(i))
							bufs = append(bufs, bytes.Clone(b))
							at += seg
						}
					}
					var src []byte
					for _, b := range bufs {
						src = append(src, b...)
					}
					switch r.IntN(5) {
					case 0:
						if err := d.Discard(int64(off), int64(n)); err != nil {
							t.Fatalf("op %d Discard: %v", i, err)
						}
						clear(m.data[off : off+n])
					case 1:
						if _, err := d.WriteAt(src, int64(off)); err != nil {
							t.Fatalf("op %d WriteAt(%d,%d): %v", i, off, n, err)
						}
						copy(m.data[off:], src)
					default:
						got, err := d.WriteVecAt(bufs, int64(off))
						if err != nil || got != n {
							t.Fatalf("op %d WriteVecAt(%d segments, %d, %d) = %d, %v", i, len(bufs), off, n, got, err)
						}
						copy(m.data[off:], src)
					}
					if i%40 == 0 {
						checkEqual(t, d, m, fmt.Sprintf("after op %d", i))
						if err := d.Flush(); err != nil {
							t.Fatal(err)
						}
					}
				}
				checkEqual(t, d, m, "end")
				switch {
				case buffered && d.directWrites.Load() != 0:
					t.Errorf("BufferedOnly device made %d O_DIRECT writes", d.directWrites.Load())
				case !buffered && d.direct != nil && d.directWrites.Load() == 0:
					t.Error("O_DIRECT is available but no aligned write used it")
				case !buffered && d.direct == nil:
					t.Logf("no O_DIRECT on the filesystem of %s: buffered writes only", path)
				}
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				d = openT(t, base, path, Options{BlockSize: bs})
				defer d.Close()
				checkEqual(t, d, m, "reopened")
			})
		}
	}
}

// fill overwrites b with bytes derived from seed.
func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, uint64(len(b))))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func TestWriteVecAtRejects(t *testing.T) {
	base := randomBytes(9, 16*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	if _, err := d.WriteVecAt([][]byte{make([]byte, 4096), make([]byte, 4096)}, 15*4096); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("write past the end: %v, want ErrOutOfRange", err)
	}
	if n, err := d.WriteVecAt(nil, 4096); n != 0 || err != nil {
		t.Fatalf("empty write: %d, %v", n, err)
	}
	if n, err := d.WriteVecAt([][]byte{{}, make([]byte, 512), {}}, 4096); n != 512 || err != nil {
		t.Fatalf("write with empty buffers: %d, %v", n, err)
	}
}

func TestDiscardReadsZerosNotBase(t *testing.T) {
	base := randomBytes(2, 16*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	// Clean block discarded whole: zeros, not base.
	if err := d.Discard(4096, 4096); err != nil {
		t.Fatal(err)
	}
	// Dirty block discarded whole.
	if _, err := d.WriteAt(bytes.Repeat([]byte{0xAA}, 4096), 8192); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteZeroes(8192, 4096, true); err != nil {
		t.Fatal(err)
	}
	// Partial discard keeps the rest of the block from base.
	if err := d.Discard(3*4096+100, 200); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4*4096)
	if _, err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(base[:4*4096])
	clear(want[4096 : 3*4096])
	clear(want[3*4096+100 : 3*4096+300])
	if !bytes.Equal(got, want) {
		t.Fatal("discarded ranges do not read as zeros with the rest intact")
	}
	if r := d.DirtyRanges(); len(r) != 1 || r[0] != (Range{Start: 1, Count: 3}) {
		t.Fatalf("DirtyRanges = %v, want [{1 3}]", r)
	}
}

func TestDirtyRanges(t *testing.T) {
	base := make([]byte, 300*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	for _, b := range []int64{0, 1, 2, 63, 64, 65, 200, 299} {
		if _, err := d.WriteAt([]byte{1}, b*4096+7); err != nil {
			t.Fatal(err)
		}
	}
	want := []Range{{0, 3}, {63, 3}, {200, 1}, {299, 1}}
	if got := d.DirtyRanges(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("DirtyRanges = %v, want %v", got, want)
	}
}

// TestFlushRewritesBitmapOnlyForNewBits checks that a Flush after rewrites
// of blocks already dirty syncs the data but leaves the bitmap alone, and
// that those rewrites still survive a reopen.
func TestFlushRewritesBitmapOnlyForNewBits(t *testing.T) {
	base := randomBytes(11, 64*4096)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	m := &model{data: append([]byte(nil), base...)}
	write := func(off int64, p []byte) {
		t.Helper()
		if _, err := d.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		copy(m.data[off:], p)
	}
	flush := func(wantSyncs uint64, what string) {
		t.Helper()
		if err := d.Flush(); err != nil {
			t.Fatal(err)
		}
		if got := d.bitmapSyncs.Load(); got != wantSyncs {
			t.Fatalf("%s: %d bitmap syncs, want %d", what, got, wantSyncs)
		}
	}
	write(5*4096, randomBytes(12, 4096))
	flush(1, "first write of block 5")
	write(5*4096, randomBytes(13, 4096))
	write(5*4096+100, randomBytes(14, 300))
	flush(1, "rewrites of block 5")
	flush(1, "flush with nothing written")
	if err := d.Discard(5*4096, 4096); err != nil {
		t.Fatal(err)
	}
	clear(m.data[5*4096 : 6*4096])
	flush(1, "discard of dirty block 5")
	write(6*4096-10, randomBytes(15, 20)) // ends in block 6, clean until now
	flush(2, "first write of block 6")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d = openT(t, base, path, Options{})
	defer d.Close()
	checkEqual(t, d, m, "after reopen")
}

func TestOutOfRangeAndReadOnly(t *testing.T) {
	base := randomBytes(3, 8*4096)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	for _, c := range []struct{ off, n int64 }{{-1, 1}, {int64(len(base)), 1}, {int64(len(base)) - 1, 2}, {1<<63 - 1, 2}} {
		if _, err := d.WriteAt(make([]byte, c.n), c.off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("WriteAt(%d,%d) = %v, want ErrOutOfRange", c.off, c.n, err)
		}
		if _, err := d.ReadAt(make([]byte, c.n), c.off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("ReadAt(%d,%d) = %v, want ErrOutOfRange", c.off, c.n, err)
		}
		if err := d.Discard(c.off, c.n); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("Discard(%d,%d) = %v, want ErrOutOfRange", c.off, c.n, err)
		}
	}
	if _, err := d.WriteAt([]byte("hello"), 100); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ReadAt(make([]byte, 1), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("ReadAt after Close = %v, want ErrClosed", err)
	}

	// Read-only view of the existing overlay sees the write and refuses new ones.
	ro := openT(t, base, path, Options{ReadOnly: true})
	got := make([]byte, 5)
	if _, err := ro.ReadAt(got, 100); err != nil || string(got) != "hello" {
		t.Fatalf("read-only view: %q, %v", got, err)
	}
	if _, err := ro.WriteAt([]byte("x"), 0); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("WriteAt read-only = %v, want ErrReadOnly", err)
	}
	if err := ro.Discard(0, 4096); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("Discard read-only = %v, want ErrReadOnly", err)
	}
	if err := ro.WriteZeroes(0, 4096, false); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("WriteZeroes read-only = %v, want ErrReadOnly", err)
	}
	if err := ro.Flush(); err != nil {
		t.Fatalf("Flush read-only: %v", err)
	}
	ro.Close()

	// Base-only read-only device.
	bo := openT(t, base, "", Options{ReadOnly: true})
	defer bo.Close()
	checkEqual(t, bo, &model{data: base}, "base only")
	if _, err := bo.WriteAt([]byte("x"), 0); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("WriteAt base-only = %v", err)
	}
	if _, err := Open(bytes.NewReader(base), int64(len(base)), "", Options{}); err == nil {
		t.Fatal("writable Open without overlay path succeeded")
	}
}

func TestMismatchRefused(t *testing.T) {
	base := randomBytes(4, 16*4096)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	if _, err := d.WriteAt([]byte{1}, 0); err != nil {
		t.Fatal(err)
	}
	d.Close()

	if _, err := Open(bytes.NewReader(base), int64(len(base))-4096, path, Options{}); !errors.Is(err, ErrMismatch) {
		t.Fatalf("smaller disk: %v, want ErrMismatch", err)
	}
	if _, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{BlockSize: 8192}); !errors.Is(err, ErrMismatch) {
		t.Fatalf("other block size: %v, want ErrMismatch", err)
	}
	// Corrupt the header: refused as corrupt.
	f, err := os.OpenFile(path+bitmapSuffix, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0xff}, 13); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("corrupt header: %v, want ErrCorrupt", err)
	}
}

func TestBitsPastEndRefused(t *testing.T) {
	base := make([]byte, 10*4096)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	d.Close()
	f, err := os.OpenFile(path+bitmapSuffix, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	// A well-formed page with bit 15 set: block 15 of 10.
	page := make([]byte, bitmapPageSize)
	encodePage(page, 0, []uint64{1 << 15})
	if _, err := f.WriteAt(page, headerRegion); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("bits past end: %v, want ErrCorrupt", err)
	}
}

// TestConcurrentPartialWrites has many goroutines write distinct sectors of
// the same blocks; a lost read-modify-write update shows up as a sector
// holding base data instead of its writer's pattern.
func TestConcurrentPartialWrites(t *testing.T) {
	const blocks = 8
	base := randomBytes(5, blocks*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	var wg sync.WaitGroup
	sectors := blocks * 8
	for s := range sectors {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := bytes.Repeat([]byte{byte(s + 1)}, 512)
			if _, err := d.WriteAt(p, int64(s)*512); err != nil {
				t.Error(err)
			}
			buf := make([]byte, 512)
			if _, err := d.ReadAt(buf, int64(s)*512); err != nil {
				t.Error(err)
			}
			if s%5 == 0 {
				if err := d.Flush(); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	got := make([]byte, len(base))
	if _, err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	for s := range sectors {
		if !bytes.Equal(got[s*512:(s+1)*512], bytes.Repeat([]byte{byte(s + 1)}, 512)) {
			t.Fatalf("sector %d lost its write", s)
		}
	}
}

func TestCleanReadAllocFree(t *testing.T) {
	base := randomBytes(6, 64*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	if _, err := d.WriteAt(make([]byte, 4096), 8*4096); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := d.ReadAt(buf, 3*4096); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("clean-block read allocates %.1f times", allocs)
	}
	// A vectored read over clean and dirty blocks, with a base that takes
	// vectors, reuses its pooled iovecs and piece lists.
	dv := openT(t, base, filepath.Join(t.TempDir(), "ov2"), Options{})
	defer dv.Close()
	dv.base = &vecBase{r: bytes.NewReader(base)}
	if _, err := dv.WriteAt(make([]byte, 4096), 8*4096); err != nil {
		t.Fatal(err)
	}
	vec := make([][]byte, 32)
	for i := range vec {
		vec[i] = make([]byte, 4096)
	}
	allocs = testing.AllocsPerRun(100, func() {
		if _, err := dv.ReadVecAt(vec, 0); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 && !raceEnabled {
		t.Fatalf("vectored read allocates %.1f times", allocs)
	}
}

// vecBase is a base that takes vectored reads and counts them.
type vecBase struct {
	r     *bytes.Reader
	calls int
}

func (v *vecBase) ReadAt(p []byte, off int64) (int, error) { return v.r.ReadAt(p, off) }

func (v *vecBase) ReadVecAt(bufs [][]byte, off int64) (int, error) {
	v.calls++
	n := 0
	for _, b := range bufs {
		m, err := v.r.ReadAt(b, off+int64(n))
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// TestReadVecAtHandsCleanRunsToBase checks that a vectored read gives the
// base one call per run of clean blocks, and that the bytes match the model.
func TestReadVecAtHandsCleanRunsToBase(t *testing.T) {
	base := randomBytes(21, 32*4096)
	d := openT(t, base, filepath.Join(t.TempDir(), "ov"), Options{})
	defer d.Close()
	vb := &vecBase{r: bytes.NewReader(base)}
	d.base = vb
	m := &model{data: append([]byte(nil), base...)}
	for _, b := range []int64{3, 4, 10, 31} {
		p := randomBytes(uint64(b), 4096)
		if _, err := d.WriteAt(p, b*4096); err != nil {
			t.Fatal(err)
		}
		copy(m.data[b*4096:], p)
	}
	vec := make([][]byte, 64)
	for i := range vec {
		vec[i] = make([]byte, 2048)
	}
	if n, err := d.ReadVecAt(vec, 0); err != nil || n != len(base) {
		t.Fatalf("ReadVecAt: %d, %v", n, err)
	}
	firstDiff(t, d, bytes.Join(vec, nil), m.data, "ReadVecAt")
	// Clean runs: 0-2, 5-9, 11-30.
	if vb.calls != 3 {
		t.Errorf("base got %d vectored reads, want 3 (one per clean run)", vb.calls)
	}
	if _, err := d.ReadVecAt([][]byte{make([]byte, 4096), make([]byte, 1)}, int64(len(base))-4096); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("ReadVecAt past the end: %v, want ErrOutOfRange", err)
	}
}

// The crash test re-executes this test binary as a child that writes and
// flushes some blocks, writes more without flushing, and waits to be killed.
const crashEnv = "KATA_FSX_OVERLAY_CRASH_CHILD"

func crashBase() []byte { return randomBytes(77, 256*4096) }

func crashPattern(i int) []byte { return bytes.Repeat([]byte{byte(i%250 + 1)}, 4096) }

// crashSpan is what the crash child writes from the middle of block 240
// to the middle of block 250.
func crashSpan() []byte { return randomBytes(78, 10*4096-150) }

// alignedBufs returns n page-aligned buffers of size bytes each (mmap'd, so
// they suit O_DIRECT).
func alignedBufs(n, size int) ([][]byte, error) {
	mem, err := syscall.Mmap(-1, 0, n*size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, err
	}
	bufs := make([][]byte, n)
	for i := range bufs {
		bufs[i] = mem[i*size : (i+1)*size : (i+1)*size]
	}
	return bufs, nil
}

func TestCrashChild(t *testing.T) {
	path := os.Getenv(crashEnv)
	if path == "" {
		t.Skip("helper process for TestCrashRecovery")
	}
	base := crashBase()
	d, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	// Flushed: full blocks 0..99 and a partial write in block 150.
	for i := range 100 {
		if _, err := d.WriteAt(crashPattern(i), int64(i)*4096); err != nil {
			os.Exit(3)
		}
	}
	if _, err := d.WriteAt([]byte("partial-flushed"), 150*4096+10); err != nil {
		os.Exit(3)
	}
	if err := d.Discard(120*4096, 4096); err != nil {
		os.Exit(3)
	}
	// Flushed, vectored: blocks 200..231 as eight page-aligned 16 KiB
	// buffers (the O_DIRECT path where the filesystem has it) and a write
	// from the middle of block 240 to the middle of block 250 in three
	// unaligned pieces (partial blocks at both ends).
	bufs, err := alignedBufs(8, 4*4096)
	if err != nil {
		os.Exit(5)
	}
	for k, b := range bufs {
		for j := range 4 {
			copy(b[j*4096:], crashPattern(200+4*k+j))
		}
	}
	// A buffered partial write that the direct one below must supersede.
	if _, err := d.WriteAt([]byte("stale-buffered"), 205*4096+7); err != nil {
		os.Exit(3)
	}
	if _, err := d.WriteVecAt(bufs, 200*4096); err != nil {
		os.Exit(3)
	}
	span := crashSpan()
	if _, err := d.WriteVecAt([][]byte{span[:5000], span[5000:5001], span[5001:]}, 240*4096+100); err != nil {
		os.Exit(3)
	}
	if err := d.Flush(); err != nil {
		os.Exit(4)
	}
	// A buffered partial write over directly written data, flushed.
	if _, err := d.WriteAt([]byte("after-direct"), 210*4096+300); err != nil {
		os.Exit(3)
	}
	if err := d.Flush(); err != nil {
		os.Exit(4)
	}
	// Not flushed: blocks 100..199 (except 120, 150).
	for i := 100; i < 200; i++ {
		if i == 120 || i == 150 {
			continue
		}
		if _, err := d.WriteAt(crashPattern(i), int64(i)*4096); err != nil {
			os.Exit(3)
		}
	}
	fmt.Printf("READY %t %d\n", d.direct != nil, d.directWrites.Load())
	select {} // wait for SIGKILL
}

func TestCrashRecovery(t *testing.T) {
	if os.Getenv(crashEnv) != "" {
		t.Skip("in child")
	}
	path := filepath.Join(t.TempDir(), "ov")
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnv+"="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// A child stuck before READY (a deadlock in the overlay) would otherwise
	// hang the test; the bound is a failure message, not a speed assertion.
	type readyLine struct {
		line string
		err  error
	}
	ready := make(chan readyLine, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		ready <- readyLine{line, err}
	}()
	var line string
	select {
	case r := <-ready:
		line, err = r.line, r.err
	case <-time.After(2 * time.Minute):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatal("child did not print READY within 2m")
	}
	var direct bool
	var directWrites int
	if _, serr := fmt.Sscanf(line, "READY %t %d\n", &direct, &directWrites); err != nil || serr != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("child said %q, %v", line, err)
	}
	if direct && directWrites == 0 {
		t.Error("O_DIRECT is available but the aligned vectored write did not use it")
	}
	t.Logf("child: O_DIRECT available %t, direct runs %d", direct, directWrites)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child did not die of SIGKILL: %v", err)
	}

	base := crashBase()
	d := openT(t, base, path, Options{})
	defer d.Close()
	got := make([]byte, 4096)
	wantSpan := bytes.Clone(base[240*4096 : 251*4096])
	copy(wantSpan[100:], crashSpan())
	gotSpan := make([]byte, len(wantSpan))
	if _, err := d.ReadAt(gotSpan, 240*4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gotSpan, wantSpan) {
		t.Fatal("flushed vectored write with partial ends (blocks 240..250) lost")
	}
	for i := 200; i < 232; i++ {
		if _, err := d.ReadAt(got, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
		want := crashPattern(i)
		if i == 210 {
			copy(want[300:], "after-direct")
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("flushed vectored block %d lost", i)
		}
	}
	for i := range 200 {
		if _, err := d.ReadAt(got, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
		old := base[i*4096 : (i+1)*4096]
		switch {
		case i < 100:
			if !bytes.Equal(got, crashPattern(i)) {
				t.Fatalf("flushed block %d lost", i)
			}
		case i == 120:
			if !bytes.Equal(got, make([]byte, 4096)) {
				t.Fatalf("flushed discard of block 120 lost")
			}
		case i == 150:
			want := bytes.Clone(old)
			copy(want[10:], "partial-flushed")
			if !bytes.Equal(got, want) {
				t.Fatalf("flushed partial write in block 150 lost")
			}
		default:
			// Unflushed: either the old or the new content, never a mix or garbage.
			if !bytes.Equal(got, old) && !bytes.Equal(got, crashPattern(i)) {
				t.Fatalf("unflushed block %d is neither old nor new", i)
			}
		}
	}
	t.Logf("dirty after recovery: %v", d.DirtyRanges())
}

func FuzzHeader(f *testing.F) {
	var good [headerLen]byte
	h, _ := newHeader(1<<30, 4096)
	h.encode(good[:])
	f.Add(good[:])
	f.Add(good[:headerLen-1])
	f.Add(make([]byte, headerLen))
	odd, _ := newHeader(512*3, 512)
	var ob [headerLen]byte
	odd.encode(ob[:])
	f.Add(ob[:])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHeader(b)
		if err != nil {
			return
		}
		var again [headerLen]byte
		h.encode(again[:])
		if !bytes.Equal(again[:], b[:headerLen]) {
			t.Fatalf("header does not round-trip: %x vs %x", again, b[:headerLen])
		}
		if h.bitmapLen*8 < (h.diskSize+uint64(h.blockSize)-1)/uint64(h.blockSize) {
			t.Fatalf("bitmap too small for disk: %+v", h)
		}
	})
}

func TestHeaderRejects(t *testing.T) {
	h, _ := newHeader(1<<20, 4096)
	var b [headerLen]byte
	h.encode(b[:])
	if _, err := decodeHeader(b[:]); err != nil {
		t.Fatalf("good header refused: %v", err)
	}
	for i := range headerLen {
		c := b
		c[i] ^= 0x40
		if _, err := decodeHeader(c[:]); !errors.Is(err, ErrCorrupt) {
			t.Errorf("flipping byte %d accepted: %v", i, err)
		}
	}
	for _, bs := range []uint32{0, 256, 3000, 2 << 20} {
		if _, err := newHeader(1<<20, bs); err == nil {
			t.Errorf("block size %d accepted", bs)
		}
	}
	if _, err := newHeader(1000, 4096); err == nil {
		t.Error("disk size not a multiple of 512 accepted")
	}
}
