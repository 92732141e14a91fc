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
type openSource struct {
	r       io.ReaderAt
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

func (d *Disk) acquire(k sourceKey) (*openSource, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, errors.New("rawimage: disk closed")
	}
	if s := d.open[k]; s != nil {
		s.refs++
		return s, nil
	}
	srcs := d.sources
	if int(k.src) >= len(srcs) {
		return nil, fmt.Errorf("rawimage: block map names source %d of %d", k.src, len(srcs))
	}
	r, err := d.opener.Open(srcs[k.src], k.path)
	if err != nil {
		return nil, fmt.Errorf("rawimage: open %s: %w", k.path, err)
	}
	s := &openSource{r: r, refs: 1}
	d.open[k] = s
	d.order = append(d.order, k)
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
	return s, nil
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
	if c, ok := r.(io.Closer); ok {
		c.Close()
	}
}
