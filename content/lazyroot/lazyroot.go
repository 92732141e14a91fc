// Package lazyroot opens a registry image as a pod's lazy root
// filesystem: its layer indexes (lazyimage), its merged tree for the ext4
// synthesis, and the node's content store (store) that serves its file
// data on demand, with the image's prefetch trace replayed at start (or,
// where the operator allows pushing, recorded for the next one) and the
// optional background fill. It is the one place
// `kata-fsx run`, `image build`/`serve` and the shim turn a `registry:`
// source into what imagefs-blk serves.
package lazyroot

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/content/store"
)

// Prefix marks a registry image in a source spec: registry:HOST/REPO:TAG.
const Prefix = "registry:"

// IsSource reports whether spec names a registry image.
func IsSource(spec string) bool { return strings.HasPrefix(spec, Prefix) }

// Options configure Open.
type Options struct {
	Registry config.Registry
	// IndexDir is the node's cache of lazy indexes and StoreDir its
	// content store (node.Layout's LazyIndexes and ContentStore; the node
	// package gives the whole Options from a configuration).
	IndexDir, StoreDir string
	MaxEntries         int
	// Logf receives progress and decisions; nil discards them.
	Logf func(format string, args ...any)
}

// Root is an opened registry image: Tree to synthesize ext4 from, Opener
// to read its file data through. It is safe for concurrent use.
type Root struct {
	Image *lazyimage.Image
	Tree  *index.Index

	opts   Options
	img    lazyimage.Options
	store  *store.Store
	life   context.Context // ends at Close: prefetch, fill, trace upload
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// mu guards the flags below. It is held only to read or set them and
	// to start the trace and fill goroutines, never across their work or
	// the wait for them: Close sets closed, then waits for wg unlocked.
	mu        sync.Mutex
	recording bool // no trace artifact was found and push_trace is on: record one
	started   bool
	closed    bool
	pushOnce  sync.Once
}

// TakeTree returns Tree and forgets it, so that once the caller's disk is
// built from it the merged tree is garbage: a pod serving the image then
// holds only the layers' indexes its store reads through, not a second,
// merged copy of every entry for its lifetime.
func (r *Root) TakeTree() *index.Index {
	t := r.Tree
	r.Tree = nil
	return t
}

// Open resolves spec (registry:REF) and readies its store.
func Open(ctx context.Context, spec string, o Options) (_ *Root, err error) {
	refStr, ok := strings.CutPrefix(spec, Prefix)
	if !ok || refStr == "" {
		return nil, fmt.Errorf("source %q: want registry:HOST/REPO[:TAG|@DIGEST]", spec)
	}
	ref, err := registry.ParseReference(refStr)
	if err != nil {
		return nil, fmt.Errorf("source %s: %w", spec, err)
	}
	if o.StoreDir == "" || o.IndexDir == "" {
		return nil, fmt.Errorf("source %s: no imagefs-blk state directory for the node's content store", spec)
	}
	logf := o.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	o.Logf = logf
	r := &Root{opts: o, img: ImageOptions(o)}
	if r.Image, err = lazyimage.Resolve(ctx, r.img, ref); err != nil {
		return nil, fmt.Errorf("source %s: %w", spec, err)
	}
	if r.Tree, err = r.Image.Tree(ctx, o.MaxEntries); err != nil {
		return nil, fmt.Errorf("source %s: %w", spec, err)
	}
	reg := o.Registry
	if r.store, err = OpenStore(o); err != nil {
		return nil, fmt.Errorf("source %s: %w", spec, err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, r.store.Close())
		}
	}()
	for i, ix := range r.Image.Layers {
		if err := r.store.AddLayer(ix, r.Image.LayerFetcher(i)); err != nil {
			return nil, fmt.Errorf("source %s: layer %d: %w", spec, i, err)
		}
	}
	r.life, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	if reg.Prefetch || reg.PushTrace {
		r.startPrefetch(ctx)
	}
	return r, nil
}

// startPrefetch replays the image's trace in the background (prefetch),
// or, with none, records the reads from now until TraceSeconds after
// Started to push them (push_trace). Recording is tied to pushing: a
// trace no one pushes has no use, and one pushed tells whoever can pull
// the image what this pod read, which only the operator may allow.
func (r *Root) startPrefetch(ctx context.Context) {
	reg := r.opts.Registry
	t, err := r.fetchTrace(ctx)
	if err != nil {
		if !reg.PushTrace {
			r.opts.Logf("%v: none recorded (push_trace is off)", err)
			return
		}
		r.opts.Logf("%v: recording one to push (push_trace)", err)
		r.recording = true
		r.store.StartTrace()
		return
	}
	if !reg.Prefetch {
		r.opts.Logf("prefetch trace of %s not replayed (prefetch is off)", r.Image.Ref)
		return
	}
	limit := r.traceBudget()
	r.opts.Logf("prefetch: replaying %d chunks of %s (at most %.1f MiB)", len(t.Entries), r.Image.Ref, float64(limit)/(1<<20))
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		err := r.store.Prefetch(r.life, t, limit)
		switch {
		case err != nil && r.life.Err() == nil:
			r.opts.Logf("prefetch of %s: %v", r.Image.Ref, err)
		case err == nil:
			r.opts.Logf("prefetch of %s done", r.Image.Ref)
		}
	}()
}

// traceBudget is the most a replayed trace may make this node fetch:
// max_trace_mb, and never more than the image's layers hold, since the
// trace is the registry's word, not the node's.
func (r *Root) traceBudget() int64 {
	mb := r.opts.Registry.MaxTraceMB
	if mb <= 0 {
		mb = config.DefaultMaxTraceMB
	}
	return min(int64(mb)<<20, r.CompressedSize())
}

// fetchTrace returns the image's prefetch trace, or why there is none
// to replay.
func (r *Root) fetchTrace(ctx context.Context) (store.Trace, error) {
	b, err := lazyimage.FetchTrace(ctx, r.img, r.Image)
	if errors.Is(err, registry.ErrNotFound) {
		return store.Trace{}, fmt.Errorf("no prefetch trace for %s", r.Image.Ref)
	}
	if err != nil {
		return store.Trace{}, fmt.Errorf("prefetch trace of %s unavailable (%w)", r.Image.Ref, err)
	}
	t, err := store.DecodeTrace(b)
	if err != nil {
		return store.Trace{}, fmt.Errorf("prefetch trace of %s refused (%w)", r.Image.Ref, err)
	}
	return t, nil
}

// Opener reads the image's file data through the store; other sources
// (none in a registry image's tree) go to this host's files.
func (r *Root) Opener() index.Opener { return r.store.Opener(hostfs.Opener{}) }

// Stats is what the store did so far.
func (r *Root) Stats() store.Stats { return r.store.Stats() }

// CompressedSize is the image's layers' stored bytes: what pulling it costs.
func (r *Root) CompressedSize() int64 {
	var n int64
	for _, l := range r.Image.Layers {
		n += l.CompressedSize
	}
	return n
}

// Started marks the container's process as running: the trace being
// recorded ends TraceSeconds later and is pushed, and the background fill
// starts.
func (r *Root) Started() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started || r.closed {
		return
	}
	r.started = true
	reg := r.opts.Registry
	if r.recording {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			select {
			case <-time.After(time.Duration(reg.TraceSeconds) * time.Second):
				r.pushOnce.Do(r.pushTrace)
			case <-r.life.Done():
			}
		}()
	}
	if reg.BackgroundFillMbps > 0 {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			if err := r.store.Fill(r.life, int64(reg.BackgroundFillMbps)*1e6/8); err != nil && r.life.Err() == nil {
				r.opts.Logf("background fill of %s: %v", r.Image.Ref, err)
			}
		}()
	}
}

func (r *Root) pushTrace() {
	t := r.store.StopTrace()
	if len(t.Entries) == 0 {
		r.opts.Logf("prefetch trace of %s: no chunk read in the window; nothing pushed", r.Image.Ref)
		return
	}
	b, err := t.MarshalBinary()
	if err != nil {
		r.opts.Logf("prefetch trace of %s: %v", r.Image.Ref, err)
		return
	}
	// Close may be what ends the window (a short-lived container): the
	// upload gets a deadline of its own, not the store's lifetime.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, err := lazyimage.PushTrace(ctx, r.img, r.Image, b)
	if err != nil {
		r.opts.Logf("prefetch trace of %s not pushed (%d chunks): %v", r.Image.Ref, len(t.Entries), err)
		return
	}
	r.opts.Logf("prefetch trace of %s pushed: %d chunks, %s", r.Image.Ref, len(t.Entries), d.Digest)
}

// Close stops the prefetch and fill, pushes a trace still being
// recorded, and closes the store.
func (r *Root) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	record := r.recording && r.started
	r.mu.Unlock()
	r.cancel()
	r.wg.Wait()
	if record {
		// A container that ended inside the window still leaves its trace.
		r.pushOnce.Do(r.pushTrace)
	}
	st := r.store.Stats()
	r.opts.Logf("lazy image %s: fetched %d of %d bytes in %d range requests (%d memory hits, %d disk hits, %d read errors, %d chunks refused)",
		r.Image.Ref, st.FetchedBytes, r.CompressedSize(), st.RangeRequests, st.MemoryHits, st.DiskHits, st.ReadErrors, st.VerifyFailures)
	return r.store.Close()
}
