package lazyimage

import (
	"context"
	"fmt"
	"io"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

const (
	// streamChunk is the size of one Range GET while streaming a layer:
	// large enough that requests cost little, small enough that a retry
	// after a broken connection repeats little.
	streamChunk = 8 << 20
	// chunkTimeout bounds one chunk's GET, retries included (8 MiB at 1
	// Mbit/s takes about a minute).
	chunkTimeout = 2 * time.Minute
	// progressEvery is the default Options.ProgressInterval.
	progressEvery = 2 * time.Second
)

// streamLayer streams l's blob once and indexes it, checking the result
// is exactly the layer the manifest and config name.
func streamLayer(ctx context.Context, opts *Options, img *Image, l *layer) (*lazyindex.Index, error) {
	start := time.Now()
	opts.logf("%s: streaming %s (%s)", img.Ref, l, mib(l.desc.Size))
	last := start
	every := opts.ProgressInterval
	if every <= 0 {
		every = progressEvery
	}
	r := newStreamReader(ctx, opts.Client.Blob(ctx, img.Ref, l.desc, chunkTimeout), l.desc.Size, func(done int64) {
		if now := time.Now(); now.Sub(last) >= every {
			last = now
			opts.logf("%s: %s of %s, %.1fs", l, mib(done), mib(l.desc.Size), now.Sub(start).Seconds())
		}
	})
	defer r.Close()
	ix, err := lazyindex.Build(ctx, r, lazyindex.Options{MaxEntries: opts.maxEntries(), Layer: fmt.Sprintf("%d/%d %s", l.n, l.of, l.desc.Digest)}) // lazyindex says "layer X"
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", img.Ref, err)
	}
	if err := checkIndex(ix, l, opts.maxEntries()); err != nil {
		return nil, fmt.Errorf("image %s: %s as the registry serves it does not match the image: %w", img.Ref, l, err)
	}
	opts.logf("%s: indexed %s: %s, %d entries, %d checkpoints, %.1fs", img.Ref, l, mib(l.desc.Size), len(ix.Tree.Entries), len(ix.Checkpoints), time.Since(start).Seconds())
	return ix, nil
}

// streamReader reads a blob from start to end in streamChunk Range GETs,
// one fetched ahead while the caller consumes the last.
type streamReader struct {
	ch       chan fetched
	cur      []byte
	done     int64
	err      error
	ctx      context.Context
	cancel   context.CancelFunc
	progress func(done int64)
}

type fetched struct {
	b   []byte
	err error
}

func newStreamReader(ctx context.Context, br *registry.BlobReader, size int64, progress func(int64)) *streamReader {
	ctx, cancel := context.WithCancel(ctx)
	s := &streamReader{ch: make(chan fetched, 1), ctx: ctx, cancel: cancel, progress: progress}
	go func() {
		defer close(s.ch)
		for off := int64(0); off < size; {
			b := make([]byte, min(streamChunk, size-off))
			rctx, rcancel := context.WithTimeout(ctx, chunkTimeout)
			_, err := br.ReadAtContext(rctx, b, off)
			rcancel()
			if err != nil {
				err = fmt.Errorf("read bytes %d-%d of %d: %w", off, off+int64(len(b))-1, size, err)
			}
			select {
			case s.ch <- fetched{b, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
			off += int64(len(b))
		}
	}()
	return s
}

func (s *streamReader) Read(p []byte) (int, error) {
	for len(s.cur) == 0 {
		if s.err != nil {
			return 0, s.err
		}
		f, ok := <-s.ch
		switch {
		case !ok && s.ctx.Err() != nil:
			s.err = s.ctx.Err()
		case !ok:
			s.err = io.EOF
		case f.err != nil:
			s.err = f.err
		default:
			// Progress is reported per chunk: the bytes consumed before it.
			if s.done > 0 && s.progress != nil {
				s.progress(s.done)
			}
			s.cur = f.b
		}
	}
	n := copy(p, s.cur)
	s.cur = s.cur[n:]
	s.done += int64(n)
	return n, nil
}

// Close stops the fetching goroutine and waits for it.
func (s *streamReader) Close() {
	s.cancel()
	for range s.ch {
	}
}

// Fetcher reads byte ranges of one layer blob from the registry.
type Fetcher struct {
	client *registry.Client
	ref    registry.Reference
	desc   ocispec.Descriptor
}

// LayerFetcher returns a Fetcher of layer i's blob (as stored: compressed
// for gzip layers), or nil when there is no layer i.
func (img *Image) LayerFetcher(i int) *Fetcher {
	if i < 0 || i >= len(img.Manifest.Layers) {
		return nil
	}
	return &Fetcher{client: img.client, ref: img.Ref, desc: img.Manifest.Layers[i]}
}

// Size is the blob's size in bytes.
func (f *Fetcher) Size() int64 { return f.desc.Size }

// Descriptor is the layer blob's descriptor from the manifest.
func (f *Fetcher) Descriptor() ocispec.Descriptor { return f.desc }

// FetchRange fills p with the blob's bytes at off with one Range GET, or
// fails; a range beyond the blob is an error.
func (f *Fetcher) FetchRange(ctx context.Context, p []byte, off int64) error {
	if off < 0 || off > f.desc.Size || int64(len(p)) > f.desc.Size-off {
		return fmt.Errorf("layer %s: bytes [%d, +%d) outside the %d-byte blob", f.desc.Digest, off, len(p), f.desc.Size)
	}
	if f.client == nil {
		return fmt.Errorf("layer %s: image has no registry client", f.desc.Digest)
	}
	return f.client.FetchRange(ctx, f.ref, f.desc.Digest, p, off)
}
