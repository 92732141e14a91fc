// Package overlay provides a copy-on-write block device: reads of blocks the
// guest never wrote come from a read-only base, writes land in a per-disk
// sparse overlay file (same offsets as the disk) and set bits in a dirty
// bitmap persisted beside it. Large runs of whole blocks whose buffers are
// aligned go to the overlay with O_DIRECT (when its filesystem supports
// it), everything else through the page cache; Flush covers both.
//
// Durability contract: after Flush returns, every write, discard and
// write-zeroes that completed before Flush was called survives a kill -9 of
// the process and a reopen of the same overlay. A block's dirty bit reaches
// the bitmap file only after its data has been fdatasync'ed.
//
// A failed flush poisons the device: after an fdatasync error the kernel
// may have dropped the dirty pages and reports success next time, so a
// later Flush could claim blocks durable that are lost. Every later Flush
// and write fails with ErrPoisoned until the overlay is reopened, which
// checks the bitmap again and goes on from the last successful Flush.
// A bitmap that is missing or fails its checksums is refused on Open
// (ErrMissingBitmap, ErrCorrupt) and left as it is: it never turns back
// into an empty overlay, which would silently read the guest's writes as
// base data.
package overlay

import (
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/blk/iovec"
)

// DefaultBlockSize is the copy-on-write granularity used when Options.BlockSize is zero.
const DefaultBlockSize = 4096

// bitmapSuffix names the bitmap file beside the overlay file.
const bitmapSuffix = ".dirty"

// lockStripes is the number of striped block locks; a power of two.
const lockStripes = 256

// lockUnitShift sets how many bytes of the disk one stripe covers (64 KiB):
// a 1 MiB guest write then takes 16 stripes, not all of them, so concurrent
// large writes do not serialize on the stripe locks.
const lockUnitShift = 16

// ErrReadOnly reports a write to a device opened read-only.
var ErrReadOnly = errors.New("overlay: device is read-only")

// ErrOutOfRange reports an access beyond the end of the disk or at a negative offset.
var ErrOutOfRange = errors.New("overlay: access out of range")

// ErrPoisoned reports a device on which a Flush failed: nothing written
// since the last successful Flush can be made durable any more.
var ErrPoisoned = errors.New("overlay: an earlier flush failed, so writes since the last successful flush may be lost; close and reopen the overlay to go on from that flush")

// ErrMissingBitmap reports an overlay whose dirty bitmap file is gone.
var ErrMissingBitmap = errors.New("overlay: dirty bitmap missing")

// ErrClosed reports use of a closed device.
var ErrClosed = errors.New("overlay: device is closed")

// Options tune Open.
type Options struct {
	// BlockSize is the copy-on-write granularity in bytes (power of two,
	// 512..1 MiB); 0 means DefaultBlockSize.
	BlockSize int
	// ReadOnly refuses writes; with an empty overlay path the device serves the base alone.
	ReadOnly bool
	// Serial is the device identifier reported by ID (virtio-blk GET_ID, at most 20 bytes used).
	Serial string
	// BufferedOnly writes every block through the page cache; by default
	// whole-block writes whose buffers suit O_DIRECT bypass it.
	BufferedOnly bool
}

// Range is a run of consecutive blocks.
type Range struct {
	// Start is the first block number.
	Start uint64
	// Count is the number of blocks.
	Count uint64
}

// Device is a copy-on-write block device over a base image; safe for concurrent use.
type Device struct {
	base      io.ReaderAt
	size      int64
	blockSize int64
	shift     uint
	lockShift uint // block number to lock unit
	nblocks   uint64
	readOnly  bool
	serial    string

	ov *os.File // overlay data; nil when serving the base alone
	bm *os.File // bitmap file; nil when read-only

	// direct is the overlay opened O_DIRECT for aligned whole-block
	// writes; nil when unsupported, read-only or disabled.
	direct       *os.File
	memAlign     uintptr // O_DIRECT buffer address alignment
	offAlign     uintptr // O_DIRECT offset and length alignment
	noDirect     atomic.Bool
	directWrites atomic.Uint64 // whole-block runs written with O_DIRECT, for tests
	bitmapSyncs  atomic.Uint64 // bitmap fdatasyncs, for tests

	words   []atomic.Uint64 // dirty bits
	changed []atomic.Bool   // per bitmap page: bits set since the last Flush
	written atomic.Bool     // overlay data written since the last Flush

	// locks are the block stripes. Lock order: stripes in ascending index
	// (lockBlocks), and flushMu apart: no stripe is held while flushMu is
	// taken nor flushMu while a stripe is. A stripe holder waits only for
	// its own I/O: the overlay file, and the base below a partial write,
	// whose reads (host files, the lazy store within its read timeout)
	// never wait for a stripe.
	locks   [lockStripes]sync.Mutex
	scratch sync.Pool // *[]byte of blockSize, for read-modify-write
	iovs    sync.Pool // *[]unix.Iovec, for vectored writes and reads
	pieces  sync.Pool // *[][]byte, a vectored read's runs for the base
	// flushMu serializes Flush and Close, held across their fdatasyncs;
	// writes do not take it (see markDirty for how they meet a Flush).
	flushMu sync.Mutex
	closed  atomic.Bool
	poison  atomic.Pointer[error] // the error of the first failed Flush

	// datasync is fdatasync(2); tests inject failures through it.
	datasync func(*os.File) error
}

// Open opens (or creates) the overlay for a disk of size bytes whose unwritten
// blocks read from base. overlayPath's bitmap lives at overlayPath+".dirty";
// an existing pair made for another size or block size is refused with ErrMismatch.
func Open(base io.ReaderAt, size int64, overlayPath string, opts Options) (*Device, error) {
	bs := opts.BlockSize
	if bs == 0 {
		bs = DefaultBlockSize
	}
	if bs < 0 || bs > maxBlockSize || size < 0 {
		return nil, fmt.Errorf("overlay: invalid geometry: size %d, block size %d", size, bs)
	}
	h, err := newHeader(uint64(size), uint32(bs))
	if err != nil {
		return nil, fmt.Errorf("overlay: %w", err)
	}
	if base == nil {
		return nil, errors.New("overlay: nil base")
	}
	d := &Device{
		base:      base,
		size:      size,
		blockSize: int64(bs),
		shift:     uint(bits.TrailingZeros(uint(bs))),
		lockShift: uint(max(0, lockUnitShift-bits.TrailingZeros(uint(bs)))),
		nblocks:   (uint64(size) + uint64(bs) - 1) / uint64(bs),
		readOnly:  opts.ReadOnly,
		serial:    opts.Serial,
	}
	nwords := h.bitmapLen / 8
	d.words = make([]atomic.Uint64, nwords)
	d.changed = make([]atomic.Bool, bitmapPages(nwords))
	d.datasync = func(f *os.File) error { return unix.Fdatasync(int(f.Fd())) }
	d.scratch.New = func() any { b := make([]byte, bs); return &b }
	d.iovs.New = func() any { v := make([]unix.Iovec, 0, 256); return &v }
	d.pieces.New = func() any { v := make([][]byte, 0, 256); return &v }

	if overlayPath == "" {
		if !opts.ReadOnly {
			return nil, errors.New("overlay: an overlay path is required unless read-only")
		}
		return d, nil
	}
	if err := d.openFiles(overlayPath, h); err != nil {
		d.closeFiles()
		return nil, err
	}
	if !opts.ReadOnly && !opts.BufferedOnly {
		d.openDirect(overlayPath)
	}
	return d, nil
}

func (d *Device) openFiles(path string, h header) error {
	bmPath := path + bitmapSuffix
	if d.readOnly {
		ov, err := os.Open(path)
		if err != nil {
			return fmt.Errorf("overlay: open overlay read-only: %w", err)
		}
		d.ov = ov
		bm, err := os.Open(bmPath)
		if errors.Is(err, os.ErrNotExist) {
			return missingBitmap(path, bmPath)
		}
		if err != nil {
			return fmt.Errorf("overlay: open bitmap read-only: %w", err)
		}
		defer bm.Close()
		_, err = d.loadBitmap(bm, bmPath, h)
		return err
	}

	bm, err := os.OpenFile(bmPath, os.O_RDWR, 0)
	switch {
	case err == nil:
		d.bm = bm
		version, err := d.loadBitmap(bm, bmPath, h)
		if err != nil {
			return err
		}
		ov, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("overlay: open overlay data beside bitmap %s: %w", bmPath, err)
		}
		d.ov = ov
		st, err := ov.Stat()
		if err != nil {
			return fmt.Errorf("overlay: stat overlay: %w", err)
		}
		if st.Size() != d.size {
			return fmt.Errorf("%w: overlay file is %d bytes, disk is %d", ErrMismatch, st.Size(), d.size)
		}
		if version != headerVersion {
			// Rewrite the bits just read, now with checksums.
			if err := d.installBitmap(bmPath, h); err != nil {
				return fmt.Errorf("overlay: convert bitmap %s from version %d: %w", bmPath, version, err)
			}
		}
		return nil
	case errors.Is(err, os.ErrNotExist):
		// A fresh overlay, or one whose creation was interrupted (its
		// bitmap's temporary file, made first, is still there): neither
		// holds anything a Flush acknowledged. Overlay data without either
		// is an overlay that lost its bitmap.
		_, derr := os.Lstat(path)
		_, terr := os.Lstat(bmPath + ".tmp")
		switch {
		case derr == nil && terr != nil:
			return missingBitmap(path, bmPath)
		case derr != nil && !errors.Is(derr, os.ErrNotExist):
			return fmt.Errorf("overlay: %w", derr)
		}
		return d.create(path, bmPath, h)
	default:
		return fmt.Errorf("overlay: open bitmap: %w", err)
	}
}

func missingBitmap(path, bmPath string) error {
	return fmt.Errorf("%w: %s is gone but the overlay data %s is there; the bitmap says which blocks the guest wrote, and without it they would read as base data: "+
		"restore %s, or remove %s to start the disk over from its base (the guest's changes are lost)", ErrMissingBitmap, bmPath, path, bmPath, path)
}

// create makes a fresh overlay + bitmap. The bitmap's temporary file is
// made first and renamed to its final name only once complete, so a crash
// leaves either a valid pair or a temporary file that marks the creation
// as unfinished.
func (d *Device) create(path, bmPath string, h header) error {
	tmp := bmPath + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("overlay: create bitmap: %w", err)
	}
	f.Close()
	if err := syncDir(bmPath); err != nil {
		return err
	}
	ov, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("overlay: open overlay: %w", err)
	}
	d.ov = ov
	if err := d.ov.Truncate(0); err != nil {
		return fmt.Errorf("overlay: truncate overlay: %w", err)
	}
	if err := d.ov.Truncate(d.size); err != nil {
		return fmt.Errorf("overlay: size overlay: %w", err)
	}
	if err := d.ov.Sync(); err != nil {
		return fmt.Errorf("overlay: sync overlay: %w", err)
	}
	return d.installBitmap(bmPath, h)
}

// installBitmap writes a complete version-2 bitmap file of d.words under a
// temporary name, syncs it and renames it to bmPath (so a crash leaves the
// old file or the new one), and makes it d.bm.
func (d *Device) installBitmap(bmPath string, h header) error {
	tmp := bmPath + ".tmp"
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("overlay: create bitmap: %w", err)
	}
	h.version = headerVersion
	hb := make([]byte, headerRegion)
	h.encode(hb)
	err = writeAll(f, hb, 0)
	// Pages go out in batches of 1 MiB.
	const batch = 256
	buf := make([]byte, batch*bitmapPageSize)
	words := make([]uint64, pageWords)
	npages := uint64(len(d.changed))
	for p := uint64(0); p < npages && err == nil; p += batch {
		n := min(batch, npages-p)
		for k := range n {
			lo := (p + k) * pageWords
			hi := min(lo+pageWords, uint64(len(d.words)))
			for w := lo; w < hi; w++ {
				words[w-lo] = d.words[w].Load()
			}
			encodePage(buf[k*bitmapPageSize:], uint32(p+k), words[:hi-lo])
		}
		err = writeAll(f, buf[:n*bitmapPageSize], headerRegion+int64(p)*bitmapPageSize)
	}
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, bmPath)
	}
	if err != nil {
		f.Close()
		return fmt.Errorf("overlay: write bitmap %s: %w", bmPath, err)
	}
	if d.bm != nil {
		d.bm.Close()
	}
	d.bm = f
	return syncDir(bmPath)
}

func writeAll(f *os.File, b []byte, off int64) error {
	_, err := f.WriteAt(b, off)
	return err
}

// syncDir makes the directory entries of p's directory durable.
func syncDir(p string) error {
	if err := atomicfile.SyncDir(filepath.Dir(p)); err != nil {
		return fmt.Errorf("overlay: %w", err)
	}
	return nil
}

// loadBitmap reads and checks the bitmap file's header and bits into
// d.words and returns the file's format version.
func (d *Device) loadBitmap(f *os.File, bmPath string, want header) (uint32, error) {
	var hb [headerLen]byte
	if _, err := f.ReadAt(hb[:], 0); err != nil {
		return 0, fmt.Errorf("%w: %s: read header: %w", ErrCorrupt, bmPath, err)
	}
	h, err := decodeHeader(hb[:])
	if err != nil {
		return 0, fmt.Errorf("%s: %w%s", bmPath, err, corruptFix(bmPath))
	}
	if h.diskSize != want.diskSize || h.blockSize != want.blockSize {
		return 0, fmt.Errorf("%w: bitmap is for %d bytes in %d-byte blocks, disk is %d bytes in %d-byte blocks",
			ErrMismatch, h.diskSize, h.blockSize, want.diskSize, want.blockSize)
	}
	if h.version == 1 {
		buf := make([]byte, h.bitmapLen)
		if _, err := f.ReadAt(buf, int64(h.bitmapOff)); err != nil {
			return 0, fmt.Errorf("%w: %s: read bitmap: %w%s", ErrCorrupt, bmPath, err, corruptFix(bmPath))
		}
		for i := range d.words {
			d.words[i].Store(le64(buf[i*8:]))
		}
	} else if err := d.loadPages(f, bmPath); err != nil {
		return 0, err
	}
	if rem := d.nblocks % 64; rem != 0 && len(d.words) > 0 {
		if d.words[len(d.words)-1].Load()>>rem != 0 {
			return 0, fmt.Errorf("%w: %s: bits set past the last block%s", ErrCorrupt, bmPath, corruptFix(bmPath))
		}
	}
	return h.version, nil
}

// loadPages reads the version-2 pages into d.words, checking each.
func (d *Device) loadPages(f *os.File, bmPath string) error {
	const batch = 256
	buf := make([]byte, batch*bitmapPageSize)
	npages := uint64(len(d.changed))
	for p := uint64(0); p < npages; p += batch {
		n := min(batch, npages-p)
		if _, err := f.ReadAt(buf[:n*bitmapPageSize], headerRegion+int64(p)*bitmapPageSize); err != nil {
			return fmt.Errorf("%w: %s: read pages %d..%d: %w%s", ErrCorrupt, bmPath, p, p+n-1, err, corruptFix(bmPath))
		}
		for k := range n {
			page := buf[k*bitmapPageSize : (k+1)*bitmapPageSize]
			lo := (p + k) * pageWords
			hi := min(lo+pageWords, uint64(len(d.words)))
			if err := checkPage(page, uint32(p+k)); err != nil {
				return fmt.Errorf("%w: %s: page %d (blocks %d..%d): %v%s", ErrCorrupt, bmPath, p+k,
					lo*64, min(hi*64, d.nblocks)-1, err, corruptFix(bmPath))
			}
			for w := lo; w < hi; w++ {
				d.words[w].Store(le64(page[(w-lo)*8:]))
			}
			for w := hi - lo; w < pageWords; w++ {
				if le64(page[w*8:]) != 0 {
					return fmt.Errorf("%w: %s: page %d: bits set past the last block%s", ErrCorrupt, bmPath, p+k, corruptFix(bmPath))
				}
			}
		}
	}
	return nil
}

// corruptFix is what an error about an untrustworthy bitmap tells the operator.
func corruptFix(bmPath string) string {
	ov := strings.TrimSuffix(bmPath, bitmapSuffix)
	return fmt.Sprintf(" (the bitmap no longer says reliably which blocks the guest wrote; both files are kept: "+
		"inspect or restore %s, or remove %s and %s to start the disk over from its base, losing the guest's changes)", bmPath, bmPath, ov)
}

func le64(b []byte) uint64 {
	_ = b[7]
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

// Size returns the disk size in bytes.
func (d *Device) Size() int64 { return d.size }

// BlockSize returns the copy-on-write block size in bytes.
func (d *Device) BlockSize() int { return int(d.blockSize) }

// ReadOnly reports whether writes are refused.
func (d *Device) ReadOnly() bool { return d.readOnly }

// ID returns the device serial given in Options.
func (d *Device) ID() string { return d.serial }

func (d *Device) dirty(b uint64) bool {
	return d.words[b/64].Load()&(1<<(b%64)) != 0
}

// markDirty sets a block's bit after its data reached the overlay file; the
// page flag is raised after the bit so a concurrent Flush either copies the
// bit or sees the flag again. Only a bit that was clear raises the flag:
// rewriting dirty blocks (the journal, a database file) then costs a Flush
// one fdatasync, not two. The caller holds the block's stripe lock, so a
// writer that finds the bit already set also finds its flag raised (or the
// bit in a snapshot a Flush took after lowering the flag).
func (d *Device) markDirty(b uint64) {
	w := &d.words[b/64]
	m := uint64(1) << (b % 64)
	if w.Load()&m != 0 {
		return
	}
	if w.Or(m)&m == 0 {
		d.changed[b/64/pageWords].Store(true)
	}
}

func (d *Device) check(off int64, n int, write bool) error {
	if d.closed.Load() {
		return ErrClosed
	}
	if write && (d.readOnly || d.ov == nil) {
		return ErrReadOnly
	}
	if write {
		if err := d.poisoned(); err != nil {
			return err
		}
	}
	end, carry := bits.Add64(uint64(off), uint64(n), 0)
	if off < 0 || n < 0 || carry != 0 || end > uint64(d.size) {
		return fmt.Errorf("%w: offset %d length %d, disk is %d bytes", ErrOutOfRange, off, n, d.size)
	}
	return nil
}

// checkVec is check for the concatenation of bufs; it returns its length.
func (d *Device) checkVec(bufs [][]byte, off int64, write bool) (int64, error) {
	var n int64
	for _, b := range bufs {
		n += int64(len(b))
		if n != int64(int(n)) || n < 0 {
			return 0, fmt.Errorf("%w: length overflows", ErrOutOfRange)
		}
	}
	return n, d.check(off, int(n), write)
}

// ReadAt reads len(p) bytes at off: dirty blocks from the overlay, the rest
// from the base. It does not allocate.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	one := [1][]byte{p}
	return d.ReadVecAt(one[:], off)
}

// VectorReader is a reader that fills scattered buffers in one call; a
// base that implements it (*rawimage.Disk does) gets ReadVecAt's runs whole.
type VectorReader interface {
	// ReadVecAt fills bufs, in order, with the bytes at off.
	ReadVecAt(bufs [][]byte, off int64) (int, error)
}

// ReadVecAt fills bufs, in order, with the disk's bytes at off, as ReadAt
// would their concatenation: one preadv per run of dirty blocks, and the
// runs below handed to the base whole when it is a VectorReader. A virtio
// read arrives as one buffer per guest page, and a system call per page
// is what made large guest reads slow.
func (d *Device) ReadVecAt(bufs [][]byte, off int64) (int, error) {
	total, err := d.checkVec(bufs, off, false)
	if err != nil {
		return 0, err
	}
	src := iovec.NewCursor(bufs)
	var done int64
	for done < total {
		pos := off + done
		b := uint64(pos) >> d.shift
		dirty := d.ov != nil && d.dirty(b)
		end := int64(b+1) << d.shift
		for end < off+total && (d.ov != nil && d.dirty(uint64(end)>>d.shift)) == dirty {
			end += d.blockSize
		}
		n := min(end, off+total) - pos
		var err error
		if dirty {
			err = d.readOverlayVec(&src, pos, n)
		} else {
			err = d.readBaseVec(&src, pos, n)
		}
		if err != nil {
			return int(done), fmt.Errorf("overlay: read %d bytes at %d (dirty=%t): %w", n, pos, dirty, err)
		}
		done += n
	}
	return int(done), nil
}

// readOverlayVec reads n bytes of dirty blocks at pos through the page
// cache, even runs that were written with O_DIRECT: on a cold cache the
// kernel's readahead serves parallel large reads faster than O_DIRECT
// reads of the same runs (docs/benchmarks.md has the measurement).
func (d *Device) readOverlayVec(src *iovec.Cursor, pos, n int64) error {
	iovp := d.iovs.Get().(*[]unix.Iovec)
	full := src.Iovecs((*iovp)[:0], n)
	iov := full
	_, err := iovec.Preadv(int(d.ov.Fd()), &iov, pos)
	clear(full) // drop the references to the caller's buffers
	*iovp = full[:0]
	d.iovs.Put(iovp)
	return err
}

func (d *Device) readBaseVec(src *iovec.Cursor, pos, n int64) error {
	vr, ok := d.base.(VectorReader)
	if !ok {
		for n > 0 {
			b := src.Next(n)
			if err := readFull(d.base, b, pos); err != nil {
				return err
			}
			pos += int64(len(b))
			n -= int64(len(b))
		}
		return nil
	}
	bp := d.pieces.Get().(*[][]byte)
	pieces := (*bp)[:0]
	for m := n; m > 0; {
		b := src.Next(m)
		pieces = append(pieces, b)
		m -= int64(len(b))
	}
	got, err := vr.ReadVecAt(pieces, pos)
	clear(pieces) // drop the references to the caller's buffers
	*bp = pieces[:0]
	d.pieces.Put(bp)
	if err == nil && int64(got) != n {
		err = io.ErrUnexpectedEOF
	}
	return err
}

func readFull(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// lockBlocks locks the stripes of blocks first..last in ascending stripe
// order, so holders of several stripes never deadlock each other.
func (d *Device) lockBlocks(first, last uint64) {
	first, last = first>>d.lockShift, last>>d.lockShift
	if last-first+1 >= lockStripes {
		for i := range d.locks {
			d.locks[i].Lock()
		}
		return
	}
	s0, s1 := first%lockStripes, last%lockStripes
	if s0 <= s1 {
		for i := s0; i <= s1; i++ {
			d.locks[i].Lock()
		}
		return
	}
	for i := uint64(0); i <= s1; i++ {
		d.locks[i].Lock()
	}
	for i := s0; i < lockStripes; i++ {
		d.locks[i].Lock()
	}
}

func (d *Device) unlockBlocks(first, last uint64) {
	first, last = first>>d.lockShift, last>>d.lockShift
	if last-first+1 >= lockStripes {
		for i := range d.locks {
			d.locks[i].Unlock()
		}
		return
	}
	s0, s1 := first%lockStripes, last%lockStripes
	if s0 <= s1 {
		for i := s0; i <= s1; i++ {
			d.locks[i].Unlock()
		}
		return
	}
	for i := uint64(0); i <= s1; i++ {
		d.locks[i].Unlock()
	}
	for i := s0; i < lockStripes; i++ {
		d.locks[i].Unlock()
	}
}

// blockSpan returns the byte length of block b (the last block may be short).
func (d *Device) blockSpan(b uint64) int64 {
	start := int64(b) << d.shift
	return min(d.blockSize, d.size-start)
}

// op is what a write-like request does to a byte range.
type op int

const (
	opWrite op = iota
	opDiscard
	opZero
)

// WriteAt writes p at off into the overlay, filling partial blocks from below first.
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := d.check(off, len(p), true); err != nil {
		return 0, err
	}
	one := [1][]byte{p}
	src := iovec.NewCursor(one[:])
	if err := d.apply(opWrite, &src, off, int64(len(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteVecAt writes the concatenation of bufs at off, as WriteAt would but
// with one vectored write per run of whole blocks: a virtio request's data
// arrives as one buffer per guest page, and a system call per page is
// what made large guest writes slow.
func (d *Device) WriteVecAt(bufs [][]byte, off int64) (int, error) {
	n, err := d.checkVec(bufs, off, true)
	if err != nil {
		return 0, err
	}
	src := iovec.NewCursor(bufs)
	if err := d.apply(opWrite, &src, off, n); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Discard deallocates a byte range: afterwards it reads as zeros (never the base).
func (d *Device) Discard(off, n int64) error {
	if n < 0 || n != int64(int(n)) {
		return fmt.Errorf("%w: length %d", ErrOutOfRange, n)
	}
	if err := d.check(off, int(n), true); err != nil {
		return err
	}
	return d.apply(opDiscard, nil, off, n)
}

// WriteZeroes zeroes a byte range; unmap allows deallocating the overlay space.
func (d *Device) WriteZeroes(off, n int64, unmap bool) error {
	if n < 0 || n != int64(int(n)) {
		return fmt.Errorf("%w: length %d", ErrOutOfRange, n)
	}
	if err := d.check(off, int(n), true); err != nil {
		return err
	}
	if unmap {
		return d.apply(opDiscard, nil, off, n)
	}
	return d.apply(opZero, nil, off, n)
}

// apply splits [off, off+n) into a partial head block, a run of full blocks
// and a partial tail block; src (nil unless o is opWrite) supplies the n bytes.
func (d *Device) apply(o op, src *iovec.Cursor, off, n int64) error {
	if n == 0 {
		return nil
	}
	end := off + n
	for off < end {
		b := uint64(off) >> d.shift
		bstart := int64(b) << d.shift
		span := d.blockSpan(b)
		if off != bstart || end-off < span {
			// Partial block: read-modify-write.
			m := min(end, bstart+span) - off
			if err := d.partial(b, off-bstart, m, src); err != nil {
				return err
			}
			off += m
			continue
		}
		// Run of full blocks.
		last := b
		for {
			next := last + 1
			nstart := int64(next) << d.shift
			if next >= d.nblocks || nstart+d.blockSpan(next) > end {
				break
			}
			last = next
		}
		runEnd := (int64(last) << d.shift) + d.blockSpan(last)
		if err := d.fullRun(o, b, last, off, src); err != nil {
			return err
		}
		off = runEnd
	}
	return nil
}

func (d *Device) fullRun(o op, first, last uint64, off int64, src *iovec.Cursor) error {
	n := (int64(last) << d.shift) + d.blockSpan(last) - off
	var iovp *[]unix.Iovec
	var iov []unix.Iovec
	if o == opWrite {
		// Whole blocks replace what is below, so nothing is read first.
		iovp = d.iovs.Get().(*[]unix.Iovec)
		iov = src.Iovecs((*iovp)[:0], n)
		defer func() {
			clear(iov) // drop the references to the caller's buffers
			*iovp = iov[:0]
			d.iovs.Put(iovp)
		}()
	}
	d.lockBlocks(first, last)
	defer d.unlockBlocks(first, last)
	var err error
	switch o {
	case opWrite:
		err = d.writeRun(iov, off, n)
	case opDiscard:
		err = d.zeroRange(off, n, true)
	case opZero:
		err = d.zeroRange(off, n, false)
	}
	if err != nil {
		return fmt.Errorf("overlay: blocks %d..%d: %w", first, last, err)
	}
	d.written.Store(true)
	for b := first; b <= last; b++ {
		d.markDirty(b)
	}
	return nil
}

// directMin is the shortest run of whole blocks written with O_DIRECT.
// Large runs are streaming data, where copying into the host page cache
// and writing it back later costs more host CPU than the guest's transfer
// (the CPU the guest's own vCPU competes for); small ones (metadata,
// journal, small files) stay buffered, so a guest that drops its caches
// re-reads them from the host's.
const directMin = 64 << 10

// writeRun writes n bytes of whole blocks: with O_DIRECT when the run is
// large and the buffers allow it, buffered otherwise.
func (d *Device) writeRun(iov []unix.Iovec, off, n int64) error {
	if n >= directMin && d.directOK(iov, off) {
		w, err := iovec.Pwritev(int(d.direct.Fd()), &iov, off)
		if err == nil {
			d.directWrites.Add(1)
			return nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		// The filesystem refused this alignment after all: stop trying.
		d.noDirect.Store(true)
		off += w
	}
	_, err := iovec.Pwritev(int(d.ov.Fd()), &iov, off)
	return err
}

// directOK reports whether iov at off meets the overlay file's O_DIRECT
// alignment: every buffer's address and length, and the offset.
func (d *Device) directOK(iov []unix.Iovec, off int64) bool {
	if d.direct == nil || d.noDirect.Load() || uintptr(off)&(d.offAlign-1) != 0 {
		return false
	}
	for _, v := range iov {
		if uintptr(unsafe.Pointer(v.Base))&(d.memAlign-1) != 0 || uintptr(v.Len)&(d.offAlign-1) != 0 {
			return false
		}
	}
	return true
}

// openDirect opens a second, O_DIRECT descriptor on the overlay for
// aligned whole-block writes, if the filesystem supports direct I/O with
// alignments the block size satisfies; without it all writes are buffered.
func (d *Device) openDirect(path string) {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		return // e.g. EINVAL: no O_DIRECT on this filesystem
	}
	// Without STATX_DIOALIGN (kernels before 6.1), assume the largest
	// common logical block size.
	memAlign, offAlign := uint32(4096), uint32(4096)
	var stx unix.Statx_t
	if unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &stx) == nil && stx.Mask&unix.STATX_DIOALIGN != 0 {
		memAlign, offAlign = stx.Dio_mem_align, stx.Dio_offset_align
	}
	pow2 := func(v uint32) bool { return v != 0 && v&(v-1) == 0 }
	if !pow2(memAlign) || !pow2(offAlign) || int64(offAlign) > d.blockSize {
		f.Close()
		return
	}
	d.direct, d.memAlign, d.offAlign = f, uintptr(memAlign), uintptr(offAlign)
}

// partial updates [at, at+m) of block b with the next m bytes of src; src nil means zeros.
func (d *Device) partial(b uint64, at, m int64, src *iovec.Cursor) error {
	bp := d.scratch.Get().(*[]byte)
	defer d.scratch.Put(bp)
	span := d.blockSpan(b)
	buf := (*bp)[:span]
	start := int64(b) << d.shift

	d.lockBlocks(b, b)
	defer d.unlockBlocks(b, b)
	var err error
	if d.dirty(b) {
		err = readFull(d.ov, buf, start)
	} else {
		err = readFull(d.base, buf, start)
	}
	if err != nil {
		return fmt.Errorf("overlay: read block %d below a partial write: %w", b, err)
	}
	if src != nil {
		src.CopyOut(buf[at : at+m])
	} else {
		clear(buf[at : at+m])
	}
	if _, err := d.ov.WriteAt(buf, start); err != nil {
		return fmt.Errorf("overlay: write block %d: %w", b, err)
	}
	d.written.Store(true)
	d.markDirty(b)
	return nil
}

// zeroRange zeroes overlay bytes, preferring to keep (zero) or drop (punch)
// the allocation, and falling back to what the filesystem supports.
func (d *Device) zeroRange(off, n int64, punch bool) error {
	if !punch {
		err := fallocate(d.ov, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		if !errors.Is(err, unix.EOPNOTSUPP) {
			return err
		}
	}
	err := fallocate(d.ov, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if !errors.Is(err, unix.EOPNOTSUPP) {
		return err
	}
	bp := d.scratch.Get().(*[]byte)
	defer d.scratch.Put(bp)
	zero := *bp
	clear(zero)
	for n > 0 {
		m := min(n, int64(len(zero)))
		if _, err := d.ov.WriteAt(zero[:m], off); err != nil {
			return fmt.Errorf("write zeros: %w", err)
		}
		off += m
		n -= m
	}
	return nil
}

func fallocate(f *os.File, mode uint32, off, n int64) error {
	for {
		err := unix.Fallocate(int(f.Fd()), mode, off, n)
		if err != unix.EINTR {
			if err != nil {
				return fmt.Errorf("fallocate mode %#x: %w", mode, err)
			}
			return nil
		}
	}
}

// Flush makes every completed write durable: first the overlay data, then
// the bitmap pages that gained bits, each fdatasync'ed in that order.
func (d *Device) Flush() error {
	if d.closed.Load() {
		return ErrClosed
	}
	if d.readOnly || d.ov == nil {
		return nil
	}
	d.flushMu.Lock()
	defer d.flushMu.Unlock()
	return d.flushLocked()
}

// poisoned returns ErrPoisoned with the failure behind it, or nil.
func (d *Device) poisoned() error {
	if p := d.poison.Load(); p != nil {
		return fmt.Errorf("%w: %w", ErrPoisoned, *p)
	}
	return nil
}

// flushLocked flushes, and poisons the device when that fails.
func (d *Device) flushLocked() error {
	if err := d.poisoned(); err != nil {
		return err
	}
	err := d.flushOnce()
	if err != nil {
		d.poison.CompareAndSwap(nil, &err)
	}
	return err
}

func (d *Device) flushOnce() error {
	// Snapshot changed pages before syncing data: any bit copied here belongs
	// to data already written, which the fdatasync below then covers.
	var pages []int
	var bufs [][]byte
	var words [pageWords]uint64
	for i := range d.changed {
		if !d.changed[i].Swap(false) {
			continue
		}
		lo := i * pageWords
		hi := min(lo+pageWords, len(d.words))
		for w := lo; w < hi; w++ {
			words[w-lo] = d.words[w].Load()
		}
		buf := make([]byte, bitmapPageSize)
		encodePage(buf, uint32(i), words[:hi-lo])
		pages = append(pages, i)
		bufs = append(bufs, buf)
	}
	// A failure poisons the device, so the pages' changed flags need not be
	// restored: no later Flush runs.
	if d.written.Swap(false) || len(pages) > 0 {
		if err := d.datasync(d.ov); err != nil {
			return fmt.Errorf("overlay: fdatasync overlay: %w", err)
		}
	}
	if len(pages) == 0 {
		return nil
	}
	for k, i := range pages {
		if _, err := d.bm.WriteAt(bufs[k], headerRegion+int64(i)*bitmapPageSize); err != nil {
			return fmt.Errorf("overlay: write bitmap: %w", err)
		}
	}
	if err := d.datasync(d.bm); err != nil {
		return fmt.Errorf("overlay: fdatasync bitmap: %w", err)
	}
	d.bitmapSyncs.Add(1)
	return nil
}

// DirtyRanges lists the block ranges the guest changed (written, discarded or zeroed).
func (d *Device) DirtyRanges() []Range {
	var out []Range
	var cur Range
	in := false
	for b := uint64(0); b < d.nblocks; {
		w := d.words[b/64].Load()
		if w == 0 && b%64 == 0 {
			if in {
				out = append(out, cur)
				in = false
			}
			b += 64
			continue
		}
		if w&(1<<(b%64)) != 0 {
			if !in {
				cur = Range{Start: b}
				in = true
			}
			cur.Count++
		} else if in {
			out = append(out, cur)
			in = false
		}
		b++
	}
	if in {
		out = append(out, cur)
	}
	return out
}

// Close flushes and releases the files; the device is unusable afterwards.
func (d *Device) Close() error {
	if d.closed.Swap(true) {
		return nil
	}
	var err error
	if !d.readOnly && d.ov != nil {
		d.flushMu.Lock()
		err = d.flushLocked()
		d.flushMu.Unlock()
	}
	if cerr := d.closeFiles(); err == nil {
		err = cerr
	}
	return err
}

func (d *Device) closeFiles() error {
	var err error
	for _, f := range []*os.File{d.ov, d.bm, d.direct} {
		if f != nil {
			if cerr := f.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("overlay: close: %w", cerr)
			}
		}
	}
	return err
}
