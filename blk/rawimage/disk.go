// Package rawimage serves the raw bytes of a synthesized disk image: its
// block map says which blocks are stored in the metadata file, which live
// in content sources opened through an index.Opener, and which read as
// zeros. It is named for what it serves, not for ext4: it never parses the
// filesystem, so the format package stays free of run-time I/O and any
// format that produces a block map and a metadata file can be served.
package rawimage

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/iovec"
)

// maxOpenSources bounds the content files a Disk keeps open.
const maxOpenSources = 256

// Image is a synthesized image as a Disk reads it; *ext4.Image is one.
type Image interface {
	// BlockMap says where each block's bytes come from.
	BlockMap() *blockmap.Map
	// Meta holds the bytes of the map's Meta extents.
	Meta() io.ReaderAt
	// Sources is the table the Source ids of Data extents index.
	Sources() []index.Source
}

// Disk serves the raw bytes of an image: metadata blocks from the metadata
// file, data blocks through an index.Opener, zeros elsewhere. It is safe
// for concurrent use; the block device reads through it.
type Disk struct {
	m       *blockmap.Map
	meta    io.ReaderAt
	sources []index.Source
	opener  index.Opener
	size    int64

	iovs sync.Pool // *[]unix.Iovec, for ReadVecAt

	// mu guards the table of open sources; it is taken with no other lock
	// held and never held across an open or a read (see acquire), only
	// across closing an evicted source. A read of a source being opened
	// waits on its ready channel, unlocked, for that open alone.
	mu     sync.Mutex
	open   map[sourceKey]*openSource
	order  []sourceKey // insertion order, for eviction
	closed bool
}

type sourceKey struct {
	src  uint32
	path string
}

// openSource is a cached reader; it is closed when evicted and unused.
// It is in the cache from the moment its open starts: ready is closed
// once r or err is set, and until then readers of the same file wait on
// ready, not on the Disk's lock.
type openSource struct {
	ready   chan struct{}
	r       io.ReaderAt
	err     error
	refs    int
	evicted bool
}

// ErrShortSource reports a content source with fewer bytes than the index
// promised, so the image can no longer be served faithfully.
var ErrShortSource = errors.New("rawimage: content source shorter than indexed")

// New returns a reader over img's raw bytes that opens content through opener.
func New(img Image, opener index.Opener) *Disk {
	m := img.BlockMap()
	d := &Disk{m: m, meta: img.Meta(), sources: img.Sources(), opener: opener,
		size: int64(m.Blocks()) * int64(m.BlockSize()), open: make(map[sourceKey]*openSource)}
	d.iovs.New = func() any { v := make([]unix.Iovec, 0, 64); return &v }
	return d
}

// Size is the size of the disk in bytes.
func (d *Disk) Size() int64 { return d.size }

// ReadAt reads the disk's bytes at off.
func (d *Disk) ReadAt(p []byte, off int64) (int, error) {
	one := [1][]byte{p}
	return d.ReadVecAt(one[:], off)
}

// reader returns what holds an extent's bytes: the metadata file, or the
// content source (acquired: hand s to release when done).
func (d *Disk) reader(kind blockmap.Kind, loc blockmap.Location) (r io.ReaderAt, s *openSource, err error) {
	if kind == blockmap.Meta {
		return d.meta, nil, nil
	}
	s, err = d.acquire(sourceKey{loc.Source, loc.Path})
	if err != nil {
		return nil, nil, err
	}
	return s.r, s, nil
}

// shortRead explains a read of want bytes at off that returned got.
func shortRead(loc blockmap.Location, off, got, want int64, err error) error {
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: %s at %d: got %d of %d bytes", ErrShortSource, loc.Path, off, got, want)
	}
	return fmt.Errorf("rawimage: read %s: %w", loc.Path, err)
}

// ReadVecAt fills bufs, in order, with the disk's bytes at off, as ReadAt
// would their concatenation, with one preadv per extent whose content is
// a file: a guest read of many pages costs a system call per extent, not
// per page.
func (d *Disk) ReadVecAt(bufs [][]byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("rawimage: negative offset %d", off)
	}
	var total int64
	for _, b := range bufs {
		total += int64(len(b))
	}
	bs := int64(d.m.BlockSize())
	src := iovec.NewCursor(bufs)
	var done int64
	for done < total {
		pos := off + done
		if pos >= d.size {
			return int(done), io.EOF
		}
		kind, loc, ext := d.m.Lookup(uint64(pos / bs))
		start := int64(ext.First) * bs
		n := min(total-done, int64(ext.First+ext.Count)*bs-pos)
		if err := d.readExtentVec(kind, loc, ext, pos-start, n, &src); err != nil {
			return int(done), err
		}
		done += n
	}
	return int(done), nil
}

// readExtentVec fills the cursor's next n bytes with the bytes at rel within extent ext.
func (d *Disk) readExtentVec(kind blockmap.Kind, loc blockmap.Location, ext blockmap.Extent, rel, n int64, src *iovec.Cursor) error {
	valid := int64(0)
	if kind == blockmap.Meta || kind == blockmap.Data {
		valid = max(0, min(n, int64(ext.Bytes)-rel))
	}
	if valid > 0 {
		r, s, err := d.reader(kind, loc)
		if err != nil {
			return err
		}
		defer d.release(s)
		if got, err := d.readVec(r, src, loc.Offset+rel, valid); got != valid {
			return shortRead(loc, loc.Offset+rel, got, valid, err)
		}
	}
	src.Zero(n - valid)
	return nil
}

// fileReader is a reader backed by a file descriptor (*os.File).
type fileReader interface {
	Fd() uintptr
}

// readVec fills the cursor's next n bytes from r at off: one preadv when r
// is a file, one ReadAt per buffer otherwise.
func (d *Disk) readVec(r io.ReaderAt, src *iovec.Cursor, off, n int64) (int64, error) {
	if f, ok := r.(fileReader); ok {
		iovp := d.iovs.Get().(*[]unix.Iovec)
		full := src.Iovecs((*iovp)[:0], n)
		iov := full
		got, err := iovec.Preadv(int(f.Fd()), &iov, off)
		clear(full) // drop the references to the caller's buffers
		*iovp = full[:0]
		d.iovs.Put(iovp)
		return got, err
	}
	var got int64
	for got < n {
		b := src.Next(n - got)
		m, err := r.ReadAt(b, off+got)
		got += int64(m)
		if m < len(b) {
			return got, err
		}
	}
	return got, nil
}

// acquire returns the open source for k, opening it if needed. The open
// itself runs without d.mu: a host open can block (a hung network file
// system, a file swapped for something slow), and under the lock it would
// stall every read of the disk, not only those of that file.
func (d *Disk) acquire(k sourceKey) (*openSource, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, errors.New("rawimage: disk closed")
	}
	if s := d.open[k]; s != nil {
		s.refs++
		d.mu.Unlock()
		<-s.ready
		if s.err != nil {
			d.release(s)
			return nil, s.err
		}
		return s, nil
	}
	srcs := d.sources
	if int(k.src) >= len(srcs) {
		d.mu.Unlock()
		return nil, fmt.Errorf("rawimage: block map names source %d of %d", k.src, len(srcs))
	}
	s := &openSource{ready: make(chan struct{}), refs: 1}
	d.open[k] = s
	d.order = append(d.order, k)
	d.evictLocked()
	d.mu.Unlock()

	r, err := d.opener.Open(srcs[k.src], k.path)

	d.mu.Lock()
	s.r = r
	if err != nil {
		s.err = fmt.Errorf("rawimage: open %s: %w", k.path, err)
		// A failed open is not cached: the next read tries again.
		if d.open[k] == s {
			delete(d.open, k)
			if i := slices.Index(d.order, k); i >= 0 {
				d.order = slices.Delete(d.order, i, i+1)
			}
		}
		s.evicted = true
	}
	close(s.ready)
	d.mu.Unlock()
	if s.err != nil {
		d.release(s)
		return nil, s.err
	}
	return s, nil
}

// evictLocked drops the oldest sources beyond maxOpenSources; one still in
// use (or still opening) is closed by its last release.
func (d *Disk) evictLocked() {
	for len(d.order) > maxOpenSources {
		old := d.order[0]
		d.order = d.order[1:]
		o := d.open[old]
		delete(d.open, old)
		o.evicted = true
		if o.refs == 0 {
			closeReader(o.r)
		}
	}
}

func (d *Disk) release(s *openSource) {
	if s == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	s.refs--
	if s.refs == 0 && s.evicted {
		closeReader(s.r)
	}
}

// Close closes the content files the disk opened.
func (d *Disk) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	for _, s := range d.open {
		s.evicted = true
		if s.refs == 0 {
			closeReader(s.r)
		}
	}
	clear(d.open)
	d.order = nil
	return nil
}

func closeReader(r io.ReaderAt) {
	if c, ok := r.(io.Closer); ok && r != nil {
		c.Close()
	}
}
