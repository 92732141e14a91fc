package lazyimage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

// Options configure Resolve, Build, Push and the trace functions.
type Options struct {
	// Client reaches the registry; it is required.
	Client *registry.Client
	// MaxEntries bounds the entries of one layer's tree; zero means
	// blk/index's default.
	MaxEntries int
	// CacheDir is the node's cache of encoded indexes, keyed by layer blob
	// digest, and of the manifests and configs of images named by digest;
	// "" means none. A warm node finds an image named by digest there
	// without the registry.
	CacheDir string
	// Logf receives progress and decisions, one line per call; nil
	// discards them.
	Logf func(format string, args ...any)
	// ProgressInterval is the least time between progress lines of a
	// layer being streamed (they come as each Range GET's bytes are
	// consumed); zero means two seconds.
	ProgressInterval time.Duration
	// MaxIndexBytes bounds an index artifact's blob whatever the size of
	// the layer it indexes ([kata_fsx.registry] max_index_mb); zero means
	// DefaultMaxIndexBytes.
	MaxIndexBytes int64
}

// DefaultMaxIndexBytes is the default Options.MaxIndexBytes.
const DefaultMaxIndexBytes = config.DefaultMaxIndexMB << 20

func (o *Options) logf(format string, args ...any) {
	if o.Logf != nil {
		o.Logf(format, args...)
	}
}

// maxIndex is the most bytes an index blob of a layer of layerSize bytes
// may have: the layer-derived bound, within the absolute one.
func (o *Options) maxIndex(layerSize int64) int64 {
	abs := o.MaxIndexBytes
	if abs <= 0 {
		abs = DefaultMaxIndexBytes
	}
	return min(abs, maxIndexSize(layerSize))
}

func (o *Options) maxEntries() int {
	return (&index.Options{MaxEntries: o.MaxEntries}).EntryLimit()
}

// Image is an image manifest, its config and one lazy-read index per layer.
// Nothing changes it once Resolve or Build returns it, so it may be shared
// between goroutines (LayerFetcher, Tree, Encoded, Push).
type Image struct {
	Ref          registry.Reference
	Manifest     ocispec.Manifest
	ManifestDesc ocispec.Descriptor
	Config       ocispec.Image
	// Layers are in manifest order, each checked against its layer
	// descriptor (digest, size), media type and the config's diff_id.
	Layers []*lazyindex.Index
	// IndexSource says how the indexes were obtained: "artifact
	// sha256:...", "node cache" or "built by streaming", or, when layers
	// came from different places, each with its layers (numbered from 1).
	IndexSource string
	// LayerSources is IndexSource per layer.
	LayerSources []string

	client *registry.Client
	// encoded holds the layers' encoded indexes where they are at hand
	// (read from an artifact or the cache), so Push and the cache reuse
	// the bytes that were checked.
	encoded [][]byte
}

// Sources of a layer's index, as IndexSource and LayerSources give them.
const (
	SourceNodeCache = "node cache"
	SourceStreamed  = "built by streaming"
	sourceArtifact  = "artifact " // followed by the artifact manifest's digest
)

// Layer media types and the index format each gives. Compression is also
// sniffed from the content when a layer is streamed (lazyindex.Build);
// the two must agree.
var layerFormats = map[string]lazyindex.Format{
	ocispec.MediaTypeImageLayer:                                    lazyindex.FormatPlain,
	ocispec.MediaTypeImageLayerGzip:                                lazyindex.FormatGzip,
	"application/vnd.oci.image.layer.nondistributable.v1.tar":      lazyindex.FormatPlain,
	"application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": lazyindex.FormatGzip,
	"application/vnd.docker.image.rootfs.diff.tar":                 lazyindex.FormatPlain,
	"application/vnd.docker.image.rootfs.diff.tar.gzip":            lazyindex.FormatGzip,
	"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip":    lazyindex.FormatGzip,
}

// maxConfigSize bounds an image config read into memory (as blk/index/oci
// bounds the JSON of an image layout).
const maxConfigSize = 8 << 20

// ErrUnsupportedLayer is wrapped by the error for a layer whose media type
// the lazy-read index cannot serve (zstd, or not a layer at all).
var ErrUnsupportedLayer = errors.New("layer not supported by the lazy-read index")

// layer is one manifest layer with what its index must match.
type layer struct {
	n, of  int // position from 1, of how many
	desc   ocispec.Descriptor
	diffID string
	format lazyindex.Format
}

func (l *layer) String() string {
	return fmt.Sprintf("layer %d/%d %s", l.n, l.of, l.desc.Digest)
}

// layers checks the manifest's layers against the config and gives what
// each index must match.
func (img *Image) layers() ([]layer, error) {
	m, c := &img.Manifest, &img.Config
	if c.RootFS.Type != "layers" {
		return nil, fmt.Errorf("image %s: config rootfs type %q, want \"layers\"", img.Ref, c.RootFS.Type)
	}
	if len(c.RootFS.DiffIDs) != len(m.Layers) {
		return nil, fmt.Errorf("image %s: manifest has %d layers, config %d diff_ids", img.Ref, len(m.Layers), len(c.RootFS.DiffIDs))
	}
	if len(m.Layers) == 0 {
		return nil, fmt.Errorf("image %s: manifest has no layers", img.Ref)
	}
	out := make([]layer, len(m.Layers))
	for i, d := range m.Layers {
		l := layer{n: i + 1, of: len(m.Layers), desc: d, diffID: c.RootFS.DiffIDs[i].String()}
		if err := checkSHA256(d.Digest); err != nil {
			return nil, fmt.Errorf("image %s: %s: %w", img.Ref, &l, err)
		}
		if err := checkSHA256(c.RootFS.DiffIDs[i]); err != nil {
			return nil, fmt.Errorf("image %s: %s: diff_id: %w", img.Ref, &l, err)
		}
		if d.Size <= 0 {
			return nil, fmt.Errorf("image %s: %s: size %d in the manifest", img.Ref, &l, d.Size)
		}
		f, ok := layerFormats[d.MediaType]
		switch {
		case ok:
			l.format = f
		case strings.HasSuffix(d.MediaType, "zstd"):
			return nil, fmt.Errorf("image %s: %s is zstd (%s): %w: the lazy-read index reads gzip and uncompressed layers only; push the image with gzip layers (skopeo copy --dest-compress-format gzip)",
				img.Ref, &l, d.MediaType, ErrUnsupportedLayer)
		default:
			return nil, fmt.Errorf("image %s: %s has media type %q: %w (want a tar or tar+gzip layer)", img.Ref, &l, index.Trunc(d.MediaType), ErrUnsupportedLayer)
		}
		out[i] = l
	}
	return out, nil
}

func checkSHA256(d digest.Digest) error {
	if err := d.Validate(); err != nil {
		return fmt.Errorf("digest %q: %w", index.Trunc(string(d)), err)
	}
	if d.Algorithm() != digest.SHA256 {
		return fmt.Errorf("digest %q: only sha256 is supported", index.Trunc(string(d)))
	}
	return nil
}

// checkIndex refuses an index that is not exactly l's.
func checkIndex(ix *lazyindex.Index, l *layer, maxEntries int) error {
	switch {
	case ix.Digest != l.desc.Digest.String():
		return fmt.Errorf("it indexes blob %s, not %s", ix.Digest, l.desc.Digest)
	case ix.CompressedSize != l.desc.Size:
		return fmt.Errorf("it indexes a blob of %d bytes, the manifest says %d", ix.CompressedSize, l.desc.Size)
	case ix.DiffID != l.diffID:
		return fmt.Errorf("its diff_id is %s, the config says %s", ix.DiffID, l.diffID)
	case ix.Format != l.format:
		return fmt.Errorf("it indexes a %s layer, the media type %s says %s", ix.Format, l.desc.MediaType, l.format)
	case len(ix.Tree.Entries) > maxEntries:
		return fmt.Errorf("its tree has %d entries, over the limit of %d", len(ix.Tree.Entries), maxEntries)
	}
	return nil
}

// Resolve finds the image and its layer indexes: from the node cache, else
// from the newest usable index artifact referring to the manifest, else by
// streaming each remaining layer once (and says so through Logf). A
// truncated, corrupt, hostile or mismatching artifact is refused with a log
// line naming it, and its layers are streamed instead.
func Resolve(ctx context.Context, opts Options, ref registry.Reference) (*Image, error) {
	img, ls, err := openImage(ctx, &opts, ref)
	if err != nil {
		return nil, err
	}
	missing := 0
	for i := range ls {
		if ix, enc := loadCachedIndex(&opts, &ls[i]); ix != nil {
			img.Layers[i], img.encoded[i], img.LayerSources[i] = ix, enc, SourceNodeCache
			continue
		}
		missing++
	}
	if missing > 0 {
		missing = fromArtifacts(ctx, &opts, img, ls)
	}
	if missing > 0 {
		var size int64
		for i := range ls {
			if img.Layers[i] == nil {
				size += ls[i].desc.Size
			}
		}
		opts.logf("no usable index artifact for %s: building by streaming %d of %d layers (%s)", ref, missing, len(ls), mib(size))
		for i := range ls {
			if img.Layers[i] != nil {
				continue
			}
			if err := img.stream(ctx, &opts, &ls[i], i); err != nil {
				return nil, err
			}
			storeCachedIndex(&opts, img, i)
		}
	}
	img.IndexSource = summarize(img.LayerSources)
	return img, nil
}

// Build streams every layer of ref's image once and indexes it, whatever
// the cache or the registry's artifacts hold.
func Build(ctx context.Context, opts Options, ref registry.Reference) (*Image, error) {
	img, ls, err := openImage(ctx, &opts, ref)
	if err != nil {
		return nil, err
	}
	var total int64
	for i := range ls {
		total += ls[i].desc.Size
	}
	opts.logf("building the indexes of %s by streaming %d layers (%s)", ref, len(ls), mib(total))
	for i := range ls {
		if err := img.stream(ctx, &opts, &ls[i], i); err != nil {
			return nil, err
		}
		storeCachedIndex(&opts, img, i)
	}
	img.IndexSource = SourceStreamed
	return img, nil
}

// openImage gets ref's manifest and config (the node cache first for a
// reference by digest) and checks its layers.
func openImage(ctx context.Context, opts *Options, ref registry.Reference) (*Image, []layer, error) {
	if opts.Client == nil {
		return nil, nil, errors.New("lazyimage: Options.Client is nil")
	}
	img := &Image{Ref: ref, client: opts.Client}
	if !loadCachedImage(opts, img) {
		m, desc, err := opts.Client.ImageManifest(ctx, ref)
		if err != nil {
			return nil, nil, err
		}
		if desc.MediaType != ocispec.MediaTypeImageManifest && desc.MediaType != registry.MediaTypeDockerManifest {
			return nil, nil, fmt.Errorf("image %s: manifest %s has media type %q, not an image manifest", ref, desc.Digest, index.Trunc(desc.MediaType))
		}
		img.Manifest, img.ManifestDesc = m, desc
		raw, err := fetchConfig(ctx, opts, ref, m.Config)
		if err != nil {
			return nil, nil, err
		}
		if err := json.Unmarshal(raw, &img.Config); err != nil {
			return nil, nil, fmt.Errorf("image %s: config %s: %w", ref, m.Config.Digest, err)
		}
		storeCachedImage(opts, img, raw)
	}
	ls, err := img.layers()
	if err != nil {
		return nil, nil, err
	}
	img.Layers = make([]*lazyindex.Index, len(ls))
	img.LayerSources = make([]string, len(ls))
	img.encoded = make([][]byte, len(ls))
	return img, ls, nil
}

func fetchConfig(ctx context.Context, opts *Options, ref registry.Reference, d ocispec.Descriptor) ([]byte, error) {
	if err := checkSHA256(d.Digest); err != nil {
		return nil, fmt.Errorf("image %s: config: %w", ref, err)
	}
	if d.Size <= 0 || d.Size > maxConfigSize {
		return nil, fmt.Errorf("image %s: config %s of %d bytes, want 1 to %d", ref, d.Digest, d.Size, maxConfigSize)
	}
	return opts.Client.FetchBlob(ctx, ref, d, maxConfigSize)
}

// summarize gives IndexSource from the layers' sources.
func summarize(src []string) string {
	var order []string
	which := map[string][]string{}
	for i, s := range src {
		if _, ok := which[s]; !ok {
			order = append(order, s)
		}
		which[s] = append(which[s], fmt.Sprint(i+1))
	}
	if len(order) == 1 {
		return order[0]
	}
	parts := make([]string, len(order))
	for i, s := range order {
		word := "layers"
		if len(which[s]) == 1 {
			word = "layer"
		}
		parts[i] = fmt.Sprintf("%s (%s %s)", s, word, strings.Join(which[s], ", "))
	}
	return strings.Join(parts, " + ")
}

// mib gives a size in KiB under 1 MiB, else in MiB.
func mib(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// Artifact returns the index artifact every layer's index came from, if
// they all came from one.
func (img *Image) Artifact() (digest.Digest, bool) {
	if len(img.LayerSources) == 0 {
		return "", false
	}
	for _, s := range img.LayerSources {
		if s != img.LayerSources[0] {
			return "", false
		}
	}
	d, ok := strings.CutPrefix(img.LayerSources[0], sourceArtifact)
	return digest.Digest(d), ok
}

// Tree merges the layers' trees into the image's tree, lowest layer first;
// its sources are the layers' diff_ids. maxEntries zero means blk/index's
// default.
func (img *Image) Tree(ctx context.Context, maxEntries int) (*index.Index, error) {
	if maxEntries <= 0 {
		maxEntries = (&index.Options{}).EntryLimit()
	}
	trees := make([]*index.Index, len(img.Layers))
	names := make([]string, len(img.Layers))
	for i, ix := range img.Layers {
		if ix == nil {
			return nil, fmt.Errorf("image %s: layer %d has no index", img.Ref, i+1)
		}
		trees[i], names[i] = ix.Tree, fmt.Sprintf("%d (%s)", i+1, ix.DiffID)
	}
	t, err := overlayfs.Merge(ctx, trees, names, maxEntries)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", img.Ref, err)
	}
	return t, nil
}

// Encoded returns layer i's index in lazyindex's binary encoding.
func (img *Image) Encoded(i int) ([]byte, error) {
	b, err := img.encodedIndex(i)
	return bytes.Clone(b), err
}

// encodedIndex is Encoded without the copy, for Push and the cache. It
// does not change img, so that an Image is safe for concurrent use.
func (img *Image) encodedIndex(i int) ([]byte, error) {
	if i < 0 || i >= len(img.Layers) || img.Layers[i] == nil {
		return nil, fmt.Errorf("image %s: no index for layer %d", img.Ref, i+1)
	}
	if i < len(img.encoded) && img.encoded[i] != nil {
		return img.encoded[i], nil
	}
	b, err := img.Layers[i].MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("image %s: layer %d: %w", img.Ref, i+1, err)
	}
	return b, nil
}

// stream streams layer i, l, into img with its encoding.
func (img *Image) stream(ctx context.Context, opts *Options, l *layer, i int) error {
	ix, err := streamLayer(ctx, opts, img, l)
	if err != nil {
		return err
	}
	b, err := ix.MarshalBinary()
	if err != nil {
		return fmt.Errorf("image %s: %s: %w", img.Ref, l, err)
	}
	img.Layers[i], img.encoded[i], img.LayerSources[i] = ix, b, SourceStreamed
	return nil
}
