package store

import (
	"context"
	"time"
)

// Fill fetches every chunk not yet held of all added layers, at most
// bytesPerSecond (0 = unlimited), until done or ctx ends; the background
// fill after a pod starts. Without a node disk tier there is nowhere to
// keep a whole layer, and Fill does nothing.
func (s *Store) Fill(ctx context.Context, bytesPerSecond int64) error {
	if s.opts.Dir == "" {
		s.logf("content store: no node cache directory: background fill skipped")
		return nil
	}
	s.mu.Lock()
	layers := append([]*layer(nil), s.order...)
	s.mu.Unlock()
	tb := newBucket(bytesPerSecond, s.maxFetch)
	for _, l := range layers {
		n := l.ix.NumChunks()
		for i := int64(0); i < n; {
			if !l.onDisk() {
				s.logf("content store: background fill of layer %s stopped: the node cache does not take it", l.name)
				break
			}
			// The next run of missing chunks, up to MaxFetch.
			l.mu.Lock()
			for i < n && s.heldLocked(l, i) {
				i++
			}
			j, size := i, int64(0)
			for j < n && !s.heldLocked(l, j) {
				a, b := l.ix.ChunkRange(j)
				if j > i && size+b-a > s.maxFetch {
					break
				}
				size += b - a
				j++
			}
			l.mu.Unlock()
			if i >= n {
				break
			}
			if err := tb.wait(ctx, size); err != nil {
				return err
			}
			if err := s.ensure(ctx, l, i, j, false); err != nil {
				return err
			}
			i = j
		}
	}
	return ctx.Err()
}

// Prefetch fetches a trace's chunks in order, merging runs of adjacent
// chunks of one layer. A trace comes from the registry, written by
// whoever could push to the image's repository, so it is held to a
// budget: each chunk counts once however often the trace names it, and
// the chunks after the first maxBytes of them (<= 0: no bound but the
// layers' own sizes) are dropped with one log line. Entries of layers not
// added or chunks past a layer's end are skipped, with one log line per
// layer.
func (s *Store) Prefetch(ctx context.Context, t Trace, maxBytes int64) error {
	plan := s.planPrefetch(t, maxBytes)
	for k := 0; k < len(plan); {
		e := plan[k]
		m := k + 1
		for m < len(plan) && plan[m].l == e.l && plan[m].chunk == plan[m-1].chunk+1 {
			m++
		}
		if err := s.ensure(ctx, e.l, e.chunk, e.chunk+int64(m-k), true); err != nil {
			return err
		}
		k = m
	}
	return nil
}

// prefetchChunk is one chunk Prefetch fetches.
type prefetchChunk struct {
	l     *layer
	chunk int64
}

// planPrefetch returns the chunks of t that Prefetch fetches, in order:
// each once, of added layers, within maxBytes.
func (s *Store) planPrefetch(t Trace, maxBytes int64) []prefetchChunk {
	logged := map[string]bool{}
	skip := func(e TraceEntry, why string) {
		if !logged[e.Layer] {
			logged[e.Layer] = true
			s.logf("content store: prefetch trace entries of layer %s skipped: %s", e.Layer, why)
		}
	}
	layers := map[string]*layer{}
	seen := map[prefetchChunk]bool{}
	var plan []prefetchChunk
	var planned int64
	for k, e := range t.Entries {
		l, ok := layers[e.Layer]
		if !ok {
			s.mu.Lock()
			l = s.blobs[e.Layer]
			s.mu.Unlock()
			layers[e.Layer] = l
		}
		if l == nil {
			skip(e, "no such layer in this store")
			continue
		}
		if e.Chunk < 0 || e.Chunk >= l.ix.NumChunks() {
			skip(e, "chunk past the layer's end (a trace of another index?)")
			continue
		}
		c := prefetchChunk{l, e.Chunk}
		if seen[c] {
			continue
		}
		a, b := l.ix.ChunkRange(e.Chunk)
		if maxBytes > 0 && planned+b-a > maxBytes {
			s.logf("content store: prefetch trace trimmed at entry %d of %d: its first %d chunks (%d bytes) are all a replay may fetch (at most %d bytes)",
				k+1, len(t.Entries), len(plan), planned, maxBytes)
			break
		}
		seen[c] = true
		planned += b - a
		plan = append(plan, c)
	}
	return plan
}

// bucket is a token bucket of bytes: a fetch of n bytes waits until the
// rate has paid for it, with a burst of one fetch.
type bucket struct {
	rate   float64 // bytes per second; 0 = unlimited
	burst  float64
	tokens float64
	last   time.Time
}

func newBucket(rate, burst int64) *bucket {
	b := &bucket{rate: float64(rate), burst: float64(burst), last: time.Now()}
	return b
}

func (b *bucket) wait(ctx context.Context, n int64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.rate <= 0 {
		return nil
	}
	now := time.Now()
	b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	b.last = now
	b.tokens -= float64(n)
	if b.tokens >= 0 {
		return nil
	}
	t := time.NewTimer(time.Duration(-b.tokens / b.rate * float64(time.Second)))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
