package lazyindex

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Encoded layout (integers little-endian or unsigned varints):
//
//	header (32 bytes): magic "KFSXLZI\n", version u32, flags u32 (zero),
//	                   payload length u64, CRC-32C of payload u32, zero u32
//	payload:           format u8, digest, diffID (length-prefixed strings),
//	                   compressed size, size, span, checkpoint count,
//	                   checkpoints, chunk size, the chunks' SHA-256
//	                   (32 bytes each, their count follows from the sizes),
//	                   tree length, tree (blk/index EncodeLayer)
//	checkpoint:        In delta, Out delta (from the previous checkpoint),
//	                   kind u8, final u8, then for KindStored the bytes
//	                   left, for KindHuffman NLit (0: fixed code) and, when
//	                   dynamic, the count and the code lengths two per
//	                   byte; then the window's length and bytes.
const (
	encMagic      = "KFSXLZI\n"
	encVersion    = 2
	encHeaderSize = 32

	// MaxEncodedSize bounds the payload Decode accepts: the tree of the
	// largest layer blk/index takes (its own MaxEncodedSize) plus windows.
	MaxEncodedSize = 1 << 32
	maxDigestLen   = 7 + 64
	// minCheckpoint is the fewest bytes an encoded checkpoint takes.
	minCheckpoint = 5
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrInvalid is wrapped by every error Decode returns for bad input.
var ErrInvalid = errors.New("invalid lazy-read index")

func invalidf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, a...))
}

// MarshalBinary returns the index's versioned binary encoding.
func (ix *Index) MarshalBinary() ([]byte, error) {
	if err := ix.Validate(); err != nil {
		return nil, err
	}
	var tree bytes.Buffer
	if err := index.EncodeLayer(&tree, ix.Tree); err != nil {
		return nil, fmt.Errorf("encode layer %s tree: %w", ix.Digest, err)
	}
	p := []byte{byte(ix.Format)}
	p = appendString(p, ix.Digest)
	p = appendString(p, ix.DiffID)
	p = binary.AppendUvarint(p, uint64(ix.CompressedSize))
	p = binary.AppendUvarint(p, uint64(ix.Size))
	p = binary.AppendUvarint(p, uint64(ix.Span))
	p = binary.AppendUvarint(p, uint64(len(ix.Checkpoints)))
	var in, out int64
	for i := range ix.Checkpoints {
		c := &ix.Checkpoints[i]
		p = binary.AppendUvarint(p, uint64(c.In-in))
		p = binary.AppendUvarint(p, uint64(c.Out-out))
		in, out = c.In, c.Out
		final := byte(0)
		if c.Final {
			final = 1
		}
		p = append(p, byte(c.Kind), final)
		switch c.Kind {
		case KindStored:
			p = binary.AppendUvarint(p, uint64(c.Stored))
		case KindHuffman:
			p = binary.AppendUvarint(p, uint64(c.NLit))
			if c.NLit > 0 {
				p = binary.AppendUvarint(p, uint64(len(c.Lens)))
				for j := 0; j < len(c.Lens); j += 2 {
					b := c.Lens[j]
					if j+1 < len(c.Lens) {
						b |= c.Lens[j+1] << 4
					}
					p = append(p, b)
				}
			}
		}
		p = binary.AppendUvarint(p, uint64(len(c.Window)))
		p = append(p, c.Window...)
	}
	p = binary.AppendUvarint(p, uint64(ix.ChunkSize))
	for i := range ix.Chunks {
		p = append(p, ix.Chunks[i][:]...)
	}
	p = binary.AppendUvarint(p, uint64(tree.Len()))
	p = append(p, tree.Bytes()...)
	h := make([]byte, encHeaderSize, encHeaderSize+len(p))
	copy(h, encMagic)
	binary.LittleEndian.PutUint32(h[8:], encVersion)
	binary.LittleEndian.PutUint64(h[16:], uint64(len(p)))
	binary.LittleEndian.PutUint32(h[24:], crc32.Checksum(p, castagnoli))
	return append(h, p...), nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// Decode reads an encoded index from r, distrusting it: every count and
// size is bounded by the bytes that remain before anything is allocated,
// and the result passes Validate.
func Decode(r io.Reader) (*Index, error) {
	var h [encHeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, fmt.Errorf("%w: header: %w", ErrInvalid, err)
	}
	if string(h[:8]) != encMagic {
		return nil, invalidf("bad magic %q, not a kata-fsx lazy-read index", h[:8])
	}
	if v := binary.LittleEndian.Uint32(h[8:]); v != encVersion {
		return nil, invalidf("version %d, this kata-fsx reads version %d: rebuild the index", v, encVersion)
	}
	if f := binary.LittleEndian.Uint32(h[12:]); f != 0 {
		return nil, invalidf("unknown flags %#x", f)
	}
	if z := binary.LittleEndian.Uint32(h[28:]); z != 0 {
		return nil, invalidf("reserved header word %#x is not zero", z)
	}
	n := binary.LittleEndian.Uint64(h[16:])
	if n > MaxEncodedSize {
		return nil, invalidf("payload of %d bytes, at most %d", n, uint64(MaxEncodedSize))
	}
	// Read what is there rather than trusting n for the allocation.
	p, err := io.ReadAll(io.LimitReader(r, int64(n)))
	if err != nil {
		return nil, fmt.Errorf("%w: payload: %w", ErrInvalid, err)
	}
	if uint64(len(p)) != n {
		return nil, invalidf("payload truncated: %d of %d bytes", len(p), n)
	}
	if c := crc32.Checksum(p, castagnoli); c != binary.LittleEndian.Uint32(h[24:]) {
		return nil, invalidf("payload checksum %#08x, header says %#08x", c, binary.LittleEndian.Uint32(h[24:]))
	}
	d := &decoder{p: p}
	ix := d.index()
	if d.err != nil {
		return nil, d.err
	}
	if len(d.p) != 0 {
		return nil, invalidf("%d bytes after the tree", len(d.p))
	}
	if err := ix.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return ix, nil
}

// decoder reads the payload with a sticky error: after the first failure
// every read returns zero values.
type decoder struct {
	p   []byte
	err error
	at  string
}

func (d *decoder) fail(err error) {
	if d.err == nil {
		d.err = err
	}
	d.p = nil
}

func (d *decoder) uvarint(what string, max uint64) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.p)
	if n <= 0 {
		d.fail(invalidf("%s%s: truncated or overlong varint", d.at, what))
		return 0
	}
	if v > max {
		d.fail(invalidf("%s%s %d, at most %d", d.at, what, v, max))
		return 0
	}
	d.p = d.p[n:]
	return v
}

func (d *decoder) bytes(what string, max int) []byte {
	n := d.uvarint(what+" length", uint64(min(max, len(d.p))))
	if d.err != nil {
		return nil
	}
	b := d.p[:n]
	d.p = d.p[n:]
	return b
}

func (d *decoder) byte(what string) byte {
	if d.err != nil {
		return 0
	}
	if len(d.p) == 0 {
		d.fail(invalidf("%s%s: truncated", d.at, what))
		return 0
	}
	b := d.p[0]
	d.p = d.p[1:]
	return b
}

func (d *decoder) index() *Index {
	ix := &Index{Format: Format(d.byte("format"))}
	ix.Digest = string(d.bytes("digest", maxDigestLen))
	ix.DiffID = string(d.bytes("diffID", maxDigestLen))
	ix.CompressedSize = int64(d.uvarint("compressed size", 1<<62))
	ix.Size = int64(d.uvarint("size", 1<<62))
	ix.Span = int64(d.uvarint("checkpoint span", MaxSpan))
	n := d.uvarint("checkpoint count", uint64(len(d.p)/minCheckpoint))
	if d.err != nil {
		return nil
	}
	if n > 0 {
		ix.Checkpoints = make([]Checkpoint, n)
	}
	var in, out uint64
	for i := range ix.Checkpoints {
		d.at = fmt.Sprintf("checkpoint %d: ", i)
		c := &ix.Checkpoints[i]
		in += d.uvarint("bit offset delta", 1<<62)
		out += d.uvarint("offset delta", 1<<62)
		if in > 1<<62 || out > 1<<62 {
			d.fail(invalidf("%soffsets overflow", d.at))
		}
		c.In, c.Out = int64(in), int64(out)
		c.Kind = Kind(d.byte("kind"))
		switch f := d.byte("final"); f {
		case 0, 1:
			c.Final = f == 1
		default:
			d.fail(invalidf("%sfinal flag %d", d.at, f))
		}
		switch c.Kind {
		case KindBlock:
		case KindStored:
			c.Stored = int(d.uvarint("stored bytes left", 0xffff))
		case KindHuffman:
			c.NLit = int(d.uvarint("literal/length code count", numLitLen))
			if c.NLit > 0 {
				nl := int(d.uvarint("code length count", numLitLen+numDist))
				packed := d.take("code lengths", (nl+1)/2)
				c.Lens = make([]uint8, nl)
				for j := range c.Lens {
					c.Lens[j] = packed[j/2] >> (4 * (j % 2)) & 15
				}
			}
		default:
			d.fail(invalidf("%sunknown kind %d", d.at, c.Kind))
		}
		if w := d.bytes("window", windowSize); len(w) > 0 {
			c.Window = bytes.Clone(w)
		}
		if d.err != nil {
			return nil
		}
	}
	d.at = ""
	ix.ChunkSize = int64(d.uvarint("chunk size", MaxChunkSize))
	if d.err == nil && !validChunkSize(ix.ChunkSize) {
		d.fail(invalidf("chunk size %d is not a power of two in [%d, %d]", ix.ChunkSize, MinChunkSize, MaxChunkSize))
	}
	if d.err != nil {
		return nil
	}
	nc := ix.NumChunks()
	if nc > int64(len(d.p)/sha256.Size) {
		d.fail(invalidf("%d chunk digests, the payload holds at most %d", nc, len(d.p)/sha256.Size))
		return nil
	}
	if nc > 0 {
		ix.Chunks = make([][sha256.Size]byte, nc)
		sums := d.take("chunk digests", int(nc)*sha256.Size)
		for i := range ix.Chunks {
			copy(ix.Chunks[i][:], sums[i*sha256.Size:])
		}
	}
	tree := d.bytes("tree", len(d.p))
	if d.err != nil {
		return nil
	}
	t, err := index.DecodeLayer(bytes.NewReader(tree))
	if err != nil {
		d.fail(fmt.Errorf("%w: tree: %w", ErrInvalid, err))
		return nil
	}
	ix.Tree = t
	return ix
}

func (d *decoder) take(what string, n int) []byte {
	if d.err != nil {
		return make([]byte, n)
	}
	if n > len(d.p) {
		d.fail(invalidf("%s%s: truncated", d.at, what))
		return make([]byte, n)
	}
	b := d.p[:n]
	d.p = d.p[n:]
	return b
}

// Validate checks what a reader of the index relies on: known format,
// well-formed digests, checkpoints in order, at most Span apart and inside
// the layer, and every file's data inside the uncompressed layer.
func (ix *Index) Validate() error {
	for _, d := range []string{ix.Digest, ix.DiffID} {
		if !validDigest(d) {
			return fmt.Errorf("layer digest %q is not sha256:<64 lowercase hex>", index.Trunc(d))
		}
	}
	if ix.CompressedSize < 0 || ix.Size < 0 {
		return fmt.Errorf("layer %s: negative size", ix.Digest)
	}
	if !validChunkSize(ix.ChunkSize) {
		return fmt.Errorf("layer %s: chunk size %d is not a power of two in [%d, %d]", ix.Digest, ix.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	if int64(len(ix.Chunks)) != ix.NumChunks() {
		return fmt.Errorf("layer %s: %d chunk digests for %d bytes in chunks of %d", ix.Digest, len(ix.Chunks), ix.CompressedSize, ix.ChunkSize)
	}
	switch ix.Format {
	case FormatPlain:
		if len(ix.Checkpoints) != 0 || ix.Span != 0 {
			return fmt.Errorf("layer %s: an uncompressed layer has no checkpoints", ix.Digest)
		}
		if ix.Size != ix.CompressedSize || ix.Digest != ix.DiffID {
			return fmt.Errorf("layer %s: an uncompressed layer's size and digest are its blob's", ix.Digest)
		}
	case FormatGzip:
		if ix.Span < MinSpan || ix.Span > MaxSpan {
			return fmt.Errorf("layer %s: checkpoint span %d outside [%d, %d]", ix.Digest, ix.Span, MinSpan, MaxSpan)
		}
		if len(ix.Checkpoints) == 0 || ix.Checkpoints[0].Out != 0 {
			return fmt.Errorf("layer %s: no checkpoint at offset 0", ix.Digest)
		}
		prev := &ix.Checkpoints[0]
		for i := range ix.Checkpoints {
			c := &ix.Checkpoints[i]
			if i > 0 && (c.In <= prev.In || c.Out <= prev.Out || c.Out-prev.Out > ix.Span) {
				return fmt.Errorf("layer %s: checkpoint %d (bit %d, offset %d) not after checkpoint %d (bit %d, offset %d) and at most %d bytes on", ix.Digest, i, c.In, c.Out, i-1, prev.In, prev.Out, ix.Span)
			}
			if c.In > ix.CompressedSize*8 || c.Out > ix.Size {
				return fmt.Errorf("layer %s: checkpoint %d beyond the layer", ix.Digest, i)
			}
			if int64(len(c.Window)) > c.Out {
				return fmt.Errorf("layer %s: checkpoint %d has a window of %d bytes at offset %d", ix.Digest, i, len(c.Window), c.Out)
			}
			if c.Kind == KindStored && c.In%8 != 0 {
				return fmt.Errorf("layer %s: checkpoint %d inside a stored block is not byte aligned", ix.Digest, i)
			}
			for _, l := range c.Lens {
				if l > maxCodeLen {
					return fmt.Errorf("layer %s: checkpoint %d: code length %d", ix.Digest, i, l)
				}
			}
			if c.NLit > len(c.Lens) || (c.Kind == KindHuffman && c.NLit > 0 && (c.NLit < 257 || len(c.Lens)-c.NLit < 1)) {
				return fmt.Errorf("layer %s: checkpoint %d: %d literal/length codes of %d", ix.Digest, i, c.NLit, len(c.Lens))
			}
			prev = c
		}
		if ix.Size-prev.Out > ix.Span {
			return fmt.Errorf("layer %s: last checkpoint at %d, more than %d before the end at %d", ix.Digest, prev.Out, ix.Span, ix.Size)
		}
	default:
		return fmt.Errorf("layer %s: unknown format %d", ix.Digest, ix.Format)
	}
	if ix.Tree == nil || len(ix.Tree.Sources) != 1 || ix.Tree.Sources[0].Kind != index.SourceBlob || ix.Tree.Sources[0].ID != ix.DiffID {
		return fmt.Errorf("layer %s: the tree's one source must be the blob %s", ix.Digest, ix.DiffID)
	}
	if err := ix.Tree.ValidateLayer(); err != nil {
		return fmt.Errorf("layer %s tree: %w", ix.Digest, err)
	}
	for i := range ix.Tree.Entries {
		e := &ix.Tree.Entries[i]
		if e.Type == index.TypeRegular && (e.Data.Offset < 0 || e.Size < 0 || e.Data.Offset > ix.Size-e.Size) {
			return fmt.Errorf("layer %s: file %q data [%d, +%d) outside the %d-byte tar", ix.Digest, index.Trunc(e.Path), e.Data.Offset, e.Size, ix.Size)
		}
	}
	return nil
}

func validDigest(d string) bool {
	if len(d) != maxDigestLen || d[:7] != "sha256:" {
		return false
	}
	for _, c := range d[7:] {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
