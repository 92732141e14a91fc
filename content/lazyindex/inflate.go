package lazyindex

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// This file is a small RFC 1951 inflater. It exists because the indexing
// pass must know where deflate blocks and symbols start (compress/flate
// does not say) and because reading a range must resume decoding in the
// middle of a block from a saved state, which no maintained pure-Go
// inflater allows. Its behaviour on corrupt input matches compress/flate's
// (same codes accepted, same limits), which the tests use as an oracle.

const (
	windowSize = 32 << 10
	maxMatch   = 258
	maxCodeLen = 15
	numLitLen  = 286 // valid literal/length symbols; 286 and 287 are refused
	numDist    = 30
	outChunk   = 64 << 10
)

// errCorrupt is wrapped by every error that says the deflate data is bad.
var errCorrupt = errors.New("corrupt deflate data")

func corruptf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errCorrupt, fmt.Sprintf(format, a...))
}

// bitReader reads deflate's LSB-first bit stream from a byte reader without
// ever reading a byte it does not need for the bits asked, so that the gzip
// trailer after the final block can be read from the same reader.
type bitReader struct {
	r   io.ByteReader
	bf  *bufio.Reader // r, when it is one: refilled eight bytes at a time
	b   uint64
	nb  uint
	n   int64 // bytes taken from r
	err error // sticky error of r (io.EOF at its end)
}

// refill tops the buffer up to at least 57 bits or what r has left.
func (br *bitReader) refill() {
	if br.bf != nil && br.nb <= 56 && br.err == nil {
		if p, _ := br.bf.Peek(8); len(p) == 8 {
			k := (64 - br.nb) / 8
			v := binary.LittleEndian.Uint64(p)
			if k < 8 {
				v &= 1<<(8*k) - 1
			}
			br.b |= v << br.nb
			br.nb += 8 * k
			br.n += int64(k)
			br.bf.Discard(int(k))
			return
		}
	}
	for br.nb <= 56 && br.err == nil {
		c, err := br.r.ReadByte()
		if err != nil {
			br.err = err
			return
		}
		br.b |= uint64(c) << br.nb
		br.nb += 8
		br.n++
	}
}

func (br *bitReader) eof() error {
	if br.err == nil || br.err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return br.err
}

func (br *bitReader) bits(n uint) (uint32, error) {
	if br.nb < n {
		br.refill()
		if br.nb < n {
			return 0, br.eof()
		}
	}
	v := uint32(br.b & (1<<n - 1))
	br.b >>= n
	br.nb -= n
	return v, nil
}

// bitOffset is the offset, in bits from the reader's start, of the next bit.
func (br *bitReader) bitOffset() int64 { return br.n*8 - int64(br.nb) }

func (br *bitReader) alignByte() {
	br.b >>= br.nb & 7
	br.nb &^= 7
}

// readByte reads one byte; the reader must be byte aligned.
func (br *bitReader) readByte() (byte, error) {
	if br.nb >= 8 {
		c := byte(br.b)
		br.b >>= 8
		br.nb -= 8
		return c, nil
	}
	if br.err != nil {
		return 0, br.err
	}
	c, err := br.r.ReadByte()
	if err != nil {
		br.err = err
		return 0, err
	}
	br.n++
	return c, nil
}

// huffman is a canonical Huffman code decoded with one table lookup of
// bits bits: entry = symbol<<4 | code length, 0 where no code starts.
type huffman struct {
	table []uint16
	bits  uint
}

// build makes the decoding table for code lengths lens. Like
// compress/flate, it accepts complete codes, a single code of length 1,
// and no codes at all (which then fails when a symbol is read).
func (h *huffman) build(lens []uint8) error {
	var count [maxCodeLen + 1]int
	max := 0
	for _, l := range lens {
		count[l]++
		if int(l) > max {
			max = int(l)
		}
	}
	h.bits = uint(max)
	if cap(h.table) < 1<<max {
		h.table = make([]uint16, 1<<maxCodeLen)
	}
	h.table = h.table[:1<<max]
	if max == 0 {
		return nil
	}
	count[0] = 0
	var next [maxCodeLen + 2]int
	code := 0
	for l := 1; l <= max; l++ {
		code = (code + count[l-1]) << 1
		next[l] = code
	}
	if end := code + count[max]; end != 1<<max && !(end == 1 && max == 1) {
		return corruptf("huffman code lengths are over-subscribed or incomplete")
	}
	clear(h.table)
	for sym, l := range lens {
		if l == 0 {
			continue
		}
		c := next[l]
		next[l]++
		r := 0
		for i := 0; i < int(l); i++ {
			r = r<<1 | (c>>i)&1
		}
		e := uint16(sym)<<4 | uint16(l)
		for j := r; j < 1<<max; j += 1 << l {
			h.table[j] = e
		}
	}
	return nil
}

func (br *bitReader) decode(h *huffman) (int, error) {
	if br.nb < h.bits {
		br.refill()
	}
	if h.bits == 0 {
		return 0, corruptf("symbol read with an empty huffman code")
	}
	e := h.table[br.b&(1<<h.bits-1)]
	l := uint(e & 15)
	if l == 0 {
		return 0, corruptf("invalid huffman code")
	}
	if l > br.nb {
		return 0, br.eof()
	}
	br.b >>= l
	br.nb -= l
	return int(e >> 4), nil
}

var (
	lenBase  = [29]uint16{3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258}
	lenExtra = [29]uint8{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0}
	distBase = [30]uint16{1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577}
	distExt  = [30]uint8{0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13}
	clOrder  = [19]uint8{16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15}
)

// fixedLens returns the code lengths of the fixed Huffman block (RFC 1951
// 3.2.6): 288 literal/length codes then 32 distance codes of length 5.
func fixedLens() []uint8 {
	l := make([]uint8, 288+32)
	for i := range l {
		switch {
		case i < 144:
			l[i] = 8
		case i < 256:
			l[i] = 9
		case i < 280:
			l[i] = 7
		case i < 288:
			l[i] = 8
		default:
			l[i] = 5
		}
	}
	return l
}

// Inflater states.
const (
	stHeader  = iota // at a block header
	stStored         // inside a stored block
	stHuffman        // inside a Huffman block, at a symbol
	stEnd            // after the final block
)

// inflater decodes one deflate stream into buf, which keeps the last
// windowSize bytes of output before the unread ones for back references.
type inflater struct {
	br     *bitReader
	buf    []byte
	n      int   // bytes in buf
	total  int64 // output produced so far, preset window excluded
	state  int
	final  bool    // the current block is the last one
	stored int     // bytes left in the current stored block
	lens   []uint8 // code lengths of the current Huffman block: nlit then ndist
	nlit   int
	lit    huffman
	dist   huffman
	// histStart is where this stream's history starts in buf: a new gzip
	// member may not refer to the previous member's output.
	histStart int
}

func newInflater(br *bitReader) *inflater {
	return &inflater{br: br, buf: make([]byte, windowSize+2*outChunk), lens: make([]uint8, 0, 320)}
}

// reset starts a new deflate stream (a new gzip member): history carries
// over in buf but may not be referenced, as a fresh stream cannot.
func (f *inflater) reset() {
	f.state = stHeader
	f.final = false
	f.histStart = f.n
}

// slide makes room for at least outChunk more bytes, keeping the window and
// the bytes from keepFrom on; it returns how far it moved them.
func (f *inflater) slide(keepFrom int) int {
	if f.n+outChunk <= len(f.buf) {
		return 0
	}
	from := min(keepFrom, f.n-windowSize)
	if from <= 0 {
		return 0
	}
	copy(f.buf, f.buf[from:f.n])
	f.n -= from
	f.histStart = max(0, f.histStart-from)
	return from
}

// window returns the up to windowSize bytes of output before the current
// position (usable history of this stream only).
func (f *inflater) window() []byte {
	start := max(f.histStart, f.n-windowSize)
	return f.buf[start:f.n]
}

// readHeader reads a block header and sets up the block.
func (f *inflater) readHeader() error {
	v, err := f.br.bits(3)
	if err != nil {
		return err
	}
	f.final = v&1 == 1
	switch v >> 1 {
	case 0:
		f.br.alignByte()
		lo, err := f.br.bits(16)
		if err != nil {
			return err
		}
		nlo, err := f.br.bits(16)
		if err != nil {
			return err
		}
		if lo != ^nlo&0xffff {
			return corruptf("stored block length %#x does not match its complement %#x", lo, nlo)
		}
		f.stored = int(lo)
		f.state = stStored
	case 1:
		f.lens = append(f.lens[:0], fixedLens()...)
		f.nlit = 288
		if err := f.buildTables(); err != nil {
			return err
		}
		f.state = stHuffman
	case 2:
		if err := f.readDynamic(); err != nil {
			return err
		}
		f.state = stHuffman
	default:
		return corruptf("reserved block type 3")
	}
	return nil
}

func (f *inflater) buildTables() error {
	if err := f.lit.build(f.lens[:f.nlit]); err != nil {
		return err
	}
	return f.dist.build(f.lens[f.nlit:])
}

func (f *inflater) readDynamic() error {
	v, err := f.br.bits(14)
	if err != nil {
		return err
	}
	nlit := int(v&31) + 257
	ndist := int(v>>5&31) + 1
	nclen := int(v>>10) + 4
	if nlit > numLitLen {
		return corruptf("%d literal/length codes, at most %d", nlit, numLitLen)
	}
	if ndist > numDist {
		return corruptf("%d distance codes, at most %d", ndist, numDist)
	}
	var cl [19]uint8
	for i := 0; i < nclen; i++ {
		x, err := f.br.bits(3)
		if err != nil {
			return err
		}
		cl[clOrder[i]] = uint8(x)
	}
	var clh huffman
	if err := clh.build(cl[:]); err != nil {
		return err
	}
	f.lens = f.lens[:0]
	for len(f.lens) < nlit+ndist {
		sym, err := f.br.decode(&clh)
		if err != nil {
			return err
		}
		if sym < 16 {
			f.lens = append(f.lens, uint8(sym))
			continue
		}
		var rep int
		var val uint8
		switch sym {
		case 16:
			if len(f.lens) == 0 {
				return corruptf("code length repeat with no previous length")
			}
			val = f.lens[len(f.lens)-1]
			x, err := f.br.bits(2)
			if err != nil {
				return err
			}
			rep = 3 + int(x)
		case 17:
			x, err := f.br.bits(3)
			if err != nil {
				return err
			}
			rep = 3 + int(x)
		default:
			x, err := f.br.bits(7)
			if err != nil {
				return err
			}
			rep = 11 + int(x)
		}
		if len(f.lens)+rep > nlit+ndist {
			return corruptf("code length repeat runs past the %d codes", nlit+ndist)
		}
		for ; rep > 0; rep-- {
			f.lens = append(f.lens, val)
		}
	}
	f.nlit = nlit
	return f.buildTables()
}

// step decodes at most max output bytes (max >= 1) and stops at a symbol
// boundary, at a block boundary or at the end of the stream. It may
// produce nothing (after a header or an end of block).
func (f *inflater) step(max int) error {
	switch f.state {
	case stHeader:
		return f.readHeader()
	case stStored:
		k := min(f.stored, max)
		for i := 0; i < k; i++ {
			c, err := f.br.readByte()
			if err != nil {
				if err == io.EOF {
					err = io.ErrUnexpectedEOF
				}
				return err
			}
			f.buf[f.n] = c
			f.n++
		}
		f.stored -= k
		f.total += int64(k)
		if f.stored == 0 {
			f.blockEnd()
		}
		return nil
	case stHuffman:
		return f.huffmanStep(max)
	}
	return io.EOF
}

func (f *inflater) blockEnd() {
	if f.final {
		f.state = stEnd
	} else {
		f.state = stHeader
	}
}

func (f *inflater) huffmanStep(max int) error {
	br := f.br
	start := f.n
	limit := f.n + max
	for f.n+maxMatch <= limit {
		sym, err := br.decode(&f.lit)
		if err != nil {
			f.total += int64(f.n - start)
			return err
		}
		if sym < 256 {
			f.buf[f.n] = byte(sym)
			f.n++
			continue
		}
		if sym == 256 {
			f.blockEnd()
			break
		}
		sym -= 257
		if sym >= 29 {
			f.total += int64(f.n - start)
			return corruptf("invalid literal/length symbol %d", sym+257)
		}
		length := int(lenBase[sym])
		if e := uint(lenExtra[sym]); e > 0 {
			x, err := br.bits(e)
			if err != nil {
				f.total += int64(f.n - start)
				return err
			}
			length += int(x)
		}
		var ds int
		if f.nlit == 288 {
			// Fixed blocks: 5-bit distance codes, as compress/flate reads them.
			x, err := br.bits(5)
			if err != nil {
				f.total += int64(f.n - start)
				return err
			}
			ds = int(reverse5(x))
		} else {
			ds, err = br.decode(&f.dist)
			if err != nil {
				f.total += int64(f.n - start)
				return err
			}
		}
		if ds >= numDist {
			f.total += int64(f.n - start)
			return corruptf("invalid distance symbol %d", ds)
		}
		dist := int(distBase[ds])
		if e := uint(distExt[ds]); e > 0 {
			x, err := br.bits(e)
			if err != nil {
				f.total += int64(f.n - start)
				return err
			}
			dist += int(x)
		}
		if dist > f.n-f.histStart || dist > windowSize {
			f.total += int64(f.n - start)
			return corruptf("distance %d reaches before the start of the output", dist)
		}
		src := f.n - dist
		if dist >= length {
			copy(f.buf[f.n:f.n+length], f.buf[src:src+length])
		} else {
			for i := 0; i < length; i++ {
				f.buf[f.n+i] = f.buf[src+i]
			}
		}
		f.n += length
	}
	f.total += int64(f.n - start)
	return nil
}

func reverse5(x uint32) uint32 {
	return (x&1)<<4 | (x&2)<<2 | x&4 | (x&8)>>2 | (x&16)>>4
}
