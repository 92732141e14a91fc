package overlay

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// failSyncs makes the next n fdatasyncs of d fail with EIO, as a disk
// that lost a write-back reports it; later ones succeed again, as on
// Linux, where the error is reported once and the lost pages are clean.
func failSyncs(d *Device, n int) *int {
	calls := new(int)
	d.datasync = func(f *os.File) error {
		*calls++
		if n > 0 {
			n--
			return unix.EIO
		}
		return unix.Fdatasync(int(f.Fd()))
	}
	return calls
}

// TestFdatasyncFailurePoisons injects an fdatasync failure into a FLUSH:
// that FLUSH fails, and so must every later one (the next fdatasync
// succeeding says nothing of the lost pages), and every write, until the
// overlay is reopened; the reopened overlay holds exactly what the last
// successful FLUSH made durable.
func TestFdatasyncFailurePoisons(t *testing.T) {
	const bs = 4096
	base := randomBytes(11, 64*bs)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	durable := bytes.Repeat([]byte{0xd1}, bs)
	if _, err := d.WriteAt(durable, 1*bs); err != nil {
		t.Fatal(err)
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(bytes.Repeat([]byte{0x1e}, bs), 2*bs); err != nil {
		t.Fatal(err)
	}
	calls := failSyncs(d, 1)
	if err := d.Flush(); !errors.Is(err, unix.EIO) {
		t.Fatalf("flush with a failing fdatasync: %v, want EIO", err)
	}
	if *calls != 1 {
		t.Fatalf("%d fdatasyncs, want 1", *calls)
	}
	for i := range 2 {
		if err := d.Flush(); !errors.Is(err, ErrPoisoned) || !errors.Is(err, unix.EIO) {
			t.Fatalf("flush %d after the failure: %v, want ErrPoisoned naming EIO", i+1, err)
		}
	}
	if _, err := d.WriteAt([]byte{1}, 3*bs); !errors.Is(err, ErrPoisoned) {
		t.Fatalf("write after the failure: %v, want ErrPoisoned", err)
	}
	if err := d.Discard(0, bs); !errors.Is(err, ErrPoisoned) {
		t.Fatalf("discard after the failure: %v, want ErrPoisoned", err)
	}
	got := make([]byte, bs)
	if _, err := d.ReadAt(got, 1*bs); err != nil || !bytes.Equal(got, durable) {
		t.Fatalf("read after the failure: %v (reads keep working)", err)
	}
	if err := d.Close(); !errors.Is(err, ErrPoisoned) {
		t.Fatalf("close after the failure: %v, want ErrPoisoned", err)
	}

	d = openT(t, base, path, Options{})
	defer d.Close()
	if _, err := d.ReadAt(got, 1*bs); err != nil || !bytes.Equal(got, durable) {
		t.Fatalf("flushed block after reopen: %v, equal %t", err, bytes.Equal(got, durable))
	}
	if _, err := d.ReadAt(got, 2*bs); err != nil || !bytes.Equal(got, base[2*bs:3*bs]) {
		t.Fatalf("block whose flush failed reads %v/%x..., want the base (never acknowledged)", err, got[:4])
	}
	if err := d.Flush(); err != nil {
		t.Fatalf("flush after reopen: %v", err)
	}
}

// bitmapPageOffset returns where bitmap page i lies in the bitmap file.
func bitmapPageOffset(i int) int64 { return headerRegion + int64(i)*bitmapPageSize }

// TestCorruptBitmapPageRefused flips one bit in a bitmap page (a block
// that would read as base data instead of the guest's) and in a page's
// trailer: Open must refuse the overlay naming the file and the page,
// and leave both files as they were.
func TestCorruptBitmapPageRefused(t *testing.T) {
	// Three bitmap pages' worth of blocks.
	nblocks := 3 * pageWords * 64
	base := make([]byte, nblocks*512)
	for _, at := range []int64{0, bitmapPageSize - 1, bitmapPageSize - 8} {
		path := filepath.Join(t.TempDir(), "ov")
		d := openT(t, base, path, Options{BlockSize: 512})
		for _, b := range []int64{5, int64(pageWords*64 + 7)} {
			if _, err := d.WriteAt(bytes.Repeat([]byte{7}, 512), b*512); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		bm := path + bitmapSuffix
		flipBit(t, bm, bitmapPageOffset(1)+at)
		before, _ := os.ReadFile(bm)
		_, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{BlockSize: 512})
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), bm) || !strings.Contains(err.Error(), "page 1") {
			t.Fatalf("bit flipped at page 1 + %d: %v, want ErrCorrupt naming %s and page 1", at, err, bm)
		}
		t.Logf("refused: %v", err)
		after, _ := os.ReadFile(bm)
		if !bytes.Equal(before, after) {
			t.Fatal("refused bitmap was modified")
		}
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("overlay data gone after a refused open: %v", err)
		}
	}
}

func flipBit(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x10
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestMissingBitmapRefused deletes the bitmap of a used overlay: Open must
// fail naming the missing file and how to start over, and must not
// recreate it (which would silently turn every written block back into
// base data).
func TestMissingBitmapRefused(t *testing.T) {
	base := randomBytes(12, 16*4096)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	if _, err := d.WriteAt(bytes.Repeat([]byte{9}, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	bm := path + bitmapSuffix
	if err := os.Remove(bm); err != nil {
		t.Fatal(err)
	}
	_, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{})
	if !errors.Is(err, ErrMissingBitmap) || !strings.Contains(err.Error(), bm) || !strings.Contains(err.Error(), "remove") {
		t.Fatalf("open without the bitmap: %v, want ErrMissingBitmap naming %s and the fix", err, bm)
	}
	t.Logf("refused: %v", err)
	if _, err := os.Stat(bm); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("bitmap recreated by a refused open: %v", err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() != int64(len(base)) {
		t.Fatalf("overlay data changed by a refused open: %v", err)
	}
}

// TestVersion1Converted opens an overlay whose bitmap was written by the
// version-1 format (contiguous words, no page checksums): its bits are
// kept, the file is rewritten as version 2, and a version this build does
// not know is refused naming the version.
func TestVersion1Converted(t *testing.T) {
	const bs = 4096
	base := randomBytes(13, 100*bs)
	path := filepath.Join(t.TempDir(), "ov")
	written := bytes.Repeat([]byte{0x5a}, bs)
	// Overlay data with block 70 written, and a version-1 bitmap saying so.
	ov := make([]byte, len(base))
	copy(ov[70*bs:], written)
	if err := os.WriteFile(path, ov, 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := newHeader(uint64(len(base)), bs)
	if err != nil {
		t.Fatal(err)
	}
	h.version = 1
	v1 := make([]byte, headerRegion+h.bitmapLen)
	h.encode(v1)
	v1[headerRegion+70/8] = 1 << (70 % 8)
	if err := os.WriteFile(path+bitmapSuffix, v1, 0o600); err != nil {
		t.Fatal(err)
	}

	// Read-only: read as is, not converted.
	d := openT(t, base, path, Options{ReadOnly: true})
	got := make([]byte, bs)
	if _, err := d.ReadAt(got, 70*bs); err != nil || !bytes.Equal(got, written) {
		t.Fatalf("read-only open of a version-1 overlay lost block 70: %v", err)
	}
	d.Close()
	if b, _ := os.ReadFile(path + bitmapSuffix); !bytes.Equal(b, v1) {
		t.Fatal("read-only open rewrote the bitmap")
	}

	d = openT(t, base, path, Options{})
	if _, err := d.ReadAt(got, 70*bs); err != nil || !bytes.Equal(got, written) {
		t.Fatalf("version-1 overlay lost block 70: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path + bitmapSuffix)
	if err != nil {
		t.Fatal(err)
	}
	conv, err := decodeHeader(b[:headerLen])
	if err != nil || conv.version != headerVersion {
		t.Fatalf("converted header: version %d, %v", conv.version, err)
	}
	if err := checkPage(b[headerRegion:], 0); err != nil {
		t.Fatalf("converted page 0: %v", err)
	}
	d = openT(t, base, path, Options{})
	if r := d.DirtyRanges(); len(r) != 1 || r[0] != (Range{Start: 70, Count: 1}) {
		t.Fatalf("dirty ranges after conversion: %v", r)
	}
	d.Close()

	// A version from the future.
	h.version = 3
	h.encode(b)
	if err := os.WriteFile(path+bitmapSuffix, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(bytes.NewReader(base), int64(len(base)), path, Options{}); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "version 3") {
		t.Fatalf("version 3: %v, want ErrCorrupt naming the version", err)
	}
}

// TestInterruptedCreateRestarts leaves what a crash inside create leaves
// (overlay data and the bitmap's temporary file, no bitmap): the next Open
// starts a fresh overlay instead of reporting a missing bitmap.
func TestInterruptedCreateRestarts(t *testing.T) {
	base := randomBytes(14, 16*4096)
	path := filepath.Join(t.TempDir(), "ov")
	if err := os.WriteFile(path, make([]byte, 100), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+bitmapSuffix+".tmp", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	d := openT(t, base, path, Options{})
	defer d.Close()
	if r := d.DirtyRanges(); len(r) != 0 {
		t.Fatalf("fresh overlay has dirty blocks %v", r)
	}
	if _, err := os.Stat(path + bitmapSuffix + ".tmp"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("temporary bitmap left behind: %v", err)
	}
}
