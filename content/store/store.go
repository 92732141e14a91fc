package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
)

// Fetcher reads bytes of one layer blob from its remote (a registry); it
// must fill p exactly or fail.
type Fetcher interface {
	FetchRange(ctx context.Context, p []byte, off int64) error
}

// Defaults of Options.
const (
	DefaultMemoryBytes = 64 << 20
	DefaultReadTimeout = 30 * time.Second
	DefaultMaxFetch    = 8 << 20
	DefaultRetries     = 3
	// firstBackoff is the wait before the first retry, doubled after each.
	firstBackoff = 100 * time.Millisecond
	// lockPoll is how often a fetch that finds another process fetching
	// the same chunks looks again; short, as that fetch is a reader's.
	lockPoll = 5 * time.Millisecond
)

// ErrReadTimeout is wrapped by the error of a read whose chunks did not
// arrive within Options.ReadTimeout.
var ErrReadTimeout = errors.New("lazy read deadline exceeded")

// ErrClosed is returned by reads and fetches of a closed Store.
var ErrClosed = errors.New("content store closed")

// Options configure a Store.
type Options struct {
	Dir         string                           // node disk tier root (e.g. <imagefs_blk state_dir>/content); "" = memory only
	MemoryBytes int64                            // bound of the memory tier (decompressed spans / chunks); 0 = 64 MiB
	ReadTimeout time.Duration                    // deadline of one guest read, network included; 0 = 30 s
	MaxFetch    int64                            // adjacent missing chunks are merged into one Range GET up to this; 0 = 8 MiB
	Retries     int                              // attempts per fetch after the first, with backoff from 100 ms doubling; 0 = 3, <0 = none
	Logf        func(format string, args ...any) // nil = discard
}

// Stats counts what a Store did since Open.
type Stats struct {
	FetchedBytes   int64 // bytes received from Fetchers in successful fetches
	FetchedChunks  int64 // chunks those fetches carried
	RangeRequests  int64 // FetchRange calls, retries included
	FetchErrors    int64 // FetchRange calls that failed
	MemoryHits     int64 // chunks and spans a read found in the memory tier
	DiskHits       int64 // chunks read from the node disk tier
	VerifyFailures int64 // fetched or cached chunks whose SHA-256 did not match the index
	ReadErrors     int64 // reads that returned an error (the guest's EIO)
	SpansInflated  int64 // gzip spans inflated from a checkpoint
	DiskFull       int64 // chunk writes refused for lack of space on the node disk
	MemoryBytes    int64 // bytes the memory tier holds now
}

type counters struct {
	fetchedBytes, fetchedChunks, rangeRequests, fetchErrors atomic.Int64
	memoryHits, diskHits, verifyFailures, readErrors        atomic.Int64
	spansInflated, diskFull                                 atomic.Int64
}

// Store is the node's lazy content store: a memory tier, a node disk tier
// and the layers' registries behind them. It is safe for concurrent use.
type Store struct {
	opts        Options
	readTimeout time.Duration
	maxFetch    int64
	retries     int
	logf        func(format string, args ...any)
	diskRetry   time.Duration // diskRetry, shortened by tests
	mem         *memTier
	stats       counters

	// ctx ends with Close; background fetches run under it.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// mu guards closed and the layer tables. It comes after a layer's mu
	// (startRunLocked) and before memTier.mu, and is never held across
	// I/O or a wait: see the package's lock order.
	mu     sync.Mutex
	closed bool
	layers map[string]*layer // by DiffID
	blobs  map[string]*layer // by blob digest
	order  []*layer          // in the order added, for Fill

	tracing atomic.Bool
	// tmu guards the trace; it is taken with no other lock held.
	tmu   sync.Mutex
	tseen map[TraceEntry]bool
	tlog  []TraceEntry
}

// Open makes a Store; with opts.Dir it creates <Dir>/layers for the node
// disk tier.
func Open(opts Options) (*Store, error) {
	if opts.MemoryBytes < 0 || opts.ReadTimeout < 0 || opts.MaxFetch < 0 {
		return nil, fmt.Errorf("content store: negative MemoryBytes %d, ReadTimeout %v or MaxFetch %d", opts.MemoryBytes, opts.ReadTimeout, opts.MaxFetch)
	}
	s := &Store{
		opts:        opts,
		readTimeout: opts.ReadTimeout,
		maxFetch:    opts.MaxFetch,
		retries:     opts.Retries,
		diskRetry:   diskRetry,
		logf:        opts.Logf,
		layers:      make(map[string]*layer),
		blobs:       make(map[string]*layer),
	}
	if s.readTimeout == 0 {
		s.readTimeout = DefaultReadTimeout
	}
	if s.maxFetch == 0 {
		s.maxFetch = DefaultMaxFetch
	}
	switch {
	case s.retries == 0:
		s.retries = DefaultRetries
	case s.retries < 0:
		s.retries = 0
	}
	if s.logf == nil {
		s.logf = func(string, ...any) {}
	}
	mb := opts.MemoryBytes
	if mb == 0 {
		mb = DefaultMemoryBytes
	}
	s.mem = newMemTier(mb)
	if opts.Dir != "" {
		if err := os.MkdirAll(filepath.Join(opts.Dir, "layers"), 0o700); err != nil {
			return nil, fmt.Errorf("content store: node cache directory: %w", err)
		}
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Close ends background fetches, waits for them and closes the cache
// files; reads after Close fail with ErrClosed.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	var errs []error
	for _, l := range s.order {
		errs = append(errs, l.close())
	}
	return errors.Join(errs...)
}

// AddLayer registers a layer's index and where to fetch its blob; the same
// DiffID twice is a no-op.
func (s *Store) AddLayer(ix *lazyindex.Index, f Fetcher) error {
	if ix == nil || f == nil {
		return errors.New("content store: AddLayer needs an index and a fetcher")
	}
	if err := checkIndex(ix); err != nil {
		return err
	}
	// Offsets and checkpoints are trusted from here on: an index not
	// from Decode (which validates) is checked the same way.
	if err := ix.Validate(); err != nil {
		return fmt.Errorf("content store: layer %s: %w", ix.Digest, err)
	}
	if done, err := s.register(ix, nil); done || err != nil {
		return err
	}
	// Opening the layer's files waits (up to initLockWait) for the chunk
	// map's header lock, which another process may hold while it waits
	// for a fetch: under s.mu that wait would stop every read of the
	// other layers (they take s.mu to start a fetch) past its deadline.
	l, err := newLayer(s, ix, f)
	if err != nil {
		return err
	}
	if done, err := s.register(ix, l); done || err != nil {
		l.close()
		return err
	}
	return nil
}

// register takes s.mu and says whether AddLayer of ix is done (the
// Store is closed, or ix or its blob is added already); otherwise it
// registers l, when not nil.
func (s *Store) register(ix *lazyindex.Index, l *layer) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return true, ErrClosed
	}
	if s.layers[ix.DiffID] != nil {
		return true, nil
	}
	if o := s.blobs[ix.Digest]; o != nil {
		return true, fmt.Errorf("content store: layer blob %s is already added with DiffID %s, not %s", ix.Digest, o.ix.DiffID, ix.DiffID)
	}
	if l != nil {
		s.layers[ix.DiffID] = l
		s.blobs[ix.Digest] = l
		s.order = append(s.order, l)
	}
	return false, nil
}

// checkIndex refuses an index the store cannot serve from: it names a file
// after the digest and addresses chunks by the index's sizes.
func checkIndex(ix *lazyindex.Index) error {
	if _, err := blobHex(ix.Digest); err != nil {
		return fmt.Errorf("content store: layer %q: %w", ix.Digest, err)
	}
	if ix.Format != lazyindex.FormatPlain && ix.Format != lazyindex.FormatGzip {
		return fmt.Errorf("content store: layer %s: unknown format %d", ix.Digest, ix.Format)
	}
	if ix.ChunkSize <= 0 || ix.CompressedSize < 0 || ix.NumChunks() != int64(len(ix.Chunks)) {
		return fmt.Errorf("content store: layer %s: %d chunk digests for %d bytes in chunks of %d (an index without chunk digests cannot be served lazily: rebuild it)",
			ix.Digest, len(ix.Chunks), ix.CompressedSize, ix.ChunkSize)
	}
	if ix.Format == lazyindex.FormatPlain && ix.Size != ix.CompressedSize {
		return fmt.Errorf("content store: plain layer %s: size %d differs from blob size %d", ix.Digest, ix.Size, ix.CompressedSize)
	}
	if ix.Format == lazyindex.FormatGzip && (len(ix.Checkpoints) == 0 || ix.Checkpoints[0].Out != 0) {
		return fmt.Errorf("content store: gzip layer %s has no checkpoint at offset 0", ix.Digest)
	}
	return nil
}

func blobHex(d string) (string, error) {
	const p = "sha256:"
	if len(d) != len(p)+64 || d[:len(p)] != p {
		return "", errors.New("not a sha256 digest")
	}
	for _, c := range d[len(p):] {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return "", errors.New("not a sha256 digest")
		}
	}
	return d[len(p):], nil
}

// Opener serves SourceBlob sources whose ID is an added layer's DiffID
// lazily and hands every other source to fallback (nil: refused).
func (s *Store) Opener(fallback index.Opener) index.Opener {
	return &opener{s: s, fallback: fallback}
}

type opener struct {
	s        *Store
	fallback index.Opener
}

func (o *opener) Open(src index.Source, path string) (io.ReaderAt, error) {
	if src.Kind == index.SourceBlob {
		o.s.mu.Lock()
		l := o.s.layers[src.ID]
		closed := o.s.closed
		o.s.mu.Unlock()
		if l != nil {
			if closed {
				return nil, ErrClosed
			}
			if path != "" {
				return nil, fmt.Errorf("content store: blob source %s opened with path %q", src.ID, path)
			}
			return &reader{l: l}, nil
		}
	}
	if o.fallback == nil {
		return nil, fmt.Errorf("content store: source %s is no lazy layer and there is no fallback opener", src.ID)
	}
	return o.fallback.Open(src, path)
}

// Stats returns the counters since Open.
func (s *Store) Stats() Stats {
	c := &s.stats
	return Stats{
		FetchedBytes:   c.fetchedBytes.Load(),
		FetchedChunks:  c.fetchedChunks.Load(),
		RangeRequests:  c.rangeRequests.Load(),
		FetchErrors:    c.fetchErrors.Load(),
		MemoryHits:     c.memoryHits.Load(),
		DiskHits:       c.diskHits.Load(),
		VerifyFailures: c.verifyFailures.Load(),
		ReadErrors:     c.readErrors.Load(),
		SpansInflated:  c.spansInflated.Load(),
		DiskFull:       c.diskFull.Load(),
		MemoryBytes:    s.mem.bytes(),
	}
}
