package blockmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
	"unsafe"
)

// File format (little-endian):
//
//	magic "KFSXBMAP" | version u32 | block size u32 | blocks u64 |
//	paths u32 | extents u64 | paths: (len u32, bytes)... |
//	extents: (first u64, count u64, kind u8, source u32, path u32, offset i64, bytes u64)... |
//	crc32c of everything before u32
//
// Path index noPath means an empty path.
const (
	magic         = "KFSXBMAP"
	version       = 1
	headerSize    = 8 + 4 + 4 + 8 + 4 + 8
	extentRecSize = 8 + 8 + 1 + 4 + 4 + 8 + 8
	noPath        = ^uint32(0)
	maxPathLen    = 1 << 16
)

// ErrFormat reports an encoded map that is malformed or corrupt.
var ErrFormat = errors.New("blockmap: bad encoding")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// MarshalBinary encodes the map.
func (m *Map) MarshalBinary() ([]byte, error) {
	if m.view != nil {
		return append([]byte(nil), m.view.enc...), nil
	}
	pathIdx := make(map[string]uint32)
	var paths []string
	for i := range m.exts {
		p := m.exts[i].Loc.Path
		if _, ok := pathIdx[p]; p != "" && !ok {
			if len(p) > maxPathLen {
				return nil, fmt.Errorf("blockmap: path of %d bytes is too long", len(p))
			}
			pathIdx[p] = uint32(len(paths))
			paths = append(paths, p)
		}
	}
	size := headerSize + len(m.exts)*extentRecSize + 4
	for _, p := range paths {
		size += 4 + len(p)
	}
	le := binary.LittleEndian
	b := make([]byte, 0, size)
	b = append(b, magic...)
	b = le.AppendUint32(b, version)
	b = le.AppendUint32(b, m.blockSize)
	b = le.AppendUint64(b, m.blocks)
	b = le.AppendUint32(b, uint32(len(paths)))
	b = le.AppendUint64(b, uint64(len(m.exts)))
	for _, p := range paths {
		b = le.AppendUint32(b, uint32(len(p)))
		b = append(b, p...)
	}
	for i := range m.exts {
		e := &m.exts[i]
		pi := noPath
		if e.Loc.Path != "" {
			pi = pathIdx[e.Loc.Path]
		}
		b = le.AppendUint64(b, e.First)
		b = le.AppendUint64(b, e.Count)
		b = append(b, byte(e.Kind))
		b = le.AppendUint32(b, e.Loc.Source)
		b = le.AppendUint32(b, pi)
		b = le.AppendUint64(b, uint64(e.Loc.Offset))
		b = le.AppendUint64(b, e.Bytes)
	}
	return le.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// View parses an encoded map that stays in b (typically a read-only
// file mapping), trusting nothing in it: its Lookup and At read the
// extent records and paths straight from b, so a map costs the process a
// few bytes of heap whatever its size, and every process mapping one file
// shares its pages. b must stay unchanged and mapped while the map, or any
// Location's Path it returned, is in use.
func View(b []byte) (*Map, error) {
	return parse(b, true)
}

func parse(b []byte, inPlace bool) (*Map, error) {
	if len(b) < headerSize+4 {
		return nil, fmt.Errorf("%w: %d bytes is too short", ErrFormat, len(b))
	}
	le := binary.LittleEndian
	body, sum := b[:len(b)-4], le.Uint32(b[len(b)-4:])
	if string(body[:8]) != magic {
		return nil, fmt.Errorf("%w: bad magic", ErrFormat)
	}
	if got := crc32.Checksum(body, castagnoli); got != sum {
		return nil, fmt.Errorf("%w: checksum %#x, want %#x", ErrFormat, got, sum)
	}
	if v := le.Uint32(body[8:]); v != version {
		return nil, fmt.Errorf("%w: version %d not supported", ErrFormat, v)
	}
	bs := le.Uint32(body[12:])
	if bs < 512 || bs > 65536 || bs&(bs-1) != 0 {
		return nil, fmt.Errorf("%w: block size %d", ErrFormat, bs)
	}
	blocks := le.Uint64(body[16:])
	npaths := uint64(le.Uint32(body[24:]))
	nexts := le.Uint64(body[28:])
	p := body[headerSize:]
	if npaths > uint64(len(p))/4 {
		return nil, fmt.Errorf("%w: %d paths in %d bytes", ErrFormat, npaths, len(p))
	}
	// A view keeps where each path starts in b (4 bytes a path, not a
	// string header and a copy).
	var (
		paths   []string
		pathOff []uint32
	)
	if inPlace {
		pathOff = make([]uint32, npaths)
	} else {
		paths = make([]string, npaths)
	}
	path := func(i uint32) string {
		if inPlace {
			off := pathOff[i]
			return unsafe.String(&b[off], int(le.Uint32(b[off-4:])))
		}
		return paths[i]
	}
	for i := range npaths {
		if len(p) < 4 {
			return nil, fmt.Errorf("%w: truncated path table", ErrFormat)
		}
		n := uint64(le.Uint32(p))
		p = p[4:]
		if n == 0 || n > maxPathLen || n > uint64(len(p)) {
			return nil, fmt.Errorf("%w: path %d has length %d", ErrFormat, i, n)
		}
		if inPlace {
			pathOff[i] = uint32(len(body) - len(p))
		} else {
			paths[i] = string(p[:n])
		}
		p = p[n:]
	}
	if hi, lo := bits.Mul64(nexts, extentRecSize); hi != 0 || lo != uint64(len(p)) {
		return nil, fmt.Errorf("%w: %d extents do not fill %d bytes", ErrFormat, nexts, len(p))
	}
	m := &Map{blockSize: bs, blocks: blocks}
	if inPlace {
		m.view = &view{enc: b, recs: p, pathOff: pathOff, n: int(nexts)}
	} else {
		m.exts = make([]Extent, 0, nexts)
	}
	var prevEnd uint64
	for i := 0; len(p) > 0; p, i = p[extentRecSize:], i+1 {
		e := record(p)
		if pi := le.Uint32(p[21:]); pi != noPath {
			if uint64(pi) >= npaths {
				return nil, fmt.Errorf("%w: extent at block %d names path %d of %d", ErrFormat, e.First, pi, npaths)
			}
			e.Loc.Path = path(pi)
		}
		if err := m.check(&e); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrFormat, err)
		}
		if i > 0 && e.First < prevEnd {
			return nil, fmt.Errorf("%w: extent at block %d overlaps its predecessor", ErrFormat, e.First)
		}
		prevEnd = e.End()
		if !inPlace {
			m.exts = append(m.exts, e)
		}
	}
	if !inPlace {
		m.index()
	}
	return m, nil
}

// record decodes an extent record but its path.
func record(p []byte) Extent {
	le := binary.LittleEndian
	return Extent{
		First: le.Uint64(p),
		Count: le.Uint64(p[8:]),
		Kind:  Kind(p[16]),
		Loc:   Location{Source: le.Uint32(p[17:]), Offset: int64(le.Uint64(p[25:]))},
		Bytes: le.Uint64(p[33:]),
	}
}

// view is a map read from its encoding in place (see View).
type view struct {
	enc     []byte   // the whole encoding
	recs    []byte   // the extent records
	pathOff []uint32 // where each path's bytes start in enc
	n       int
}

// at decodes extent i, its path a string over enc.
func (v *view) at(i int) Extent {
	p := v.recs[i*extentRecSize:]
	e := record(p)
	if pi := binary.LittleEndian.Uint32(p[21:]); pi != noPath {
		off := v.pathOff[pi]
		e.Loc.Path = unsafe.String(&v.enc[off], int(binary.LittleEndian.Uint32(v.enc[off-4:])))
	}
	return e
}

// end is extent i's End, read without decoding the rest of it.
func (v *view) end(i int) uint64 {
	p := v.recs[i*extentRecSize:]
	return binary.LittleEndian.Uint64(p) + binary.LittleEndian.Uint64(p[8:])
}
