package registry

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Growth of the buffer readBlob reads a blob into.
const (
	// blobFirstBuf is the buffer a blob's first bytes go to.
	blobFirstBuf = 64 << 10
	// blobDoubleUntil is where doubling stops: past it the buffer grows
	// once, to the declared size, so a read holds at most that size plus
	// this (doubling all the way holds the old buffer and its copy
	// together: up to one and a half times the size, more with garbage
	// not yet collected).
	blobDoubleUntil = 1 << 20
)

// FetchBlob reads all of blob desc from ref's repository and returns it
// checked against desc's digest. limit bounds the blob: a descriptor over it
// is refused before any request, an answer whose Content-Length is not
// desc.Size before its body is read, and a body that brings more than
// desc.Size bytes as soon as one byte more arrives. The buffer grows only
// as bytes arrive, so a read never holds more than desc.Size bytes plus
// 1 MiB, whatever the registry says or sends.
func (c *Client) FetchBlob(ctx context.Context, ref Reference, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	op := "fetch blob " + string(desc.Digest)
	if err := checkBlobDesc(desc, limit); err != nil {
		return nil, &Error{Host: ref.Host, Repository: ref.Repository, Op: op, Err: err}
	}
	// One buffer for every attempt and host, so a retry after a broken
	// transfer reuses it instead of leaving it to the collector.
	var buf []byte
	var out []byte
	once := func(h Host) error {
		resp, err := c.do(ctx, h, ref, request{
			method: http.MethodGet,
			path:   "/" + ref.Repository + "/blobs/" + desc.Digest.String(),
			scope:  pullScope(ref),
			ok:     []int{http.StatusOK},
		})
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		switch n := resp.ContentLength; {
		case n > desc.Size:
			return fmt.Errorf("%w: Content-Length %d, the descriptor says %d bytes", ErrTooLarge, n, desc.Size)
		case n >= 0 && n < desc.Size:
			return fmt.Errorf("Content-Length %d, the descriptor says %d bytes", n, desc.Size)
		}
		buf, err = readBlob(resp.Body, desc.Size, desc.Digest, buf)
		if err != nil {
			return err
		}
		out = buf
		return nil
	}
	err := c.onHosts(ctx, ref, CapPull, op, func(h Host) error {
		return c.retryCut(ctx, func() error { return once(h) })
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// checkBlobDesc refuses a descriptor FetchBlob cannot read within limit.
func checkBlobDesc(desc ocispec.Descriptor, limit int64) error {
	if err := desc.Digest.Validate(); err != nil {
		return fmt.Errorf("descriptor digest %q: %w", truncate(string(desc.Digest)), err)
	}
	if !desc.Digest.Algorithm().Available() {
		return fmt.Errorf("descriptor digest %q: algorithm not available", truncate(string(desc.Digest)))
	}
	if desc.Size <= 0 {
		return fmt.Errorf("descriptor size %d", desc.Size)
	}
	if desc.Size > limit {
		return fmt.Errorf("%w: the descriptor says %d bytes, the limit is %d", ErrTooLarge, desc.Size, limit)
	}
	return nil
}

// readBlob reads a blob of size bytes from r into buf's storage (grown as
// bytes arrive, never past size) while hashing it, and checks it is
// exactly size bytes with digest d, which must be valid and available.
// It returns the buffer even with an error, for the next attempt; its
// bytes are the blob only when the error is nil. A body that ends early
// or breaks is errBodyCut, so that the caller retries it.
func readBlob(r io.Reader, size int64, d digest.Digest, buf []byte) ([]byte, error) {
	h := d.Algorithm().Hash()
	// One byte past size is read to tell an exact body from a longer one.
	lr := io.LimitReader(r, min(size, math.MaxInt64-1)+1)
	buf = buf[:0]
	for int64(len(buf)) < size {
		if len(buf) == cap(buf) {
			next := size
			if len(buf) < blobDoubleUntil {
				next = min(size, max(blobFirstBuf, 2*int64(cap(buf))))
			}
			nb := make([]byte, len(buf), next)
			copy(nb, buf)
			buf = nb
		}
		n, err := lr.Read(buf[len(buf):cap(buf)])
		h.Write(buf[len(buf) : len(buf)+n])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			if int64(len(buf)) < size {
				return buf, fmt.Errorf("read blob body: %w: %d of %d bytes", errBodyCut, len(buf), size)
			}
			break
		}
		if err != nil {
			return buf, fmt.Errorf("read blob body: %w (%v)", errBodyCut, err)
		}
	}
	// An error after all size bytes decides nothing: the digest does.
	var more [1]byte
	if n, _ := io.ReadFull(lr, more[:]); n > 0 {
		return buf, fmt.Errorf("%w: the body brings more than the descriptor's %d bytes", ErrTooLarge, size)
	}
	if got := digest.NewDigest(d.Algorithm(), h); got != d {
		return buf, fmt.Errorf("blob content has digest %s, not %s", got, d)
	}
	return buf, nil
}
