package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"
)

// attemptTimeout bounds one FetchRange call. It is longer than a read's
// deadline: a fetch outlives the read that started it, so a slow registry
// still fills the chunk for the reads that come after.
func (s *Store) attemptTimeout() time.Duration {
	return max(2*s.readTimeout, 10*time.Second)
}

// chunk returns chunk i's verified bytes for a read: from memory, from the
// node disk, or fetched (with the missing chunks after it up to hi in the
// same request). It waits at most until ctx ends; the fetch goes on.
func (s *Store) chunk(ctx context.Context, l *layer, i, hi int64) ([]byte, error) {
	key := memKey{l, memChunk, i}
	if b := s.mem.get(key); b != nil {
		s.stats.memoryHits.Add(1)
		return b, nil
	}
	l.mu.Lock()
	if l.held[i] && l.data != nil {
		l.mu.Unlock()
		if b, err := l.readDisk(i); err == nil {
			s.stats.diskHits.Add(1)
			s.mem.put(key, b)
			return b, nil
		}
		// Unreadable or not verifying: fetch it again (under its lock,
		// which rechecks the disk first).
		l.mu.Lock()
		l.held[i] = false
	}
	c := l.inflight[i]
	if c == nil {
		c = s.startRunLocked(l, i, hi, true)[0]
	}
	l.mu.Unlock()
	return s.wait(ctx, l, i, c)
}

func (s *Store) wait(ctx context.Context, l *layer, i int64, c *call) ([]byte, error) {
	select {
	case <-c.done:
		return c.b, c.err
	case <-ctx.Done():
		return nil, s.ctxErr(ctx, l, i)
	}
}

// ctxErr explains why a wait for chunk i ended early.
func (s *Store) ctxErr(ctx context.Context, l *layer, i int64) error {
	switch {
	case s.ctx.Err() != nil:
		return ErrClosed
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("content store: layer %s chunk %d not fetched within %v (the fetch goes on): %w", l.name, i, s.readTimeout, ErrReadTimeout)
	default:
		return fmt.Errorf("content store: layer %s chunk %d: %w", l.name, i, ctx.Err())
	}
}

// held reports whether chunk i is in the tier it should be in: on disk for
// a layer with a working disk tier, else in memory. l.mu is held.
func (s *Store) heldLocked(l *layer, i int64) bool {
	if l.data != nil && l.diskOnLocked() {
		return l.held[i]
	}
	return s.mem.has(memKey{l, memChunk, i})
}

// ensure fetches the chunks [lo, hi) of l that are not held, for Fill and
// Prefetch; keep says whether fetched chunks also go to memory. It waits
// for the run of chunks it started rather than looking at each again: a
// run larger than the memory tier would otherwise be evicted as it
// arrives and fetched again chunk by chunk.
func (s *Store) ensure(ctx context.Context, l *layer, lo, hi int64, keep bool) error {
	for i := lo; i < hi; {
		l.mu.Lock()
		if s.heldLocked(l, i) {
			l.mu.Unlock()
			i++
			continue
		}
		calls := []*call{l.inflight[i]}
		if calls[0] == nil {
			calls = s.startRunLocked(l, i, hi, keep)
		}
		l.mu.Unlock()
		for k, c := range calls {
			if _, err := s.wait(ctx, l, i+int64(k), c); err != nil {
				return err
			}
		}
		i += int64(len(calls))
	}
	return nil
}

// startRunLocked registers fetches of chunk lo and of the missing chunks
// after it (below hi, up to MaxFetch bytes in all) and starts them in the
// background; it returns their calls, lo's first (only lo's, failed, on a
// closed store). l.mu is held.
func (s *Store) startRunLocked(l *layer, lo, hi int64, keep bool) []*call {
	n := l.ix.NumChunks()
	hi = min(hi, n)
	a, b := l.ix.ChunkRange(lo)
	size := b - a
	j := lo + 1
	for ; j < hi && !s.heldLocked(l, j) && l.inflight[j] == nil && !s.mem.has(memKey{l, memChunk, j}); j++ {
		a, b := l.ix.ChunkRange(j)
		if size+b-a > s.maxFetch {
			break
		}
		size += b - a
	}
	calls := make([]*call, j-lo)
	for k := range calls {
		calls[k] = newCall()
	}
	s.mu.Lock()
	closed := s.closed
	if !closed {
		s.wg.Add(1)
	}
	s.mu.Unlock()
	if closed {
		c := newCall()
		c.err = ErrClosed
		close(c.done)
		return []*call{c}
	}
	for k, c := range calls {
		l.inflight[lo+int64(k)] = c
	}
	go s.fetchRun(l, lo, calls, keep)
	return calls
}

// fetchRun fills the calls of chunks [lo, lo+len(calls)): under the
// chunks' lock in the data file it takes what another process put on disk
// meanwhile, fetches the rest, verifies every chunk, hands the verified
// ones to the waiting readers and writes them to disk.
func (s *Store) fetchRun(l *layer, lo int64, calls []*call, keep bool) {
	defer s.wg.Done()
	ctx := s.ctx
	hi := lo + int64(len(calls))
	defer func() {
		l.mu.Lock()
		for k, c := range calls {
			if l.inflight[lo+int64(k)] == c {
				delete(l.inflight, lo+int64(k))
			}
		}
		l.mu.Unlock()
	}()
	delivered := make([]bool, len(calls))
	deliver := func(i int64, b []byte, err error) {
		c := calls[i-lo]
		c.b, c.err = b, err
		if err == nil && keep {
			s.mem.put(memKey{l, memChunk, i}, b)
		}
		delivered[i-lo] = true
		if err != nil {
			// A failure is not shared with reads that come later: they
			// try again.
			l.mu.Lock()
			if l.inflight[i] == c {
				delete(l.inflight, i)
			}
			l.mu.Unlock()
		}
		close(c.done)
	}
	disk := l.onDisk()
	if disk {
		start, _ := l.ix.ChunkRange(lo)
		_, end := l.ix.ChunkRange(hi - 1)
		lctx, cancel := context.WithTimeout(ctx, s.attemptTimeout())
		unlock, err := lockRange(lctx, l.data, start, end-start)
		cancel()
		if err != nil {
			// Another process holds the chunks too long (or locks fail):
			// fetch them anyway, but leave the disk to that process.
			if ctx.Err() == nil {
				s.logf("node cache %s: layer %s chunks %d-%d: %v: fetching them without the node cache", s.opts.Dir, l.name, lo, hi-1, err)
			}
			disk = false
		} else {
			defer unlock()
			if held, err := l.mapHeld(lo, hi); err != nil {
				s.logf("node cache %s: layer %s: %v", s.opts.Dir, l.name, err)
			} else {
				for k, h := range held {
					i := lo + int64(k)
					l.mu.Lock()
					bad := l.badDisk[i]
					l.mu.Unlock()
					if !h || bad {
						continue
					}
					if b, err := l.readDisk(i); err == nil {
						l.mu.Lock()
						l.held[i] = true
						l.mu.Unlock()
						s.stats.diskHits.Add(1)
						deliver(i, b, nil)
					}
				}
			}
		}
	}
	for a := lo; a < hi; {
		if delivered[a-lo] {
			a++
			continue
		}
		b := a
		for b < hi && !delivered[b-lo] {
			b++
		}
		s.fetchChunks(ctx, l, a, b, disk, deliver)
		a = b
	}
}

// fetchChunks fetches chunks [a, b) in one Range request (retried),
// delivers each verified chunk and an error for each other, and writes
// the verified ones to disk when disk is set.
func (s *Store) fetchChunks(ctx context.Context, l *layer, a, b int64, disk bool, deliver func(int64, []byte, error)) {
	start, _ := l.ix.ChunkRange(a)
	_, end := l.ix.ChunkRange(b - 1)
	buf := make([]byte, end-start)
	if err := s.fetchRetry(ctx, l, buf, start, a, b); err != nil {
		for i := a; i < b; i++ {
			deliver(i, nil, err)
		}
		return
	}
	s.stats.fetchedBytes.Add(int64(len(buf)))
	s.stats.fetchedChunks.Add(b - a)
	good := int64(-1) // first chunk of the verified run not yet written
	flush := func(to int64) {
		if good >= 0 && disk {
			x, _ := l.ix.ChunkRange(good)
			_, y := l.ix.ChunkRange(to - 1)
			disk = l.writeDisk(good, buf[x-start:y-start])
		}
		good = -1
	}
	for i := a; i < b; i++ {
		cs, ce := l.ix.ChunkRange(i)
		cb := buf[cs-start : ce-start]
		if err := l.ix.VerifyChunk(i, cb); err != nil {
			s.stats.verifyFailures.Add(1)
			s.logf("content store: layer %s chunk %d (blob bytes [%d, %d)) from the registry does not match the index: refused", l.name, i, cs, ce)
			deliver(i, nil, fmt.Errorf("content store: layer %s chunk %d (blob bytes [%d, %d)) as fetched: %w", l.name, i, cs, ce, err))
			flush(i)
			continue
		}
		// Each chunk gets its own copy so that the memory tier's
		// accounting holds: a slice of buf would keep all of buf alive.
		deliver(i, bytes.Clone(cb), nil)
		if good < 0 {
			good = i
		}
	}
	flush(b)
}

// fetchRetry reads blob bytes [start, start+len(buf)) with up to
// 1+Retries attempts, waiting 100 ms, 200 ms, ... between them.
func (s *Store) fetchRetry(ctx context.Context, l *layer, buf []byte, start, a, b int64) error {
	backoff := firstBackoff
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, s.attemptTimeout())
		s.stats.rangeRequests.Add(1)
		err := l.f.FetchRange(actx, buf, start)
		cancel()
		if err == nil {
			return nil
		}
		s.stats.fetchErrors.Add(1)
		if ctx.Err() != nil {
			return ErrClosed
		}
		if attempt >= s.retries {
			s.logf("content store: layer %s: fetching blob bytes [%d, %d) failed after %d attempts: %v", l.name, start, start+int64(len(buf)), attempt+1, err)
			return fmt.Errorf("content store: layer %s: fetch blob bytes [%d, %d) (chunks %d-%d), %d attempts: %w", l.name, start, start+int64(len(buf)), a, b-1, attempt+1, err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ErrClosed
		case <-t.C:
		}
		backoff *= 2
	}
}
