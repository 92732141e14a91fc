package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"

	"github.com/kata-fsx/kata-fsx/content/lazyindex"
)

// reader is the uncompressed layer tar of one lazy layer, the io.ReaderAt
// the Opener hands to the block device. It holds nothing of its own.
type reader struct {
	l *layer
}

// ReadAt reads the uncompressed bytes [off, off+len(p)) of the layer,
// within the Store's ReadTimeout.
func (r *reader) ReadAt(p []byte, off int64) (int, error) {
	l := r.l
	s := l.s
	ix := l.ix
	if off < 0 {
		return 0, fmt.Errorf("content store: layer %s: negative offset %d", l.name, off)
	}
	if off >= ix.Size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	want := min(int64(len(p)), ix.Size-off)
	if want == 0 {
		return 0, nil
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.readTimeout)
	defer cancel()
	var err error
	if ix.Format == lazyindex.FormatPlain {
		err = s.readPlain(ctx, l, p[:want], off)
	} else {
		err = s.readGzip(ctx, l, p[:want], off)
	}
	if err != nil {
		s.stats.readErrors.Add(1)
		return 0, fmt.Errorf("read [%d, %d) of layer %s: %w", off, off+want, l.name, err)
	}
	if want < int64(len(p)) {
		return int(want), io.EOF
	}
	return int(want), nil
}

// readPlain serves an uncompressed layer: its bytes are the blob's.
func (s *Store) readPlain(ctx context.Context, l *layer, p []byte, off int64) error {
	cs := l.ix.ChunkSize
	lo, hi := off/cs, (off+int64(len(p))-1)/cs+1
	s.record(l, lo, hi)
	for i := lo; i < hi; i++ {
		b, err := s.chunk(ctx, l, i, hi)
		if err != nil {
			return err
		}
		start, _ := l.ix.ChunkRange(i)
		src := b[max(off-start, 0):]
		n := copy(p, src)
		p = p[n:]
		off += int64(n)
	}
	return nil
}

// span k of a gzip layer is the uncompressed range between checkpoints k
// and k+1, inflated from the compressed range between them.
func spanBounds(ix *lazyindex.Index, k int) (out, outEnd, in, inEnd int64) {
	cp := &ix.Checkpoints[k]
	out, outEnd, in, inEnd = cp.Out, ix.Size, cp.CompressedStart(), ix.CompressedSize
	if k+1 < len(ix.Checkpoints) {
		next := &ix.Checkpoints[k+1]
		outEnd, inEnd = next.Out, (next.In+7)/8
	}
	return
}

// readGzip serves a gzip layer span by span: a span small enough for the
// memory tier is inflated whole once and kept, so the many small reads a
// guest makes of it inflate it once; a larger one is inflated up to the
// bytes asked for, each time.
func (s *Store) readGzip(ctx context.Context, l *layer, p []byte, off int64) error {
	ix := l.ix
	k := sort.Search(len(ix.Checkpoints), func(i int) bool { return ix.Checkpoints[i].Out > off }) - 1
	for len(p) > 0 {
		out, outEnd, in, inEnd := spanBounds(ix, k)
		s.record(l, in/ix.ChunkSize, (inEnd+ix.ChunkSize-1)/ix.ChunkSize)
		var n int
		if outEnd-out <= s.mem.limit/4 {
			b, err := s.span(ctx, l, k)
			if err != nil {
				return err
			}
			n = copy(p, b[off-out:])
		} else {
			n = int(min(int64(len(p)), outEnd-off))
			if err := s.inflate(ctx, l, k, p[:n], off); err != nil {
				return err
			}
		}
		p = p[n:]
		off += int64(n)
		k++
	}
	return nil
}

// span returns span k inflated, from memory or inflated once by one of
// the reads that want it at the same time.
func (s *Store) span(ctx context.Context, l *layer, k int) ([]byte, error) {
	key := memKey{l, memSpan, int64(k)}
	for try := 0; ; try++ {
		if b := s.mem.get(key); b != nil {
			s.stats.memoryHits.Add(1)
			return b, nil
		}
		l.mu.Lock()
		c := l.spans[int64(k)]
		lead := c == nil
		if lead {
			c = newCall()
			l.spans[int64(k)] = c
		}
		l.mu.Unlock()
		if lead {
			out, outEnd, _, _ := spanBounds(l.ix, k)
			b := make([]byte, outEnd-out)
			err := s.inflate(ctx, l, k, b, out)
			if err == nil {
				s.mem.put(key, b)
				c.b = b
			}
			c.err = err
			l.mu.Lock()
			delete(l.spans, int64(k))
			l.mu.Unlock()
			close(c.done)
			return c.b, c.err
		}
		select {
		case <-c.done:
		case <-ctx.Done():
			return nil, s.ctxErr(ctx, l, int64(k))
		}
		if c.err == nil {
			return c.b, nil
		}
		// The leader's read failed, perhaps only its deadline: try once
		// more as a leader with this read's own deadline.
		if try > 0 {
			return nil, c.err
		}
	}
}

// inflate fills p with the uncompressed bytes at off, inside span k,
// inflating from checkpoint k over the chunks that hold its compressed
// bytes.
func (s *Store) inflate(ctx context.Context, l *layer, k int, p []byte, off int64) error {
	ix := l.ix
	cp := &ix.Checkpoints[k]
	_, _, in, inEnd := spanBounds(ix, k)
	if off+int64(len(p)) < ix.Size {
		// Only as far as the checkpoint after the bytes asked for.
		_, e, err := ix.CompressedRange(off, int64(len(p)))
		if err != nil {
			return err
		}
		inEnd = min(inEnd, e)
	}
	cr := &chunkReader{ctx: ctx, s: s, l: l, pos: in, end: inEnd, hi: (inEnd + ix.ChunkSize - 1) / ix.ChunkSize}
	// The chunks may all be held already, so nothing but the inflater
	// itself would notice the read's deadline: it is given ctx.
	zr, err := ix.NewReader(ctx, cp, cr)
	if err != nil {
		return err
	}
	s.stats.spansInflated.Add(1)
	if _, err := io.CopyN(io.Discard, zr, off-cp.Out); err != nil {
		return s.inflateErr(ctx, l, k, cr.cause(fmt.Errorf("inflate from checkpoint at %d to %d: %w", cp.Out, off, err)))
	}
	if _, err := io.ReadFull(zr, p); err != nil {
		return s.inflateErr(ctx, l, k, cr.cause(fmt.Errorf("inflate [%d, %d): %w", off, off+int64(len(p)), err)))
	}
	return nil
}

// inflateErr explains an inflate of span k that ended early: a read whose
// deadline passed or whose store closed says so, as a wait for a chunk
// does, whatever the inflater was doing at that moment.
func (s *Store) inflateErr(ctx context.Context, l *layer, k int, err error) error {
	if ctx.Err() == nil || !errors.Is(err, ctx.Err()) {
		return err
	}
	switch {
	case s.ctx.Err() != nil:
		return ErrClosed
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("content store: layer %s: span %d not inflated within %v (%w): %w", l.name, k, s.readTimeout, err, ErrReadTimeout)
	default:
		return fmt.Errorf("content store: layer %s: span %d: %w", l.name, k, err)
	}
}

// chunkReader yields the stored blob's bytes [pos, end) chunk by chunk
// from the tiers, for the inflater.
type chunkReader struct {
	ctx      context.Context
	s        *Store
	l        *layer
	pos, end int64
	hi       int64 // chunk bound for merged fetches
	cur      []byte
	curStart int64
	err      error // the tier error that ended the stream
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if r.err != nil {
		// Sticky: an inflater that reads again after an error must not
		// start another fetch past the read's failure.
		return 0, r.err
	}
	if r.pos >= r.end {
		return 0, io.EOF
	}
	cs := r.l.ix.ChunkSize
	if r.cur == nil || r.pos < r.curStart || r.pos >= r.curStart+int64(len(r.cur)) {
		i := r.pos / cs
		b, err := r.s.chunk(r.ctx, r.l, i, r.hi)
		if err != nil {
			r.err = err
			return 0, err
		}
		r.cur, r.curStart = b, i*cs
	}
	src := r.cur[r.pos-r.curStart : min(int64(len(r.cur)), r.end-r.curStart)]
	n := copy(p, src)
	r.pos += int64(n)
	return n, nil
}

// cause prefers the tier's error (a deadline, a chunk that did not
// verify) over the inflater's report of a stream that stopped.
func (r *chunkReader) cause(err error) error {
	if r.err != nil {
		return r.err
	}
	return err
}
