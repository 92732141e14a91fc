package lazyimage

import (
	"context"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestOptionsMaxIndex: an index blob's bound is the smaller of the
// layer-derived one and Options.MaxIndexBytes (64 MiB when unset).
func TestOptionsMaxIndex(t *testing.T) {
	for _, c := range []struct {
		abs, layer, want int64
	}{
		{0, 10 << 20, 24 << 20},
		{0, 1 << 30, defaultCap},
		{0, 1 << 62, defaultCap},
		{1 << 20, 10 << 20, 1 << 20},
		{1 << 40, 1 << 62, maxIndexSize(1 << 62)},
	} {
		o := Options{MaxIndexBytes: c.abs}
		if got := o.maxIndex(c.layer); got != c.want {
			t.Errorf("MaxIndexBytes %d, layer of %d bytes: bound %d, want %d", c.abs, c.layer, got, c.want)
		}
	}
}

// TestMaxIndexBytesConfigurable: a bound set in Options refuses a blob
// under the default one, before any request.
func TestMaxIndexBytesConfigurable(t *testing.T) {
	f := newFakeRegistry(t)
	md := f.image(t, 100<<20)
	blob := ocispec.Descriptor{Digest: digest.FromString("two MiB"), Size: 2 << 20}
	ad := f.indexArtifact(t, md, blob, created, serveGarbage(blob.Size, blob.Size))
	var l logs
	if _, err := Resolve(context.Background(), Options{Client: f.client, Logf: l.Logf, MaxIndexBytes: 1 << 20}, f.ref); err == nil {
		t.Fatal("Resolve succeeded without the layer or a usable index")
	}
	if n := f.blobRequests(blob.Digest); n != 0 || !l.Has(ad.Digest.String(), "refused", "over the 1048576 limit", "max_index_mb") {
		t.Errorf("%d requests for the blob, want none and a refusal naming max_index_mb:\n%s", n, l.String())
	}
}
