package lazyindex

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"sort"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/tarlayer"
)

// Format is the compression of the layer an index was built from.
type Format uint8

// Layer formats. The values are part of the encoded format.
const (
	FormatPlain Format = iota + 1 // an uncompressed tar: offsets only, no checkpoints
	FormatGzip                    // gzip (RFC 1952), one or more members
)

// String returns the format's name as errors use it.
func (f Format) String() string {
	switch f {
	case FormatPlain:
		return "plain"
	case FormatGzip:
		return "gzip"
	}
	return fmt.Sprintf("format(%d)", uint8(f))
}

// Kind says what state decoding resumes in at a checkpoint.
type Kind uint8

// Checkpoint kinds. The values are part of the encoded format.
const (
	KindBlock   Kind = iota + 1 // at a deflate block header
	KindStored                  // inside a stored block, Stored bytes left
	KindHuffman                 // inside a Huffman block, at a symbol
)

// Checkpoint is a point of a gzip layer where inflating can resume: the
// decoder's state there and the 32 KiB of output before it. Checkpoints
// may fall inside a deflate block (with the block's code lengths saved),
// so that their spacing does not depend on how large the compressor made
// its blocks.
type Checkpoint struct {
	In     int64 // offset in bits in the compressed layer where decoding resumes
	Out    int64 // offset in the uncompressed layer of the next output byte
	Kind   Kind
	Final  bool    // inside the last block of a gzip member
	Stored int     // KindStored: bytes left in the stored block
	NLit   int     // KindHuffman, dynamic block: number of literal/length code lengths in Lens
	Lens   []uint8 // KindHuffman: the block's code lengths (nil for a fixed-code block)
	Window []byte  // up to 32 KiB of output before Out in the same gzip member
}

// CompressedStart is the first byte of the compressed layer that inflating
// from c needs.
func (c *Checkpoint) CompressedStart() int64 { return c.In / 8 }

// Index is the lazy-read index of one layer.
type Index struct {
	Format         Format
	Digest         string // the layer blob's digest (compressed), "sha256:<hex>"
	DiffID         string // digest of the uncompressed tar
	CompressedSize int64
	Size           int64 // uncompressed size
	Span           int64 // the largest distance between checkpoints (gzip)
	Checkpoints    []Checkpoint
	// ChunkSize cuts the stored blob (compressed for gzip) into the pieces
	// a lazy reader fetches and verifies on their own; Chunks holds each
	// piece's SHA-256 (the last piece may be shorter). A reader checks a
	// fetched piece against them before it uses a byte of it, since the
	// blob's own digest covers only the whole.
	ChunkSize int64
	Chunks    [][sha256.Size]byte
	// Tree is the layer's per-layer index (blk/index's form, whiteouts
	// and overlay markers kept); its one source is the blob DiffID, and a
	// regular file's Data.Offset is its offset in the uncompressed tar.
	Tree *index.Index
}

// Limits and defaults of Options.
const (
	DefaultSpan = 4 << 20
	MinSpan     = 64 << 10
	// MaxSpan bounds the span Build uses and Decode accepts. A read
	// inflates from the checkpoint before it, so the span is the CPU one
	// guest read may cost whenever the span is not kept inflated in
	// memory; an index artifact is written by whoever can push to the
	// image's repository, and must not set that cost. The content
	// store's default memory tier keeps spans of this size.
	MaxSpan = 16 << 20
	// DefaultCheckpointBudget bounds the checkpoints' memory: 32 KiB
	// windows every 4 MiB fill it at a 32 GiB layer.
	DefaultCheckpointBudget = 256 << 20

	DefaultChunkSize = 1 << 20
	MinChunkSize     = 64 << 10
	MaxChunkSize     = 64 << 20
)

// Options tune Build.
type Options struct {
	// Span is the most uncompressed bytes between checkpoints; zero means
	// DefaultSpan. Checkpoints fall between Span-257 and Span apart.
	Span int64
	// MaxEntries bounds the tree's entries (index.Options.EntryLimit).
	MaxEntries int
	// CheckpointBudget bounds the bytes the checkpoints take (windows and
	// code lengths); zero means DefaultCheckpointBudget. A layer that
	// needs more is refused, naming the span and the budget.
	CheckpointBudget int64
	// ChunkSize is the size of the verified pieces of the stored blob (a
	// power of two in [MinChunkSize, MaxChunkSize]); zero means
	// DefaultChunkSize.
	ChunkSize int64
	// Layer names the layer in errors.
	Layer string
}

// Build indexes a layer by streaming it once from r: a gzip layer (its
// members' CRC-32 and ISIZE checked) or an uncompressed tar. Hostile tar
// entries are refused as blk/index/tarlayer refuses them.
func Build(ctx context.Context, r io.Reader, opts Options) (*Index, error) {
	span := opts.Span
	if span == 0 {
		span = DefaultSpan
	}
	if span < MinSpan || span > MaxSpan {
		return nil, fmt.Errorf("layer %s: checkpoint span %d outside [%d, %d]", opts.Layer, span, MinSpan, MaxSpan)
	}
	max := opts.MaxEntries
	if max <= 0 {
		max = (&index.Options{}).EntryLimit()
	}
	chunk := opts.ChunkSize
	if chunk == 0 {
		chunk = DefaultChunkSize
	}
	if !validChunkSize(chunk) {
		return nil, fmt.Errorf("layer %s: chunk size %d is not a power of two in [%d, %d]", opts.Layer, chunk, MinChunkSize, MaxChunkSize)
	}
	zh := sha256.New()
	cnt := &countWriter{}
	ch := &chunkHasher{size: chunk, h: sha256.New()}
	br := bufio.NewReaderSize(io.TeeReader(r, io.MultiWriter(zh, cnt, ch)), 64<<10)
	magic, err := br.Peek(4)
	if err != nil && !(errors.Is(err, io.EOF) && len(magic) > 0) {
		return nil, fmt.Errorf("layer %s: read: %w", opts.Layer, err)
	}
	budget := opts.CheckpointBudget
	if budget <= 0 {
		budget = DefaultCheckpointBudget
	}
	ix := &Index{Format: FormatPlain}
	var un io.Reader = br
	var gz *stream
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		ix.Format = FormatGzip
		ix.Span = span
		if gz, err = newIndexingStream(br, span, budget); err != nil {
			return nil, fmt.Errorf("layer %s: %w", opts.Layer, err)
		}
		un = gz
	case len(magic) == 4 && string(magic) == "\x28\xb5\x2f\xfd":
		return nil, fmt.Errorf("layer %s: zstd layers are not supported by the lazy-read index yet; use a gzip or uncompressed layer", opts.Layer)
	}
	fs := &fwdSeeker{r: un, h: sha256.New()}
	tree, err := tarlayer.Read(ctx, fs, index.Source{Kind: index.SourceBlob}, max, opts.Layer)
	if err != nil {
		return nil, fmt.Errorf("%w (span %d, checkpoint budget %d)", err, span, budget)
	}
	// The tar's end marker may be followed by padding: the digests and the
	// gzip trailers cover everything.
	if _, err := io.Copy(io.Discard, fs); err != nil {
		return nil, fmt.Errorf("layer %s: after the tar: %w", opts.Layer, err)
	}
	if _, err := io.Copy(io.Discard, br); err != nil {
		return nil, fmt.Errorf("layer %s: read: %w", opts.Layer, err)
	}
	ix.Digest = "sha256:" + hex.EncodeToString(zh.Sum(nil))
	ix.DiffID = "sha256:" + hex.EncodeToString(fs.h.Sum(nil))
	ix.CompressedSize = cnt.n
	ix.Size = fs.pos
	ix.ChunkSize = chunk
	ix.Chunks = ch.finish()
	if gz != nil {
		ix.Checkpoints = gz.cps
	} else {
		ix.DiffID = ix.Digest
	}
	tree.Sources[0].ID = ix.DiffID
	ix.Tree = tree
	return ix, nil
}

type countWriter struct{ n int64 }

// chunkHasher records the SHA-256 of every size bytes written to it.
type chunkHasher struct {
	size, n int64
	h       hash.Hash
	sums    [][sha256.Size]byte
}

func (c *chunkHasher) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		k := min(int64(len(p)), c.size-c.n)
		c.h.Write(p[:k])
		c.n += k
		p = p[k:]
		if c.n == c.size {
			c.sums = append(c.sums, [sha256.Size]byte(c.h.Sum(nil)))
			c.h.Reset()
			c.n = 0
		}
	}
	return total, nil
}

func (c *chunkHasher) finish() [][sha256.Size]byte {
	if c.n > 0 {
		c.sums = append(c.sums, [sha256.Size]byte(c.h.Sum(nil)))
	}
	return c.sums
}

func validChunkSize(n int64) bool {
	return n >= MinChunkSize && n <= MaxChunkSize && n&(n-1) == 0
}

// NumChunks is how many pieces of ChunkSize the stored blob has.
func (ix *Index) NumChunks() int64 {
	if ix.ChunkSize <= 0 {
		return 0
	}
	return (ix.CompressedSize + ix.ChunkSize - 1) / ix.ChunkSize
}

// ChunkRange returns the bytes [start, end) of the stored blob that chunk
// i covers.
func (ix *Index) ChunkRange(i int64) (start, end int64) {
	start = i * ix.ChunkSize
	return start, min(start+ix.ChunkSize, ix.CompressedSize)
}

// ErrChunkDigest is wrapped by VerifyChunk's error for bytes that are not
// the chunk the index recorded.
var ErrChunkDigest = errors.New("chunk digest mismatch")

// VerifyChunk checks that b is exactly chunk i of the stored blob.
func (ix *Index) VerifyChunk(i int64, b []byte) error {
	if i < 0 || i >= int64(len(ix.Chunks)) {
		return fmt.Errorf("layer %s: chunk %d of %d", ix.Digest, i, len(ix.Chunks))
	}
	start, end := ix.ChunkRange(i)
	if int64(len(b)) != end-start {
		return fmt.Errorf("layer %s chunk %d: %d bytes, want %d: %w", ix.Digest, i, len(b), end-start, ErrChunkDigest)
	}
	if sha256.Sum256(b) != ix.Chunks[i] {
		return fmt.Errorf("layer %s chunk %d (bytes [%d, %d)): %w", ix.Digest, i, start, end, ErrChunkDigest)
	}
	return nil
}

func (c *countWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return len(p), nil
}

// fwdSeeker is the seekable view archive/tar and tarlayer want of a stream
// read once: it knows its position and seeks forward by reading, so the
// skipped bytes are hashed and (for gzip) checked too.
type fwdSeeker struct {
	r   io.Reader
	h   hash.Hash
	pos int64
}

func (s *fwdSeeker) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	s.h.Write(p[:n])
	s.pos += int64(n)
	return n, err
}

func (s *fwdSeeker) Seek(off int64, whence int) (int64, error) {
	if whence != io.SeekCurrent || off < 0 {
		return s.pos, fmt.Errorf("layer stream seeks forward only (whence %d, offset %d)", whence, off)
	}
	if _, err := io.CopyN(io.Discard, struct{ io.Reader }{s}, off); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return s.pos, err
	}
	return s.pos, nil
}

// Checkpoint returns the checkpoint nearest before uncompressed offset off.
func (ix *Index) Checkpoint(off int64) (*Checkpoint, error) {
	if ix.Format != FormatGzip {
		return nil, fmt.Errorf("layer %s is %s: it has no checkpoints", ix.Digest, ix.Format)
	}
	if off < 0 || off > ix.Size {
		return nil, fmt.Errorf("offset %d outside layer %s of %d bytes", off, ix.Digest, ix.Size)
	}
	i := sort.Search(len(ix.Checkpoints), func(i int) bool { return ix.Checkpoints[i].Out > off }) - 1
	if i < 0 {
		return nil, fmt.Errorf("layer %s: no checkpoint at or before offset %d", ix.Digest, off)
	}
	return &ix.Checkpoints[i], nil
}

// CompressedRange returns the half-open range of compressed bytes that
// reading the uncompressed range [off, off+n) needs: from the checkpoint
// before off to the checkpoint after off+n (or the end of the layer).
func (ix *Index) CompressedRange(off, n int64) (start, end int64, err error) {
	if ix.Format == FormatPlain {
		return off, off + n, nil
	}
	cp, err := ix.Checkpoint(off)
	if err != nil {
		return 0, 0, err
	}
	end = ix.CompressedSize
	i := sort.Search(len(ix.Checkpoints), func(i int) bool { return ix.Checkpoints[i].Out >= off+n })
	if i < len(ix.Checkpoints) {
		end = (ix.Checkpoints[i].In + 7) / 8
	}
	return cp.CompressedStart(), end, nil
}

// NewReader returns the uncompressed layer from cp.Out on, inflated from
// r, which yields the compressed layer's bytes from cp.CompressedStart()
// on (for example a Range response). The gzip trailers it passes are not
// checked: the member's start was not decoded; the index's digests are
// what vouch for the bytes. Once ctx is done, reading fails with its
// error within about ctxCheckBytes more output, since the compressed
// bytes may already be at hand and inflating them alone can take long.
func (ix *Index) NewReader(ctx context.Context, cp *Checkpoint, r io.Reader) (io.Reader, error) {
	if ix.Format != FormatGzip {
		return nil, fmt.Errorf("layer %s is %s: read it directly", ix.Digest, ix.Format)
	}
	s, err := newResumeStream(cp, r, true)
	if err != nil {
		return nil, err
	}
	s.ctx = ctx
	return s, nil
}

// ReadAt reads the uncompressed bytes [off, off+len(p)) of the layer from
// blob, the layer as stored (compressed for gzip layers), stopping with
// ctx's error once ctx is done.
func (ix *Index) ReadAt(ctx context.Context, blob io.ReaderAt, p []byte, off int64) (int, error) {
	if off < 0 || off > ix.Size {
		return 0, fmt.Errorf("offset %d outside layer %s of %d bytes", off, ix.Digest, ix.Size)
	}
	want := min(int64(len(p)), ix.Size-off)
	if ix.Format == FormatPlain {
		n, err := blob.ReadAt(p[:want], off)
		if err == nil && want < int64(len(p)) {
			err = io.EOF
		}
		return n, err
	}
	start, end, err := ix.CompressedRange(off, want)
	if err != nil {
		return 0, err
	}
	cp, err := ix.Checkpoint(off)
	if err != nil {
		return 0, err
	}
	r, err := ix.NewReader(ctx, cp, io.NewSectionReader(blob, start, end-start))
	if err != nil {
		return 0, err
	}
	if _, err := io.CopyN(io.Discard, r, off-cp.Out); err != nil {
		return 0, fmt.Errorf("layer %s: inflate from checkpoint at %d to %d: %w", ix.Digest, cp.Out, off, err)
	}
	n, err := io.ReadFull(r, p[:want])
	if err != nil {
		return n, fmt.Errorf("layer %s: inflate [%d, %d): %w", ix.Digest, off, off+want, err)
	}
	if want < int64(len(p)) {
		return n, io.EOF
	}
	return n, nil
}
