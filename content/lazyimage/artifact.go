package lazyimage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

// Artifact types (the artifact manifests' artifactType) and the media
// types of their blobs. docs/lazy-images.md describes the layout.
const (
	// ArtifactType is the artifactType of an index artifact: one layer per
	// image layer, each a lazyindex encoding.
	ArtifactType = "application/vnd.kata-fsx.lazyindex.v1"
	// PrefetchArtifactType is the artifactType of a prefetch trace
	// artifact: one layer of bytes content/store encodes.
	PrefetchArtifactType = "application/vnd.kata-fsx.prefetch.v1"
	// IndexMediaType is an index artifact layer: one layer's encoded index.
	IndexMediaType = "application/vnd.kata-fsx.lazyindex.layer.v1"
	// TraceMediaType is the prefetch artifact's one layer.
	TraceMediaType = "application/vnd.kata-fsx.prefetch.trace.v1"
)

// Annotations of the artifacts.
const (
	// AnnotationLayerDigest, on an index artifact layer, is the digest of
	// the image layer blob it indexes.
	AnnotationLayerDigest = "com.github.kata-fsx.lazyindex.layer.digest"
	// AnnotationLayerDiffID, on an index artifact layer, is that layer's
	// diff_id (informative: the index itself is checked).
	AnnotationLayerDiffID = "com.github.kata-fsx.lazyindex.layer.diffid"
	// AnnotationIndexVersion, on an index artifact manifest, is the
	// lazyindex encoding version of its layers.
	AnnotationIndexVersion = "com.github.kata-fsx.lazyindex.version"
)

// MaxTraceSize bounds a prefetch trace: a trace lists block ranges, and
// 16 MiB of them covers far more than a pod's first seconds read.
const MaxTraceSize = 16 << 20

// indexVersion is lazyindex's encoding version, recorded in artifacts so
// an operator can see which kata-fsx can read them; Decode checks the
// version in each blob whatever this says.
const indexVersion = "2"

// Bounds on what an artifact may make a node read.
const (
	// maxArtifactLayers bounds an index artifact's layers: no image has
	// more than a few hundred (Docker caps them at 127).
	maxArtifactLayers = 1024
	// maxCandidates bounds how many artifacts of one type Resolve and
	// FetchTrace try, newest first, before they give up on them.
	maxCandidates = 4
	// indexSizeFloor is the least maxIndexSize allows: the tree of a small
	// layer of many empty files outweighs the layer itself.
	indexSizeFloor = 4 << 20
)

// maxIndexSize bounds the encoded index of a layer whose blob has
// layerSize bytes. An index larger than its layer saves nothing over
// streaming the layer, which is the fallback for a refused index; twice
// the layer (plus a floor for small layers) leaves honest indexes room:
// their windows take 32 KiB per 4 MiB span of the uncompressed tar (under
// a tenth of the blob at the usual 2-5x compression), the chunk digests
// 32 bytes per MiB, and the tree tens of bytes per file whose tar header
// alone takes 512.
func maxIndexSize(layerSize int64) int64 {
	if layerSize > (lazyindex.MaxEncodedSize-indexSizeFloor)/2 {
		return lazyindex.MaxEncodedSize
	}
	return 2*layerSize + indexSizeFloor
}

// artifactManifest is the part of an artifact manifest that is used.
type artifactManifest struct {
	SchemaVersion int                  `json:"schemaVersion"`
	MediaType     string               `json:"mediaType"`
	ArtifactType  string               `json:"artifactType"`
	Config        ocispec.Descriptor   `json:"config"`
	Layers        []ocispec.Descriptor `json:"layers"`
	Subject       *ocispec.Descriptor  `json:"subject"`
}

// parseArtifact parses an artifact manifest of artifactType referring to
// subject, whose layers are all of layerType and at most maxLayers.
func parseArtifact(data []byte, artifactType, layerType string, subject digest.Digest, maxLayers int) (*artifactManifest, error) {
	var m artifactManifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("not an artifact manifest: %w", err)
	}
	switch {
	case m.SchemaVersion != 2:
		return nil, fmt.Errorf("schemaVersion %d, want 2", m.SchemaVersion)
	case m.MediaType != ocispec.MediaTypeImageManifest:
		return nil, fmt.Errorf("media type %q, want %s", index.Trunc(m.MediaType), ocispec.MediaTypeImageManifest)
	case m.ArtifactType != artifactType:
		return nil, fmt.Errorf("artifactType %q, want %s", index.Trunc(m.ArtifactType), artifactType)
	case m.Subject == nil:
		return nil, errors.New("no subject")
	case m.Subject.Digest != subject:
		return nil, fmt.Errorf("subject %s, not the image manifest %s", index.Trunc(string(m.Subject.Digest)), subject)
	case len(m.Layers) == 0 || len(m.Layers) > maxLayers:
		return nil, fmt.Errorf("%d layers, want 1 to %d", len(m.Layers), maxLayers)
	}
	for i, l := range m.Layers {
		if l.MediaType != layerType {
			return nil, fmt.Errorf("layer %d: media type %q, want %s", i+1, index.Trunc(l.MediaType), layerType)
		}
		if err := checkSHA256(l.Digest); err != nil {
			return nil, fmt.Errorf("layer %d: %w", i+1, err)
		}
		if l.Size <= 0 {
			return nil, fmt.Errorf("layer %d: size %d", i+1, l.Size)
		}
	}
	return &m, nil
}

// indexLayers maps each image layer digest an index artifact covers to
// the blob holding its index.
func indexLayers(m *artifactManifest) (map[digest.Digest]ocispec.Descriptor, error) {
	out := make(map[digest.Digest]ocispec.Descriptor, len(m.Layers))
	for i, l := range m.Layers {
		ld := digest.Digest(l.Annotations[AnnotationLayerDigest])
		if err := checkSHA256(ld); err != nil {
			return nil, fmt.Errorf("layer %d: annotation %s: %w", i+1, AnnotationLayerDigest, err)
		}
		if prev, ok := out[ld]; ok && prev.Digest != l.Digest {
			return nil, fmt.Errorf("layer %d: two indexes (%s, %s) of image layer %s", i+1, prev.Digest, l.Digest, ld)
		}
		out[ld] = l
	}
	return out, nil
}

// newestFirst orders referrers by their creation annotation, newest first;
// those without one (or with ties) keep the list's order reversed, since
// the referrers tag schema appends.
func newestFirst(ds []ocispec.Descriptor) []ocispec.Descriptor {
	out := slices.Clone(ds)
	slices.Reverse(out)
	created := func(d ocispec.Descriptor) time.Time {
		t, _ := time.Parse(time.RFC3339Nano, d.Annotations[ocispec.AnnotationCreated])
		return t
	}
	slices.SortStableFunc(out, func(a, b ocispec.Descriptor) int { return created(b).Compare(created(a)) })
	return out
}

// candidates lists ref's artifacts of artifactType referring to subject,
// newest first, at most maxCandidates of them (saying when there were more).
func candidates(ctx context.Context, opts *Options, ref registry.Reference, subject digest.Digest, artifactType string) ([]ocispec.Descriptor, error) {
	ds, err := opts.Client.Referrers(ctx, ref, subject, artifactType)
	if err != nil {
		return nil, err
	}
	ds = newestFirst(ds)
	if len(ds) > maxCandidates {
		opts.logf("%s: %d %s artifacts refer to %s; trying the newest %d", ref, len(ds), artifactType, subject, maxCandidates)
		ds = ds[:maxCandidates]
	}
	return ds, nil
}

// fetchArtifact fetches and parses an artifact manifest.
func fetchArtifact(ctx context.Context, opts *Options, ref registry.Reference, d ocispec.Descriptor, artifactType, layerType string, subject digest.Digest, maxLayers int) (*artifactManifest, error) {
	if err := checkSHA256(d.Digest); err != nil {
		return nil, err
	}
	data, _, err := opts.Client.FetchManifest(ctx, ref, d.Digest)
	if err != nil {
		return nil, err
	}
	return parseArtifact(data, artifactType, layerType, subject, maxLayers)
}

// fromArtifacts fills the layers img lacks from index artifacts, newest
// first, and returns how many are still missing. Every refusal is logged.
func fromArtifacts(ctx context.Context, opts *Options, img *Image, ls []layer) int {
	missing := func() int {
		n := 0
		for _, ix := range img.Layers {
			if ix == nil {
				n++
			}
		}
		return n
	}
	cands, err := candidates(ctx, opts, img.Ref, img.ManifestDesc.Digest, ArtifactType)
	if err != nil {
		opts.logf("%s: listing index artifacts failed: %v", img.Ref, err)
		return missing()
	}
	if len(cands) == 0 {
		opts.logf("%s: no index artifact refers to manifest %s", img.Ref, img.ManifestDesc.Digest)
	}
	for _, c := range cands {
		if missing() == 0 || ctx.Err() != nil {
			break
		}
		m, err := fetchArtifact(ctx, opts, img.Ref, c, ArtifactType, IndexMediaType, img.ManifestDesc.Digest, maxArtifactLayers)
		var byLayer map[digest.Digest]ocispec.Descriptor
		if err == nil {
			byLayer, err = indexLayers(m)
		}
		if err != nil {
			opts.logf("%s: index artifact %s refused: %v", img.Ref, c.Digest, err)
			continue
		}
		for i := range ls {
			if img.Layers[i] != nil {
				continue
			}
			l := &ls[i]
			bd, ok := byLayer[l.desc.Digest]
			if !ok {
				opts.logf("%s: index artifact %s has no index of %s", img.Ref, c.Digest, l)
				continue
			}
			ix, enc, err := fetchIndex(ctx, opts, img.Ref, bd, l)
			if err != nil {
				opts.logf("%s: index artifact %s: index %s of %s refused: %v", img.Ref, c.Digest, bd.Digest, l, err)
				continue
			}
			img.Layers[i], img.encoded[i], img.LayerSources[i] = ix, enc, sourceArtifact+c.Digest.String()
			storeCachedIndex(opts, img, i)
		}
	}
	return missing()
}

// fetchIndex reads one index blob of an artifact, bounded and checked.
func fetchIndex(ctx context.Context, opts *Options, ref registry.Reference, d ocispec.Descriptor, l *layer) (*lazyindex.Index, []byte, error) {
	limit := opts.maxIndex(l.desc.Size)
	if d.Size > limit {
		if limit < maxIndexSize(l.desc.Size) {
			return nil, nil, fmt.Errorf("%d bytes, over the %d limit of an index blob ([kata_fsx.registry] max_index_mb)", d.Size, limit)
		}
		return nil, nil, fmt.Errorf("%d bytes, over the %d limit for a layer of %d bytes (an index larger than its layer saves nothing over streaming it)", d.Size, limit, l.desc.Size)
	}
	b, err := opts.Client.FetchBlob(ctx, ref, d, limit)
	if err != nil {
		return nil, nil, err
	}
	ix, err := lazyindex.Decode(bytes.NewReader(b))
	if err != nil {
		return nil, nil, err
	}
	if err := checkIndex(ix, l, opts.maxEntries()); err != nil {
		return nil, nil, err
	}
	return ix, b, nil
}

// pushArtifact pushes the empty config, the blobs and an artifact manifest
// of artifactType with subject img's manifest.
func pushArtifact(ctx context.Context, opts *Options, img *Image, artifactType string, layers []ocispec.Descriptor, blobs [][]byte, annotations map[string]string) (ocispec.Descriptor, error) {
	cfg := ocispec.DescriptorEmptyJSON
	cfg.Data = nil
	if _, err := opts.Client.PushBlob(ctx, img.Ref, cfg.MediaType, []byte("{}")); err != nil {
		return ocispec.Descriptor{}, err
	}
	for i, b := range blobs {
		d, err := opts.Client.PushBlob(ctx, img.Ref, layers[i].MediaType, b)
		if err != nil {
			return ocispec.Descriptor{}, err
		}
		layers[i].Digest, layers[i].Size = d.Digest, d.Size
	}
	if annotations == nil {
		annotations = map[string]string{}
	}
	annotations[ocispec.AnnotationCreated] = time.Now().UTC().Format(time.RFC3339Nano)
	subject := ocispec.Descriptor{MediaType: img.ManifestDesc.MediaType, Digest: img.ManifestDesc.Digest, Size: img.ManifestDesc.Size}
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: artifactType, Config: cfg,
		Layers: layers, Subject: &subject, Annotations: annotations}
	m.SchemaVersion = 2
	data, err := json.Marshal(m)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return opts.Client.PushManifest(ctx, img.Ref, ocispec.MediaTypeImageManifest, data, "")
}

// Push uploads img's layer indexes and an artifact manifest of
// ArtifactType referring to the image manifest, one layer per index
// annotated with the image layer it indexes, to the image's repository.
func Push(ctx context.Context, opts Options, img *Image) (ocispec.Descriptor, error) {
	if opts.Client == nil {
		return ocispec.Descriptor{}, errors.New("lazyimage: Options.Client is nil")
	}
	if len(img.Layers) != len(img.Manifest.Layers) || len(img.Layers) > maxArtifactLayers {
		return ocispec.Descriptor{}, fmt.Errorf("image %s: %d indexes for %d layers", img.Ref, len(img.Layers), len(img.Manifest.Layers))
	}
	layers := make([]ocispec.Descriptor, len(img.Layers))
	blobs := make([][]byte, len(img.Layers))
	for i, ix := range img.Layers {
		b, err := img.encodedIndex(i)
		if err != nil {
			return ocispec.Descriptor{}, err
		}
		ld := img.Manifest.Layers[i]
		if ix.Digest != ld.Digest.String() || ix.CompressedSize != ld.Size {
			return ocispec.Descriptor{}, fmt.Errorf("image %s: index %d is of blob %s, the manifest's layer is %s", img.Ref, i+1, ix.Digest, ld.Digest)
		}
		blobs[i] = b
		layers[i] = ocispec.Descriptor{MediaType: IndexMediaType,
			Annotations: map[string]string{AnnotationLayerDigest: ix.Digest, AnnotationLayerDiffID: ix.DiffID}}
	}
	d, err := pushArtifact(ctx, &opts, img, ArtifactType, layers, blobs, map[string]string{AnnotationIndexVersion: indexVersion})
	if err != nil {
		return d, fmt.Errorf("push index artifact of %s: %w", img.Ref, err)
	}
	return d, nil
}

// PushTrace pushes a prefetch trace (opaque bytes, at most MaxTraceSize)
// as an artifact of PrefetchArtifactType referring to img's manifest; the
// newest trace is the one FetchTrace returns.
func PushTrace(ctx context.Context, opts Options, img *Image, trace []byte) (ocispec.Descriptor, error) {
	if opts.Client == nil {
		return ocispec.Descriptor{}, errors.New("lazyimage: Options.Client is nil")
	}
	if len(trace) == 0 || len(trace) > MaxTraceSize {
		return ocispec.Descriptor{}, fmt.Errorf("prefetch trace of %s: %d bytes, want 1 to %d", img.Ref, len(trace), MaxTraceSize)
	}
	d, err := pushArtifact(ctx, &opts, img, PrefetchArtifactType, []ocispec.Descriptor{{MediaType: TraceMediaType}}, [][]byte{trace}, nil)
	if err != nil {
		return d, fmt.Errorf("push prefetch trace of %s: %w", img.Ref, err)
	}
	return d, nil
}

// FetchTrace returns the newest usable prefetch trace referring to img's
// manifest; with none, an error wrapping registry.ErrNotFound. Unusable
// trace artifacts are logged and passed over.
func FetchTrace(ctx context.Context, opts Options, img *Image) ([]byte, error) {
	if opts.Client == nil {
		return nil, errors.New("lazyimage: Options.Client is nil")
	}
	cands, err := candidates(ctx, &opts, img.Ref, img.ManifestDesc.Digest, PrefetchArtifactType)
	if err != nil {
		return nil, fmt.Errorf("prefetch trace of %s: %w", img.Ref, err)
	}
	for _, c := range cands {
		m, err := fetchArtifact(ctx, &opts, img.Ref, c, PrefetchArtifactType, TraceMediaType, img.ManifestDesc.Digest, 1)
		if err == nil && m.Layers[0].Size > MaxTraceSize {
			err = fmt.Errorf("trace of %d bytes, over the %d limit", m.Layers[0].Size, MaxTraceSize)
		}
		var b []byte
		if err == nil {
			b, err = opts.Client.FetchBlob(ctx, img.Ref, m.Layers[0], MaxTraceSize)
		}
		if err != nil {
			opts.logf("%s: prefetch trace artifact %s refused: %v", img.Ref, c.Digest, err)
			continue
		}
		return b, nil
	}
	what := "no prefetch trace"
	if len(cands) > 0 {
		what = "no usable prefetch trace among " + strconv.Itoa(len(cands)) + " artifacts"
	}
	return nil, fmt.Errorf("%s: %s refers to manifest %s: %w", img.Ref, what, img.ManifestDesc.Digest, registry.ErrNotFound)
}
