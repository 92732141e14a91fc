package lazyindex

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
)

// stream is the uncompressed bytes of a gzip layer (one or more members),
// decoded either from the start while recording checkpoints (the indexing
// pass, which also checks every member's CRC-32 and ISIZE) or from a
// checkpoint (a range read, which cannot check them: the member's start is
// not decoded).
type stream struct {
	br  *bitReader
	f   *inflater
	rd  int   // next unread byte in f.buf
	err error // sticky; returned once the decoded bytes are read

	raw    bool // a bare deflate stream, no gzip framing
	verify bool
	crc    hash.Hash32
	isize  uint32
	member int

	span   int64 // checkpoint span, 0 when not indexing
	lastCP int64
	cps    []Checkpoint
	budget int64 // bytes the checkpoints may still take

	// ctx, for a range read, ends the decoding: it is looked at once
	// every ctxCheckBytes of output or ctxCheckSteps decoder steps (a
	// run of empty blocks produces no output), not per step, so the hot
	// loop pays one comparison.
	ctx       context.Context
	nextCheck int64 // f.total at which ctx is looked at next
	steps     int   // decoder steps since ctx was looked at
}

// How often a range read's context is looked at while inflating.
const (
	ctxCheckBytes = 256 << 10
	ctxCheckSteps = 1024
)

// newBitReader reads r, through a bufio.Reader unless r reads bytes itself.
func newBitReader(r io.Reader) *bitReader {
	if b, ok := r.(*bufio.Reader); ok {
		return &bitReader{r: b, bf: b}
	}
	if b, ok := r.(io.ByteReader); ok {
		return &bitReader{r: b}
	}
	b := bufio.NewReaderSize(r, 64<<10)
	return &bitReader{r: b, bf: b}
}

// newIndexingStream decodes a gzip layer from its first byte, recording a
// checkpoint at least every span bytes of output.
func newIndexingStream(r io.Reader, span, budget int64) (*stream, error) {
	br := newBitReader(r)
	s := &stream{br: br, f: newInflater(br), verify: true, crc: crc32.NewIEEE(), span: span, budget: budget}
	if err := s.readHeader(); err != nil {
		return nil, err
	}
	return s, nil
}

// readHeader reads a gzip member header (RFC 1952 2.3): the magic, method
// 8, and the optional FEXTRA, FNAME, FCOMMENT and FHCRC fields.
func (s *stream) readHeader() error {
	var h [10]byte
	for i := range h {
		c, err := s.br.readByte()
		if err != nil {
			return s.headerErr(err)
		}
		h[i] = c
	}
	if h[0] != 0x1f || h[1] != 0x8b {
		return fmt.Errorf("gzip member %d at byte %d: bad magic %#x %#x", s.member, s.br.n-10, h[0], h[1])
	}
	if h[2] != 8 {
		return fmt.Errorf("gzip member %d: compression method %d, only 8 (deflate) exists", s.member, h[2])
	}
	flg := h[3]
	if flg&0xe0 != 0 {
		return fmt.Errorf("gzip member %d: reserved header flags %#x set", s.member, flg)
	}
	if flg&4 != 0 { // FEXTRA
		lo, err := s.br.readByte()
		if err != nil {
			return s.headerErr(err)
		}
		hi, err := s.br.readByte()
		if err != nil {
			return s.headerErr(err)
		}
		for n := int(lo) | int(hi)<<8; n > 0; n-- {
			if _, err := s.br.readByte(); err != nil {
				return s.headerErr(err)
			}
		}
	}
	for _, bit := range []byte{8, 16} { // FNAME, FCOMMENT: zero-terminated
		if flg&bit == 0 {
			continue
		}
		for {
			c, err := s.br.readByte()
			if err != nil {
				return s.headerErr(err)
			}
			if c == 0 {
				break
			}
		}
	}
	if flg&2 != 0 { // FHCRC: the header's CRC-16, not checked (nor by compress/gzip's callers)
		for i := 0; i < 2; i++ {
			if _, err := s.br.readByte(); err != nil {
				return s.headerErr(err)
			}
		}
	}
	s.f.reset()
	s.crc.Reset()
	s.isize = 0
	return nil
}

func (s *stream) headerErr(err error) error {
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("gzip member %d header: %w", s.member, err)
}

// endMember reads a member's trailer and the next member's header; it
// returns io.EOF at the end of the layer.
func (s *stream) endMember() error {
	s.br.alignByte()
	var t [8]byte
	for i := range t {
		c, err := s.br.readByte()
		if err != nil {
			return fmt.Errorf("gzip member %d trailer: %w", s.member, s.headerErr(err))
		}
		t[i] = c
	}
	if s.verify {
		if got, want := s.crc.Sum32(), binary.LittleEndian.Uint32(t[:4]); got != want {
			return fmt.Errorf("gzip member %d: CRC-32 %#08x of the data, trailer says %#08x", s.member, got, want)
		}
		if got, want := s.isize, binary.LittleEndian.Uint32(t[4:]); got != want {
			return fmt.Errorf("gzip member %d: %d bytes mod 2^32 of data, trailer says %d", s.member, got, want)
		}
	}
	s.member++
	// The layer ends at EOF exactly; anything else must be another member.
	if s.br.nb == 0 {
		s.br.refill()
	}
	if s.br.nb == 0 {
		if s.br.err == io.EOF {
			return io.EOF
		}
		return fmt.Errorf("after gzip member %d: %w", s.member-1, s.br.err)
	}
	s.verify = true
	if err := s.readHeader(); err != nil {
		return fmt.Errorf("the bytes after gzip member %d are not another member: %w", s.member-1, err)
	}
	return nil
}

// advance decodes more output or moves past a member boundary.
func (s *stream) advance() error {
	f := s.f
	if f.state == stEnd {
		if s.raw {
			return io.EOF
		}
		return s.endMember()
	}
	max := outChunk
	if s.span > 0 {
		left := s.span - (f.total - s.lastCP)
		if len(s.cps) == 0 || left < maxMatch {
			if err := s.checkpoint(); err != nil {
				return err
			}
			left = s.span
		}
		max = int(min(int64(max), left))
	}
	before := f.n
	err := f.step(max)
	if f.n > before {
		if s.verify {
			s.crc.Write(f.buf[before:f.n])
		}
		s.isize += uint32(f.n - before)
	}
	return err
}

// checkpoint records where decoding can resume at the current position.
func (s *stream) checkpoint() error {
	f := s.f
	s.budget -= int64(len(f.window()) + len(f.lens) + 64)
	if s.budget < 0 {
		return fmt.Errorf("the checkpoints up to offset %d exceed the index's memory budget: raise the checkpoint span or the budget", f.total)
	}
	cp := Checkpoint{In: s.br.bitOffset(), Out: f.total, Final: f.final, Window: append([]byte(nil), f.window()...)}
	switch f.state {
	case stHeader:
		cp.Kind = KindBlock
		cp.Final = false
	case stStored:
		cp.Kind = KindStored
		cp.Stored = f.stored
	case stHuffman:
		cp.Kind = KindHuffman
		if f.nlit != 288 {
			cp.NLit = f.nlit
			cp.Lens = append([]uint8(nil), f.lens...)
		}
	}
	s.cps = append(s.cps, cp)
	s.lastCP = f.total
	return nil
}

func (s *stream) Read(p []byte) (int, error) {
	for s.rd == s.f.n {
		if s.err != nil {
			return 0, s.err
		}
		if s.ctx != nil {
			if s.steps++; s.f.total >= s.nextCheck || s.steps >= ctxCheckSteps {
				if err := s.ctx.Err(); err != nil {
					s.err = fmt.Errorf("inflate stopped at offset %d: %w", s.f.total, err)
					return 0, s.err
				}
				s.steps, s.nextCheck = 0, s.f.total+ctxCheckBytes
			}
		}
		s.rd -= s.f.slide(s.rd)
		s.err = s.advance()
	}
	n := copy(p, s.f.buf[s.rd:s.f.n])
	s.rd += n
	return n, nil
}

// newResumeStream decodes from checkpoint cp; r yields the compressed
// layer's bytes from cp's byte (cp.In/8) on.
func newResumeStream(cp *Checkpoint, r io.Reader, isGzip bool) (*stream, error) {
	br := newBitReader(r)
	br.n = cp.In / 8
	if k := uint(cp.In % 8); k > 0 {
		if _, err := br.bits(k); err != nil {
			return nil, fmt.Errorf("checkpoint at bit %d: %w", cp.In, err)
		}
	}
	f := newInflater(br)
	f.n = copy(f.buf, cp.Window)
	f.total = cp.Out
	f.final = cp.Final
	switch cp.Kind {
	case KindBlock:
		f.state = stHeader
	case KindStored:
		f.state = stStored
		f.stored = cp.Stored
	case KindHuffman:
		f.state = stHuffman
		if cp.Lens == nil {
			f.lens = append(f.lens[:0], fixedLens()...)
			f.nlit = 288
		} else {
			f.lens = append(f.lens[:0], cp.Lens...)
			f.nlit = cp.NLit
		}
		if err := f.buildTables(); err != nil {
			return nil, fmt.Errorf("checkpoint at bit %d: %w", cp.In, err)
		}
	default:
		return nil, fmt.Errorf("checkpoint at bit %d: unknown kind %d", cp.In, cp.Kind)
	}
	return &stream{br: br, f: f, rd: f.n, crc: crc32.NewIEEE(), raw: !isGzip}, nil
}
