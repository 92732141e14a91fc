package lazyimage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/test/logtest"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

type fixture struct {
	reg    *registrytest.Registry
	client *registry.Client
	img    *lazyimagetest.Image
	ctx    context.Context
}

// logs records what the code under test logged.
type logs = logtest.Lines

func newFixture(t *testing.T) *fixture {
	t.Helper()
	reg := registrytest.Start(t, registrytest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return &fixture{reg: reg, client: registry.New(registry.Options{ConfigPath: reg.HostsDir(t, ""), Attempts: 2, Backoff: 50 * time.Millisecond}),
		img: lazyimagetest.TwoLayers(t, "v1"), ctx: ctx}
}

// push pushes the fixture's image to repo:v1 and returns its reference.
func (f *fixture) push(t *testing.T, repo string) registry.Reference {
	t.Helper()
	f.reg.Push(t, f.img.Dir, "v1", repo+":v1")
	ref, err := registry.ParseReference(f.reg.Addr + "/" + repo + ":v1")
	if err != nil {
		t.Fatal(err)
	}
	return ref
}

func (f *fixture) opts(l *logs, cacheDir string) Options {
	return Options{Client: f.client, CacheDir: cacheDir, Logf: l.Logf}
}

// sameIndexes fails unless a and b hold the same layer indexes (encodings
// equal: trees, checkpoints, chunk digests) and merge to the same tree.
func sameIndexes(t *testing.T, a, b *Image) {
	t.Helper()
	if len(a.Layers) != len(b.Layers) {
		t.Fatalf("%d layers vs %d", len(a.Layers), len(b.Layers))
	}
	for i := range a.Layers {
		ea, err := a.Encoded(i)
		if err != nil {
			t.Fatal(err)
		}
		eb, err := b.Encoded(i)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(ea, eb) {
			t.Fatalf("layer %d: indexes differ (%s vs %s)", i+1, b.LayerSources[i], a.LayerSources[i])
		}
		if !reflect.DeepEqual(a.Layers[i].Checkpoints, b.Layers[i].Checkpoints) {
			t.Fatalf("layer %d: checkpoints differ", i+1)
		}
	}
	ta, err := a.Tree(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	tb, err := b.Tree(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(ta, tb) {
		t.Fatal("merged trees differ")
	}
}

// fetcherAt reads a layer blob through its Fetcher as an io.ReaderAt.
type fetcherAt struct {
	ctx context.Context
	f   *Fetcher
}

func (r fetcherAt) ReadAt(p []byte, off int64) (int, error) {
	n := min(int64(len(p)), r.f.Size()-off)
	if n < 0 {
		return 0, io.EOF
	}
	if err := r.f.FetchRange(r.ctx, p[:n], off); err != nil {
		return 0, err
	}
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// checkContent reads files of the merged tree through the layer indexes
// and LayerFetcher, as the content store does, and checks the overlay.
func checkContent(t *testing.T, ctx context.Context, img *Image, want *lazyimagetest.Image) {
	t.Helper()
	tree, err := img.Tree(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if tree.Lookup("etc/b") >= 0 {
		t.Fatal("etc/b, whited out by the upper layer, is in the merged tree")
	}
	for _, c := range []struct {
		path  string
		layer int
		data  []byte
	}{
		{"etc/a", 0, want.Tars[0]},
		{"etc/c", 1, nil},
		{"data/text", 0, nil},
		{"data/random", 0, nil},
	} {
		i := tree.Lookup(c.path)
		if i < 0 {
			t.Fatalf("%s missing from the merged tree", c.path)
		}
		e := &tree.Entries[i]
		src := tree.Sources[e.Data.Source]
		layer := -1
		for li, ix := range img.Layers {
			if ix.DiffID == src.ID {
				layer = li
			}
		}
		if layer != c.layer || src.Kind != index.SourceBlob {
			t.Fatalf("%s: source %+v is not layer %d", c.path, src, c.layer+1)
		}
		// Read the middle of the file, which needs a checkpoint past the
		// first for the large ones.
		off, n := e.Size/2, min(e.Size-e.Size/2, 64<<10)
		got := make([]byte, n)
		if _, err := img.Layers[layer].ReadAt(ctx, fetcherAt{ctx, img.LayerFetcher(layer)}, got, e.Data.Offset+off); err != nil {
			t.Fatalf("%s: read through the index: %v", c.path, err)
		}
		tar := want.Tars[layer]
		if !bytes.Equal(got, tar[e.Data.Offset+off:e.Data.Offset+off+n]) {
			t.Fatalf("%s: bytes read through the index differ from the layer's", c.path)
		}
	}
}

// TestBuildPushResolve: an image pushed with skopeo is indexed by
// streaming, its artifact pushed; Resolve then uses the artifact (found
// through the referrers tag schema, as docker-registry 2.8 has no
// referrers API) and gets exactly what Build got.
func TestBuildPushResolve(t *testing.T) {
	f := newFixture(t)
	ref := f.push(t, "kata/lazy")
	var bl logs
	bo := f.opts(&bl, "")
	bo.ProgressInterval = time.Nanosecond
	built, err := Build(f.ctx, bo, ref)
	if err != nil {
		t.Fatal(err)
	}
	if built.IndexSource != SourceStreamed || len(built.Layers) != 2 {
		t.Fatalf("Build: source %q, %d layers", built.IndexSource, len(built.Layers))
	}
	if len(built.Layers[0].Checkpoints) < 3 {
		t.Fatalf("lower layer has %d checkpoints; the test wants several", len(built.Layers[0].Checkpoints))
	}
	if built.Manifest.Layers[0].Size <= streamChunk {
		t.Fatalf("lower layer blob of %d bytes fits one stream chunk; the test wants several", built.Manifest.Layers[0].Size)
	}
	for i := range built.Layers {
		if built.Layers[i].Digest != f.img.Manifest.Layers[i].Digest.String() || built.Layers[i].DiffID != f.img.Config.RootFS.DiffIDs[i].String() {
			t.Fatalf("layer %d: index of %s (%s), want %s", i+1, built.Layers[i].Digest, built.Layers[i].DiffID, f.img.Manifest.Layers[i].Digest)
		}
	}
	if !bl.Has("streaming layer 1/2 "+f.img.Manifest.Layers[0].Digest.String()) || !bl.Has("indexed layer 2/2", "checkpoints") ||
		!bl.Has("layer 1/2 "+f.img.Manifest.Layers[0].Digest.String()+": 8.0 MiB of "+mib(f.img.Manifest.Layers[0].Size)) {
		t.Fatalf("Build did not report its streaming:\n%s", bl.String())
	}
	checkContent(t, f.ctx, built, f.img)

	ad, err := Push(f.ctx, f.opts(&bl, ""), built)
	if err != nil {
		t.Fatal(err)
	}
	if ad.ArtifactType != ArtifactType {
		t.Fatalf("pushed artifact type %q", ad.ArtifactType)
	}
	// The referrers tag schema: the tag sha256-<manifest hex> lists it.
	tagRef := ref
	tagRef.Tag = "sha256-" + built.ManifestDesc.Digest.Encoded()
	if _, err := f.client.Resolve(f.ctx, tagRef); err != nil {
		t.Fatalf("referrers tag %s after Push: %v", tagRef.Tag, err)
	}
	if ds, err := f.client.Referrers(f.ctx, ref, built.ManifestDesc.Digest, ArtifactType); err != nil || len(ds) != 1 || ds[0].Digest != ad.Digest {
		t.Fatalf("referrers %v, %v; want the artifact %s", ds, err, ad.Digest)
	}

	var rl logs
	got, err := Resolve(f.ctx, f.opts(&rl, ""), ref)
	if err != nil {
		t.Fatal(err)
	}
	if got.IndexSource != "artifact "+ad.Digest.String() {
		t.Fatalf("Resolve after Push: source %q, want the artifact %s\n%s", got.IndexSource, ad.Digest, rl.String())
	}
	if rl.Has("streaming") {
		t.Fatalf("Resolve streamed with an artifact present:\n%s", rl.String())
	}
	sameIndexes(t, built, got)
	checkContent(t, f.ctx, got, f.img)
}

// TestResolveStreamsWithoutArtifact: no artifact, so each layer is
// streamed once, and the log says so.
func TestResolveStreamsWithoutArtifact(t *testing.T) {
	f := newFixture(t)
	ref := f.push(t, "kata/noart")
	var l logs
	img, err := Resolve(f.ctx, f.opts(&l, ""), ref)
	if err != nil {
		t.Fatal(err)
	}
	if img.IndexSource != SourceStreamed {
		t.Fatalf("source %q, want %q", img.IndexSource, SourceStreamed)
	}
	if !l.Has("no index artifact refers to manifest "+img.ManifestDesc.Digest.String()) ||
		!l.Has("no usable index artifact for "+ref.String(), "building by streaming 2 of 2 layers") {
		t.Fatalf("Resolve did not say it streams:\n%s", l.String())
	}
	checkContent(t, f.ctx, img, f.img)
}

// TestNodeCache: a warm node resolves an image by digest from its cache
// with the registry dead; a damaged cache file is logged and rebuilt.
func TestNodeCache(t *testing.T) {
	f := newFixture(t)
	tagged := f.push(t, "kata/cache")
	cache := t.TempDir()
	var l logs
	first, err := Resolve(f.ctx, f.opts(&l, cache), tagged)
	if err != nil {
		t.Fatal(err)
	}
	byDigest := tagged
	byDigest.Tag, byDigest.Digest = "", first.ManifestDesc.Digest
	// The first resolve by digest caches the manifest and config.
	if _, err := Resolve(f.ctx, f.opts(&l, cache), byDigest); err != nil {
		t.Fatal(err)
	}
	for _, ld := range first.Manifest.Layers {
		if _, err := os.Stat(indexCachePath(cache, ld.Digest)); err != nil {
			t.Fatalf("layer %s not cached: %v", ld.Digest, err)
		}
	}

	f.reg.Stop()
	var wl logs
	warm, err := Resolve(f.ctx, f.opts(&wl, cache), byDigest)
	if err != nil {
		t.Fatalf("Resolve by digest from the cache with the registry stopped: %v\n%s", err, wl.String())
	}
	if warm.IndexSource != SourceNodeCache {
		t.Fatalf("source %q, want %q", warm.IndexSource, SourceNodeCache)
	}
	sameIndexes(t, first, warm)
	if _, err := Resolve(f.ctx, f.opts(&wl, cache), tagged); err == nil || !strings.Contains(err.Error(), f.reg.Addr) {
		t.Fatalf("Resolve by tag with the registry stopped: %v, want an error naming %s (a tag can move)", err, f.reg.Addr)
	}

	f.reg.Start()
	p := indexCachePath(cache, first.Manifest.Layers[1].Digest)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] ^= 0xff
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	var dl logs
	img, err := Resolve(f.ctx, f.opts(&dl, cache), tagged)
	if err != nil {
		t.Fatal(err)
	}
	if img.LayerSources[0] != SourceNodeCache || img.LayerSources[1] != SourceStreamed || !dl.Has("node cache index "+p+" of layer 2/2", "unusable") {
		t.Fatalf("damaged cache entry: sources %q\n%s", img.LayerSources, dl.String())
	}
	if img.IndexSource != "node cache (layer 1) + built by streaming (layer 2)" {
		t.Fatalf("IndexSource %q", img.IndexSource)
	}
	sameIndexes(t, first, img)
	if nb, err := os.ReadFile(p); err != nil || bytes.Equal(nb, b) {
		t.Fatalf("damaged cache entry not rewritten: %v", err)
	}
}

// pushRawArtifact pushes an index artifact with the given blobs, each
// annotated as indexing the given image layer.
func pushRawArtifact(t *testing.T, f *fixture, img *Image, blobs [][]byte, layers []digest.Digest) ocispec.Descriptor {
	t.Helper()
	ds := make([]ocispec.Descriptor, len(blobs))
	for i := range blobs {
		ds[i] = ocispec.Descriptor{MediaType: IndexMediaType, Annotations: map[string]string{AnnotationLayerDigest: layers[i].String()}}
	}
	o := Options{Client: f.client}
	d, err := pushArtifact(f.ctx, &o, img, ArtifactType, ds, blobs, nil)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestHostileArtifacts: a truncated index, garbage, an index of another
// layer, an oversized index and a manifest that is not an index artifact
// are each refused with a log line naming them, and the layers streamed
// instead; a good older artifact is still used past a bad newer one.
func TestHostileArtifacts(t *testing.T) {
	f := newFixture(t)
	ref0 := f.push(t, "kata/built")
	built, err := Build(f.ctx, Options{Client: f.client}, ref0)
	if err != nil {
		t.Fatal(err)
	}
	enc := make([][]byte, 2)
	for i := range enc {
		if enc[i], err = built.Encoded(i); err != nil {
			t.Fatal(err)
		}
	}
	layer := []digest.Digest{built.Manifest.Layers[0].Digest, built.Manifest.Layers[1].Digest}
	cases := []struct {
		name string
		// push pushes the bad artifact for img; want is a part of the
		// refusal's log line.
		push func(t *testing.T, img *Image) ocispec.Descriptor
		want string
		// streamed lists the layers (0-based) that must be streamed.
		streamed []int
	}{
		{"truncated index", func(t *testing.T, img *Image) ocispec.Descriptor {
			return pushRawArtifact(t, f, img, [][]byte{enc[0][:len(enc[0])/2], enc[1]}, layer)
		}, "payload truncated", []int{0}},
		{"garbage", func(t *testing.T, img *Image) ocispec.Descriptor {
			return pushRawArtifact(t, f, img, [][]byte{enc[0], lazyimagetest.Random(9, 5000)}, layer)
		}, "bad magic", []int{1}},
		{"index of another layer", func(t *testing.T, img *Image) ocispec.Descriptor {
			return pushRawArtifact(t, f, img, [][]byte{enc[1], enc[0]}, layer)
		}, "it indexes blob " + layer[1].String() + ", not " + layer[0].String(), []int{0, 1}},
		{"oversized index", func(t *testing.T, img *Image) ocispec.Descriptor {
			big := append(bytes.Clone(enc[1]), make([]byte, maxIndexSize(built.Manifest.Layers[1].Size))...)
			return pushRawArtifact(t, f, img, [][]byte{enc[0], big}, layer)
		}, "over the", []int{1}},
		{"missing layer", func(t *testing.T, img *Image) ocispec.Descriptor {
			return pushRawArtifact(t, f, img, [][]byte{enc[0]}, layer[:1])
		}, "has no index of layer 2/2", []int{1}},
		{"duplicate layer annotation", func(t *testing.T, img *Image) ocispec.Descriptor {
			return pushRawArtifact(t, f, img, [][]byte{enc[0], enc[1]}, []digest.Digest{layer[0], layer[0]})
		}, "two indexes", []int{0, 1}},
		{"wrong layer media type", func(t *testing.T, img *Image) ocispec.Descriptor {
			o := Options{Client: f.client}
			d, err := pushArtifact(f.ctx, &o, img, ArtifactType, []ocispec.Descriptor{
				{MediaType: "application/octet-stream", Annotations: map[string]string{AnnotationLayerDigest: layer[0].String()}}}, [][]byte{enc[0]}, nil)
			if err != nil {
				t.Fatal(err)
			}
			return d
		}, "media type \"application/octet-stream\"", []int{0, 1}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ref := f.push(t, fmt.Sprintf("kata/hostile%d", i))
			target, err := Build(f.ctx, Options{Client: f.client}, ref)
			if err != nil {
				t.Fatal(err)
			}
			bad := c.push(t, target)
			var l logs
			img, err := Resolve(f.ctx, f.opts(&l, ""), ref)
			if err != nil {
				t.Fatalf("Resolve with a bad artifact: %v\n%s", err, l.String())
			}
			if !l.Has(bad.Digest.String(), c.want) {
				t.Fatalf("no log line naming artifact %s and %q:\n%s", bad.Digest, c.want, l.String())
			}
			for li := range img.Layers {
				want := "artifact " + bad.Digest.String()
				for _, s := range c.streamed {
					if s == li {
						want = SourceStreamed
					}
				}
				if img.LayerSources[li] != want {
					t.Fatalf("layer %d from %q, want %q\n%s", li+1, img.LayerSources[li], want, l.String())
				}
			}
			if !l.Has("building by streaming") {
				t.Fatalf("the fallback to streaming was not logged:\n%s", l.String())
			}
			sameIndexes(t, built, img)
			checkContent(t, f.ctx, img, f.img)
		})
	}

	// The registry's stored copy of a good artifact's index blob cut short
	// (a damaged store): what it serves no longer matches the descriptor.
	t.Run("index blob truncated in the registry", func(t *testing.T) {
		ref := f.push(t, "kata/cut")
		target, err := Build(f.ctx, Options{Client: f.client}, ref)
		if err != nil {
			t.Fatal(err)
		}
		ad, err := Push(f.ctx, Options{Client: f.client}, target)
		if err != nil {
			t.Fatal(err)
		}
		blob := digest.FromBytes(enc[0])
		p := f.reg.BlobPath(blob)
		if err := os.Truncate(p, int64(len(enc[0])/3)); err != nil {
			t.Fatal(err)
		}
		// The registry keeps one copy of a blob for all repositories.
		defer func() {
			if err := os.WriteFile(p, enc[0], 0o644); err != nil {
				t.Fatal(err)
			}
		}()
		var l logs
		img, err := Resolve(f.ctx, f.opts(&l, ""), ref)
		if err != nil {
			t.Fatal(err)
		}
		if img.LayerSources[0] != SourceStreamed || img.LayerSources[1] != "artifact "+ad.Digest.String() ||
			!l.Has(ad.Digest.String(), "index "+blob.String()+" of layer 1/2", "refused") {
			t.Fatalf("sources %q:\n%s", img.LayerSources, l.String())
		}
		sameIndexes(t, built, img)
	})

	t.Run("good artifact behind a bad newer one", func(t *testing.T) {
		ref := f.push(t, "kata/goodbad")
		target, err := Build(f.ctx, Options{Client: f.client}, ref)
		if err != nil {
			t.Fatal(err)
		}
		good, err := Push(f.ctx, Options{Client: f.client}, target)
		if err != nil {
			t.Fatal(err)
		}
		bad := pushRawArtifact(t, f, target, [][]byte{[]byte("garbage"), []byte("garbage")}, layer)
		var l logs
		img, err := Resolve(f.ctx, f.opts(&l, ""), ref)
		if err != nil {
			t.Fatal(err)
		}
		if img.IndexSource != "artifact "+good.Digest.String() || !l.Has(bad.Digest.String(), "refused") || l.Has("streaming") {
			t.Fatalf("source %q (good %s, bad %s):\n%s", img.IndexSource, good.Digest, bad.Digest, l.String())
		}
		sameIndexes(t, built, img)
	})
}

// TestZstdLayerRefused: a zstd layer is refused, naming the layer and its
// media type.
func TestZstdLayerRefused(t *testing.T) {
	f := newFixture(t)
	ref, err := registry.ParseReference(f.reg.Addr + "/kata/zstd:v1")
	if err != nil {
		t.Fatal(err)
	}
	m := f.img.Manifest
	m.Layers = append([]ocispec.Descriptor(nil), m.Layers...)
	m.Layers[1].MediaType = "application/vnd.oci.image.layer.v1.tar+zstd"
	for _, b := range f.img.Blobs {
		if _, err := f.client.PushBlob(f.ctx, ref, ocispec.MediaTypeImageLayerGzip, b); err != nil {
			t.Fatal(err)
		}
	}
	cfg, _ := json.Marshal(f.img.Config)
	if _, err := f.client.PushBlob(f.ctx, ref, ocispec.MediaTypeImageConfig, cfg); err != nil {
		t.Fatal(err)
	}
	mb, _ := json.Marshal(m)
	if _, err := f.client.PushManifest(f.ctx, ref, ocispec.MediaTypeImageManifest, mb, "v1"); err != nil {
		t.Fatal(err)
	}
	_, err = Resolve(f.ctx, Options{Client: f.client}, ref)
	if !errors.Is(err, ErrUnsupportedLayer) || !strings.Contains(err.Error(), "layer 2/2 "+m.Layers[1].Digest.String()) ||
		!strings.Contains(err.Error(), "tar+zstd") || !strings.Contains(err.Error(), "gzip") {
		t.Fatalf("Resolve of an image with a zstd layer: %v", err)
	}
}

// TestTraceRoundTrip: no trace is ErrNotFound; the newest pushed trace
// is the one fetched; traces are bounded.
func TestTraceRoundTrip(t *testing.T) {
	f := newFixture(t)
	ref := f.push(t, "kata/trace")
	var l logs
	img, err := Build(f.ctx, f.opts(&l, ""), ref)
	if err != nil {
		t.Fatal(err)
	}
	o := f.opts(&l, "")
	if _, err := FetchTrace(f.ctx, o, img); !errors.Is(err, registry.ErrNotFound) {
		t.Fatalf("FetchTrace with none: %v, want ErrNotFound", err)
	}
	first, second := []byte("trace one"), lazyimagetest.Random(3, 100<<10)
	d1, err := PushTrace(f.ctx, o, img, first)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := FetchTrace(f.ctx, o, img); err != nil || !bytes.Equal(got, first) {
		t.Fatalf("FetchTrace after one push: %q, %v", got, err)
	}
	d2, err := PushTrace(f.ctx, o, img, second)
	if err != nil {
		t.Fatal(err)
	}
	if d1.Digest == d2.Digest || d2.ArtifactType != PrefetchArtifactType {
		t.Fatalf("trace artifacts %s, %s (type %q)", d1.Digest, d2.Digest, d2.ArtifactType)
	}
	if got, err := FetchTrace(f.ctx, o, img); err != nil || !bytes.Equal(got, second) {
		t.Fatalf("FetchTrace after two pushes: %d bytes, %v; want the newer %d", len(got), err, len(second))
	}
	// A trace never shows up as an index artifact, nor the reverse.
	if ds, err := f.client.Referrers(f.ctx, ref, img.ManifestDesc.Digest, ArtifactType); err != nil || len(ds) != 0 {
		t.Fatalf("index artifacts after pushing traces: %v, %v", ds, err)
	}
	if _, err := PushTrace(f.ctx, o, img, make([]byte, MaxTraceSize+1)); err == nil {
		t.Fatal("PushTrace of more than MaxTraceSize succeeded")
	}
	if _, err := PushTrace(f.ctx, o, img, nil); err == nil {
		t.Fatal("PushTrace of an empty trace succeeded")
	}
}

// TestLayerFetcherBounds: ranges outside the blob are refused before any
// request.
func TestLayerFetcherBounds(t *testing.T) {
	img := &Image{Manifest: ocispec.Manifest{Layers: []ocispec.Descriptor{{Digest: digest.FromString("x"), Size: 100}}}}
	fe := img.LayerFetcher(0)
	if img.LayerFetcher(1) != nil || img.LayerFetcher(-1) != nil {
		t.Fatal("LayerFetcher of a layer that does not exist")
	}
	for _, c := range []struct {
		n   int
		off int64
	}{{1, 100}, {101, 0}, {1, -1}, {50, 51}} {
		if err := fe.FetchRange(context.Background(), make([]byte, c.n), c.off); err == nil || !strings.Contains(err.Error(), "outside") {
			t.Fatalf("FetchRange(%d bytes at %d) of a 100-byte blob: %v", c.n, c.off, err)
		}
	}
}

func TestMaxIndexSize(t *testing.T) {
	if got := maxIndexSize(10 << 20); got != 24<<20 {
		t.Fatalf("maxIndexSize(10 MiB) = %d", got)
	}
	if got := maxIndexSize(1 << 62); got != lazyindex.MaxEncodedSize {
		t.Fatalf("maxIndexSize(huge) = %d, want lazyindex.MaxEncodedSize", got)
	}
}

// TestStreamedLayerAltered: a layer blob whose bytes were altered in the
// registry's store is refused while streaming, naming the layer; nothing
// of it reaches the node cache.
func TestStreamedLayerAltered(t *testing.T) {
	f := newFixture(t)
	ref := f.push(t, "kata/altered")
	p := f.reg.BlobPath(f.img.Manifest.Layers[0].Digest)
	b := bytes.Clone(f.img.Blobs[0])
	b[len(b)/2] ^= 0x55
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := os.WriteFile(p, f.img.Blobs[0], 0o644); err != nil {
			t.Fatal(err)
		}
	}()
	cache := t.TempDir()
	var l logs
	_, err := Resolve(f.ctx, f.opts(&l, cache), ref)
	if err == nil || !strings.Contains(err.Error(), "layer 1/2 "+f.img.Manifest.Layers[0].Digest.String()) {
		t.Fatalf("Resolve with an altered layer blob: %v\n%s", err, l.String())
	}
	if _, serr := os.Stat(indexCachePath(cache, f.img.Manifest.Layers[0].Digest)); serr == nil {
		t.Fatal("an index of the altered layer was cached")
	}
	t.Logf("refused: %v", err)
}

// TestNodeCacheIndexDigest: an image named by the digest of a
// multi-platform index resolves to its linux/amd64 manifest, and a warm
// node does so again from its cache with the registry stopped.
func TestNodeCacheIndexDigest(t *testing.T) {
	f := newFixture(t)
	ref := f.push(t, "kata/multi")
	m, md, err := f.client.ImageManifest(f.ctx, ref)
	if err != nil || len(m.Layers) != 2 {
		t.Fatal(err)
	}
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{
		{MediaType: md.MediaType, Digest: md.Digest, Size: md.Size, Platform: &ocispec.Platform{OS: "linux", Architecture: "amd64"}}}}
	idx.SchemaVersion = 2
	ib, _ := json.Marshal(idx)
	id, err := f.client.PushManifest(f.ctx, ref, ocispec.MediaTypeImageIndex, ib, "multi")
	if err != nil {
		t.Fatal(err)
	}
	byIndex := ref
	byIndex.Tag, byIndex.Digest = "", id.Digest
	cache := t.TempDir()
	var l logs
	cold, err := Resolve(f.ctx, f.opts(&l, cache), byIndex)
	if err != nil {
		t.Fatal(err)
	}
	if cold.ManifestDesc.Digest != md.Digest || cold.IndexSource != SourceStreamed {
		t.Fatalf("cold: manifest %s from %q, want %s built by streaming", cold.ManifestDesc.Digest, cold.IndexSource, md.Digest)
	}
	f.reg.Stop()
	warm, err := Resolve(f.ctx, f.opts(&l, cache), byIndex)
	if err != nil {
		t.Fatalf("warm, registry stopped: %v\n%s", err, l.String())
	}
	if warm.ManifestDesc.Digest != md.Digest || warm.IndexSource != SourceNodeCache {
		t.Fatalf("warm: manifest %s from %q", warm.ManifestDesc.Digest, warm.IndexSource)
	}
	sameIndexes(t, cold, warm)

	// A damaged image record is logged and fetched again.
	f.reg.Start()
	rec := imageCachePath(cache, id.Digest)
	if err := os.WriteFile(rec, []byte(`{"manifest_descriptor":{"digest":"sha256:00"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	var dl logs
	again, err := Resolve(f.ctx, f.opts(&dl, cache), byIndex)
	if err != nil || again.ManifestDesc.Digest != md.Digest || !dl.Has("node cache image "+rec, "unusable") {
		t.Fatalf("damaged image record: %v\n%s", err, dl.String())
	}
}
