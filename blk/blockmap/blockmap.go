// Package blockmap maps the blocks of a synthesized disk to where their
// bytes live: the metadata file, a file in a content source, or nowhere
// (they read as zeros). It stores source ids and offsets only; opening a
// source is the reader's business (see index.Opener).
package blockmap

import (
	"errors"
	"fmt"
	"math/bits"
)

// Kind says what a block range holds.
type Kind uint8

// Block range kinds. The values are part of the encoded format.
const (
	// Free blocks are unallocated in the filesystem and read as zeros.
	Free Kind = iota
	// Zero blocks are allocated (inode tables past the last used inode, the
	// journal) but their content is all zeros, so nothing is stored.
	Zero
	// Meta blocks are stored in the metadata file at Location.Offset.
	Meta
	// Data blocks are file content at Location in a content source.
	Data
)

// String names the kind for logs and manifests.
func (k Kind) String() string {
	switch k {
	case Free:
		return "free"
	case Zero:
		return "zero"
	case Meta:
		return "meta"
	case Data:
		return "data"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Location is where an extent's first byte lives.
type Location struct {
	Source uint32 // index into index.Index.Sources (Data only)
	Path   string // file path within a directory source (Data only)
	Offset int64  // byte offset in the source file, blob or metadata file
}

// Extent is a run of blocks with one kind and one contiguous location.
type Extent struct {
	First uint64 // first block
	Count uint64 // number of blocks, > 0
	Kind  Kind
	Loc   Location
	// Bytes is how many bytes from the extent's start come from Loc; the
	// rest of the extent reads as zeros (the tail of a file's last block).
	Bytes uint64
}

// End is the block after the extent.
func (e *Extent) End() uint64 { return e.First + e.Count }

// Map is an immutable, sorted list of non-overlapping extents over a disk
// of Blocks blocks; blocks no extent covers are Free.
type Map struct {
	blockSize uint32
	blocks    uint64
	exts      []Extent
	ends      []uint64 // exts[i].End(), searched instead of exts to stay in cache
	view      *view    // set instead of exts and ends for a map read in place (View)
}

// index fills ends once the extents are final.
func (m *Map) index() {
	m.ends = make([]uint64, len(m.exts))
	for i := range m.exts {
		m.ends[i] = m.exts[i].End()
	}
}

// BlockSize is the size of a block in bytes.
func (m *Map) BlockSize() uint32 { return m.blockSize }

// Blocks is the number of blocks of the disk.
func (m *Map) Blocks() uint64 { return m.blocks }

// Len is the number of stored (non-free) extents.
func (m *Map) Len() int {
	if m.view != nil {
		return m.view.n
	}
	return len(m.exts)
}

// At returns the i-th stored extent in block order.
func (m *Map) At(i int) Extent {
	if m.view != nil {
		if i < 0 || i >= m.view.n {
			panic(fmt.Sprintf("blockmap: extent %d of %d", i, m.view.n))
		}
		return m.view.at(i)
	}
	return m.exts[i]
}

// end is extent i's End.
func (m *Map) end(i int) uint64 {
	if m.view != nil {
		return m.view.end(i)
	}
	return m.ends[i]
}

// Lookup returns the kind, location and extent of the range that holds
// block. For Free ranges and blocks past the end the extent spans the gap
// (Count 0 past the end). It does not allocate.
func (m *Map) Lookup(block uint64) (Kind, Location, Extent) {
	n := m.Len()
	lo, hi := 0, n
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if m.end(mid) <= block {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo < n {
		if e := m.At(lo); e.First <= block {
			return e.Kind, e.Loc, e
		}
	}
	if block >= m.blocks {
		return Free, Location{}, Extent{First: block, Kind: Free}
	}
	start := uint64(0)
	if lo > 0 {
		start = m.end(lo - 1)
	}
	end := m.blocks
	if lo < n {
		end = m.At(lo).First
	}
	return Free, Location{}, Extent{First: start, Count: end - start, Kind: Free}
}

// Builder accumulates extents in block order.
type Builder struct {
	m   Map
	err error
}

// NewBuilder starts a map of blocks blocks of blockSize bytes.
func NewBuilder(blockSize uint32, blocks uint64) *Builder {
	return &Builder{m: Map{blockSize: blockSize, blocks: blocks}}
}

// ErrOrder reports an extent added out of order or overlapping another.
var ErrOrder = errors.New("blockmap: extent out of order or overlapping")

// Add appends e, which must start at or after the end of the previous
// extent. Adjacent Zero extents, and Meta or Data extents continuing the
// previous one's location byte for byte, are merged.
func (b *Builder) Add(e Extent) {
	if b.err != nil {
		return
	}
	if err := b.m.check(&e); err != nil {
		b.err = err
		return
	}
	if n := len(b.m.exts); n > 0 {
		p := &b.m.exts[n-1]
		if e.First < p.End() {
			b.err = fmt.Errorf("%w: block %d before %d", ErrOrder, e.First, p.End())
			return
		}
		if p.End() == e.First && p.Kind == e.Kind && b.mergeable(p, &e) {
			p.Count += e.Count
			if e.Kind != Zero {
				p.Bytes += e.Bytes
			}
			return
		}
	}
	b.m.exts = append(b.m.exts, e)
}

func (b *Builder) mergeable(p, e *Extent) bool {
	if e.Kind == Zero {
		return true
	}
	bs := uint64(b.m.blockSize)
	return p.Bytes == p.Count*bs && p.Loc.Source == e.Loc.Source && p.Loc.Path == e.Loc.Path &&
		p.Loc.Offset+int64(p.Bytes) == e.Loc.Offset
}

// check validates one extent against the map's geometry.
func (m *Map) check(e *Extent) error {
	if e.Count == 0 {
		return fmt.Errorf("blockmap: empty extent at block %d", e.First)
	}
	end, carry := bits.Add64(e.First, e.Count, 0)
	if carry != 0 || end > m.blocks {
		return fmt.Errorf("blockmap: extent %d+%d beyond %d blocks", e.First, e.Count, m.blocks)
	}
	switch e.Kind {
	case Zero:
		if e.Bytes != 0 || e.Loc != (Location{}) {
			return fmt.Errorf("blockmap: zero extent at block %d has a location", e.First)
		}
	case Meta, Data:
		hi, lo := bits.Mul64(e.Count, uint64(m.blockSize))
		if hi != 0 || e.Bytes > lo {
			return fmt.Errorf("blockmap: extent at block %d has %d bytes for %d blocks", e.First, e.Bytes, e.Count)
		}
		if e.Loc.Offset < 0 || uint64(e.Loc.Offset)+e.Bytes < e.Bytes || uint64(e.Loc.Offset)+e.Bytes > 1<<63-1 {
			return fmt.Errorf("blockmap: extent at block %d has bad offset %d", e.First, e.Loc.Offset)
		}
		if e.Kind == Meta && (e.Loc.Source != 0 || e.Loc.Path != "") {
			return fmt.Errorf("blockmap: meta extent at block %d names a source", e.First)
		}
	default:
		return fmt.Errorf("blockmap: extent at block %d has kind %v", e.First, e.Kind)
	}
	return nil
}

// Map returns the finished map, or the first error Add met.
func (b *Builder) Map() (*Map, error) {
	if b.err != nil {
		return nil, b.err
	}
	m := b.m
	m.index()
	return &m, nil
}
