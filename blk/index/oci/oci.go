package oci

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/blk/index/tarlayer"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"
)

const (
	// staleTempAge is when a blob cache temp file is taken for the leftover
	// of a killed build: no live inflation of a budget's worth of bytes
	// takes that long, and the shim and the CLI may share the cache.
	staleTempAge      = 6 * time.Hour
	maxJSONSize       = 8 << 20 // index.json, manifests, configs
	maxArchiveMembers = 1 << 20
	maxZstdWindow     = 1 << 27
)

// Media types of layers FromOCI reads; compression is detected from the
// content itself (docker-save archives declare none), so the media type
// only has to be one of these.
var layerMediaTypes = map[string]bool{
	"":                                       true, // docker-save
	"application/vnd.oci.image.layer.v1.tar": true,
	"application/vnd.oci.image.layer.v1.tar+gzip":                  true,
	"application/vnd.oci.image.layer.v1.tar+zstd":                  true,
	"application/vnd.oci.image.layer.nondistributable.v1.tar":      true,
	"application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": true,
	"application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": true,
	"application/vnd.docker.image.rootfs.diff.tar.gzip":            true,
	"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip":    true,
	"application/vnd.docker.image.rootfs.diff.tar":                 true,
}

// FromOCI indexes an image read directly: an OCI image layout directory, or
// a tar archive holding an OCI layout or a `docker save` image (told apart
// by their oci-layout and manifest.json files). tag selects the image by its
// org.opencontainers.image.ref.name / io.containerd.image.name annotation
// (OCI) or RepoTags (docker); it may be empty when the image holds one.
//
// Every layer, compressed (gzip, zstd) or not, is written once to
// opts.CacheDir/blobs/sha256/<diffID hex>: its blob is first checked
// against the manifest's size and digest, without inflating it, then
// inflated in one streaming pass bounded by the per-layer inflated-bytes
// budget (opts.MaxBlobSize) and verified against its diffID; a layer that
// fails any check leaves nothing in the cache. Every image file is opened
// without blocking and must be a regular file. The layer's regular files
// become SourceBlob "sha256:<diffID>" data at their offset in
// that uncompressed tar; hostfs.Opener serves them from there. Per-layer
// indexes are cached by diffID.
func FromOCI(ctx context.Context, path, tag string, opts index.Options) (*index.Index, error) {
	if opts.CacheDir == "" {
		return nil, fmt.Errorf("image %s: %w", path, index.Invalidf("Options.CacheDir is required for OCI images"))
	}
	src, err := openImage(path)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", path, err)
	}
	defer src.close()
	layers, err := imageLayers(src, tag)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", path, err)
	}
	st := opts.Counters()
	cache := overlayfs.Cache{Dir: opts.CacheDir}
	idx := make([]*index.Index, len(layers))
	names := make([]string, len(layers))
	for i, l := range layers {
		names[i] = fmt.Sprintf("%d (%s)", i, l.diffID)
		s := index.Source{Kind: index.SourceBlob, ID: l.diffID}
		key := "blob\x00" + l.diffID
		blob, err := index.BlobPath(opts.CacheDir, l.diffID)
		if err != nil {
			return nil, fmt.Errorf("image %s: layer %s: %w", path, names[i], err)
		}
		haveBlob := isRegular(blob)
		if haveBlob {
			// Used now: a prune's minimum age keeps it until the disk holds it.
			nodecache.Touch(blob)
			if ix := cache.Load(key, s); ix != nil {
				idx[i] = ix
				st.LayersCached++
				continue
			}
		} else {
			if err := materialize(ctx, src, l, blob, opts.BlobSizeLimit()); err != nil {
				return nil, fmt.Errorf("image %s: layer %s: %w", path, names[i], err)
			}
			st.BlobsWritten++
		}
		ix, err := tarlayer.ReadFile(ctx, blob, s, opts.EntryLimit(), names[i])
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", path, err)
		}
		st.LayersIndexed++
		if err := cache.Store(key, ix); err != nil {
			return nil, fmt.Errorf("image %s: layer %s: %w", path, names[i], err)
		}
		idx[i] = ix
	}
	ix, err := overlayfs.Merge(ctx, idx, names, opts.EntryLimit())
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", path, err)
	}
	st.Entries = len(ix.Entries)
	return ix, nil
}

func isRegular(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.Mode().IsRegular()
}

// imageFiles reads the files of an image layout or archive by name.
type imageFiles interface {
	open(name string) (io.ReadCloser, error)
	has(name string) bool
	close()
}

// openImage opens an image layout directory or archive file without
// blocking: a FIFO or a device where the image should be is an error, not
// an open that waits.
func openImage(path string) (imageFiles, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("fstat: %w", err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return &dirFiles{fd: fd}, nil
	case unix.S_IFREG:
	default:
		unix.Close(fd)
		return nil, index.Invalidf("is %s: want an OCI layout directory or an image archive file", hostfs.TypeName(st.Mode))
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("open: %w", err)
	}
	return scanArchive(os.NewFile(uintptr(fd), path))
}

// archiveReader is what an image archive is read from: an *os.File, or
// memory in the fuzz tests.
type archiveReader interface {
	io.ReadSeeker
	io.ReaderAt
	io.Closer
}

// scanArchive indexes the members of the image archive in r; it closes r
// on error.
func scanArchive(r archiveReader) (*archiveFiles, error) {
	a := &archiveFiles{f: r, members: map[string]member{}, links: map[string]string{}}
	if err := a.scan(); err != nil {
		r.Close()
		return nil, err
	}
	return a, nil
}

// dirFiles is an image layout directory; files are opened beneath it
// without following symlinks.
type dirFiles struct{ fd int }

func (d *dirFiles) open(name string) (io.ReadCloser, error) {
	f, err := hostfs.OpenBeneath(d.fd, name)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	return f, nil
}

// has reports whether name exists; one that is not a regular file counts,
// so that open, not a guess at the image's format, reports it.
func (d *dirFiles) has(name string) bool {
	f, err := hostfs.OpenBeneath(d.fd, name)
	if err != nil {
		var nr *hostfs.NotRegularError
		return errors.As(err, &nr)
	}
	f.Close()
	return true
}

func (d *dirFiles) close() { unix.Close(d.fd) }

type member struct{ off, size int64 }

// archiveFiles is an image tar; members are read in place by offset.
type archiveFiles struct {
	f       archiveReader
	members map[string]member
	links   map[string]string // symlink members (docker save links duplicate layers)
}

func (a *archiveFiles) scan() error {
	tr := tar.NewReader(a.f)
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read archive: %w", err)
		}
		if n >= maxArchiveMembers {
			return index.Invalidf("archive has more than %d members", maxArchiveMembers)
		}
		p, err := tarlayer.MemberPath(hdr.Name)
		if err != nil {
			return fmt.Errorf("archive member %q: %w", index.Trunc(hdr.Name), err)
		}
		switch hdr.Typeflag {
		case tar.TypeReg:
			off, err := a.f.Seek(0, io.SeekCurrent)
			if err != nil {
				return fmt.Errorf("archive member %q: %w", p, err)
			}
			a.members[p] = member{off: off, size: hdr.Size}
		case tar.TypeSymlink:
			a.links[p] = hdr.Linkname
		}
	}
}

func (a *archiveFiles) resolve(name string) (member, error) {
	p := name
	for hops := 0; hops < 8; hops++ {
		if m, ok := a.members[p]; ok {
			return m, nil
		}
		t, ok := a.links[p]
		if !ok {
			return member{}, fmt.Errorf("%s: %w", name, os.ErrNotExist)
		}
		if strings.HasPrefix(t, "/") {
			return member{}, index.Invalidf("archive symlink %q is absolute", p)
		}
		j := filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(p), t)))
		if j == ".." || strings.HasPrefix(j, "../") {
			return member{}, index.Invalidf("archive symlink %q leaves the archive", p)
		}
		p = j
	}
	return member{}, index.Invalidf("archive symlink %q: too many levels", name)
}

func (a *archiveFiles) open(name string) (io.ReadCloser, error) {
	m, err := a.resolve(name)
	if err != nil {
		return nil, err
	}
	return io.NopCloser(io.NewSectionReader(a.f, m.off, m.size)), nil
}

func (a *archiveFiles) has(name string) bool {
	_, err := a.resolve(name)
	return err == nil
}

func (a *archiveFiles) close() { a.f.Close() }

// layerRef is one layer of the selected image.
type layerRef struct {
	file      string // name within the image
	digest    string // digest of the (compressed) blob, "" if unknown
	size      int64  // the blob's size in its descriptor, 0 if unknown
	mediaType string
	diffID    string
}

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations"`
	Platform    *struct {
		Architecture string `json:"architecture"`
		OS           string `json:"os"`
	} `json:"platform"`
}

type ociIndex struct {
	MediaType string       `json:"mediaType"`
	Manifests []descriptor `json:"manifests"`
}

type ociManifest struct {
	MediaType string       `json:"mediaType"`
	Config    descriptor   `json:"config"`
	Layers    []descriptor `json:"layers"`
}

type imageConfig struct {
	RootFS struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

type dockerManifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

const (
	mtOCIIndex     = "application/vnd.oci.image.index.v1+json"
	mtDockerList   = "application/vnd.docker.distribution.manifest.list.v2+json"
	annotRefName   = "org.opencontainers.image.ref.name"
	annotImageName = "io.containerd.image.name"
)

func readJSON(files imageFiles, name, digest string, v any) error {
	rc, err := files.open(name)
	if err != nil {
		return err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxJSONSize+1))
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	if len(b) > maxJSONSize {
		return index.Invalidf("%s larger than %d bytes", name, maxJSONSize)
	}
	if digest != "" {
		sum := sha256.Sum256(b)
		if "sha256:"+hex.EncodeToString(sum[:]) != digest {
			return index.Invalidf("%s does not match its digest %s", name, digest)
		}
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("parse %s: %w: %w", name, index.ErrInvalid, err)
	}
	return nil
}

func blobName(digest string) (string, error) {
	h, err := index.BlobHex(digest)
	if err != nil {
		return "", err
	}
	return "blobs/sha256/" + h, nil
}

// imageLayers finds the selected image's layers, lowest first.
func imageLayers(files imageFiles, tag string) ([]layerRef, error) {
	oci := files.has("oci-layout") && files.has("index.json")
	docker := files.has("manifest.json")
	switch {
	case oci && docker:
		// docker save >= 25 writes both; its OCI annotations name tags
		// differently from RepoTags, so accept a match in either.
		l, err := ociLayers(files, tag)
		if err == nil {
			return l, nil
		}
		if l, derr := dockerLayers(files, tag); derr == nil {
			return l, nil
		}
		return nil, err
	case oci:
		return ociLayers(files, tag)
	case docker:
		return dockerLayers(files, tag)
	}
	return nil, index.Invalidf("neither an OCI layout (oci-layout, index.json) nor a docker-save archive (manifest.json)")
}

func ociLayers(files imageFiles, tag string) ([]layerRef, error) {
	var layout struct {
		Version string `json:"imageLayoutVersion"`
	}
	if err := readJSON(files, "oci-layout", "", &layout); err != nil {
		return nil, err
	}
	var idx ociIndex
	if err := readJSON(files, "index.json", "", &idx); err != nil {
		return nil, err
	}
	var refs []string
	var pick []descriptor
	for _, m := range idx.Manifests {
		r, n := m.Annotations[annotRefName], m.Annotations[annotImageName]
		refs = append(refs, r+" "+n)
		if tag == "" || r == tag || n == tag {
			pick = append(pick, m)
		}
	}
	if len(pick) != 1 {
		return nil, index.Invalidf("tag %q matches %d of the images in index.json (refs: %s)", tag, len(pick), strings.Join(refs, ", "))
	}
	d := pick[0]
	// Nested indexes (multi-platform images): pick this host's platform.
	for depth := 0; d.MediaType == mtOCIIndex || d.MediaType == mtDockerList; depth++ {
		if depth > 4 {
			return nil, index.Invalidf("image indexes nested too deeply")
		}
		name, err := blobName(d.Digest)
		if err != nil {
			return nil, err
		}
		var sub ociIndex
		if err := readJSON(files, name, d.Digest, &sub); err != nil {
			return nil, err
		}
		var found *descriptor
		for i, m := range sub.Manifests {
			if len(sub.Manifests) == 1 || m.Platform != nil && m.Platform.OS == "linux" && m.Platform.Architecture == runtime.GOARCH {
				found = &sub.Manifests[i]
				break
			}
		}
		if found == nil {
			return nil, index.Invalidf("image index %s has no linux/%s manifest", d.Digest, runtime.GOARCH)
		}
		d = *found
	}
	name, err := blobName(d.Digest)
	if err != nil {
		return nil, err
	}
	var man ociManifest
	if err := readJSON(files, name, d.Digest, &man); err != nil {
		return nil, err
	}
	cname, err := blobName(man.Config.Digest)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	var cfg imageConfig
	if err := readJSON(files, cname, man.Config.Digest, &cfg); err != nil {
		return nil, err
	}
	if len(cfg.RootFS.DiffIDs) != len(man.Layers) {
		return nil, index.Invalidf("manifest has %d layers but config %d diff_ids", len(man.Layers), len(cfg.RootFS.DiffIDs))
	}
	out := make([]layerRef, len(man.Layers))
	for i, l := range man.Layers {
		ln, err := blobName(l.Digest)
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w", i, err)
		}
		if l.Size < 0 {
			return nil, index.Invalidf("layer %d: negative size %d", i, l.Size)
		}
		out[i] = layerRef{file: ln, digest: l.Digest, size: l.Size, mediaType: l.MediaType, diffID: cfg.RootFS.DiffIDs[i]}
	}
	return out, nil
}

func dockerLayers(files imageFiles, tag string) ([]layerRef, error) {
	var ms []dockerManifest
	if err := readJSON(files, "manifest.json", "", &ms); err != nil {
		return nil, err
	}
	var pick []dockerManifest
	var tags []string
	for _, m := range ms {
		tags = append(tags, m.RepoTags...)
		if tag == "" {
			pick = append(pick, m)
			continue
		}
		for _, t := range m.RepoTags {
			if t == tag || !strings.Contains(tag, ":") && t == tag+":latest" {
				pick = append(pick, m)
				break
			}
		}
	}
	if len(pick) != 1 {
		return nil, index.Invalidf("tag %q matches %d of the images in manifest.json (tags: %s)", tag, len(pick), strings.Join(tags, ", "))
	}
	m := pick[0]
	cn, err := tarlayer.MemberPath(m.Config)
	if err != nil {
		return nil, fmt.Errorf("config %q: %w", index.Trunc(m.Config), err)
	}
	var cfg imageConfig
	if err := readJSON(files, cn, "", &cfg); err != nil {
		return nil, err
	}
	if len(cfg.RootFS.DiffIDs) != len(m.Layers) {
		return nil, index.Invalidf("manifest has %d layers but config %d diff_ids", len(m.Layers), len(cfg.RootFS.DiffIDs))
	}
	out := make([]layerRef, len(m.Layers))
	for i, l := range m.Layers {
		ln, err := tarlayer.MemberPath(l)
		if err == nil && ln == "." {
			// The archive's root is no layer file: an empty or "./" name.
			err = index.Invalidf("names no file")
		}
		if err != nil {
			return nil, fmt.Errorf("layer %d %q: %w", i, index.Trunc(l), err)
		}
		out[i] = layerRef{file: ln, diffID: cfg.RootFS.DiffIDs[i]}
		// Newer docker saves layers as OCI blobs named by digest; any
		// other name is only a file name.
		if h, ok := strings.CutPrefix(ln, "blobs/sha256/"); ok {
			if _, err := index.BlobHex("sha256:" + h); err == nil {
				out[i].digest = "sha256:" + h
			}
		}
	}
	return out, nil
}

// ctxReader stops a long copy when the context is cancelled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// verifyBlob checks the layer's compressed blob against its descriptor's
// size and digest, reading it once without inflating anything: a blob that
// is not what the manifest names is refused before it can cost more than
// its own size.
func verifyBlob(ctx context.Context, files imageFiles, l layerRef) error {
	if _, err := index.BlobHex(l.digest); err != nil {
		return fmt.Errorf("layer digest: %w", err)
	}
	rc, err := files.open(l.file)
	if err != nil {
		return err
	}
	defer rc.Close()
	var r io.Reader = ctxReader{ctx, rc}
	if l.size > 0 {
		r = io.LimitReader(r, l.size+1)
	}
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return fmt.Errorf("read layer blob: %w", err)
	}
	switch {
	case l.size > 0 && n > l.size:
		return index.Invalidf("layer blob %s is larger than the manifest's size %d", l.file, l.size)
	case l.size > 0 && n < l.size:
		return index.Invalidf("layer blob %s is %d bytes, smaller than the manifest's size %d", l.file, n, l.size)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != l.digest {
		return index.Invalidf("layer blob %s (%s) does not match its digest %s", l.file, got, l.digest)
	}
	return nil
}

// materialize writes layer l, decompressed, to dst. The compressed blob is
// verified first (verifyBlob); it is then inflated in one streaming pass,
// bounded by maxSize (the per-layer inflated-bytes budget) and hashed as
// it is written to a temp file in dst's directory, and renamed to dst only
// when it matches the diffID: dst only ever holds complete, verified
// content, and a refused layer leaves nothing behind.
func materialize(ctx context.Context, files imageFiles, l layerRef, dst string, maxSize int64) error {
	if !layerMediaTypes[l.mediaType] {
		return index.Invalidf("unsupported layer media type %q", l.mediaType)
	}
	if _, err := index.BlobHex(l.diffID); err != nil {
		return fmt.Errorf("diffID: %w", err)
	}
	if l.digest != "" {
		if err := verifyBlob(ctx, files, l); err != nil {
			return err
		}
	}
	rc, err := files.open(l.file)
	if err != nil {
		return err
	}
	defer rc.Close()
	// The blob is hashed again as it is inflated: the layout may have been
	// changed since verifyBlob read it.
	var zh hash.Hash = sha256.New()
	br := bufio.NewReaderSize(io.TeeReader(ctxReader{ctx, rc}, zh), 1<<20)
	magic, _ := br.Peek(4)
	var dec io.Reader
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		gz, err := gzip.NewReader(br)
		if err != nil {
			return fmt.Errorf("gzip: %w: %w", index.ErrInvalid, err)
		}
		defer gz.Close()
		dec = gz
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxZstdWindow), zstd.WithDecoderLowmem(true))
		if err != nil {
			return fmt.Errorf("zstd: %w", err)
		}
		defer zr.Close()
		dec = zr
	default:
		dec = br
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return fmt.Errorf("blob cache: %w", err)
	}
	sweepStaleTemps(filepath.Dir(dst), time.Now().Add(-staleTempAge))
	err = atomicfile.Write(dst, 0o600, func(f io.Writer) error {
		uh := sha256.New()
		// The context is checked on the inflated side too: at 1000:1 one
		// read of compressed input can inflate to gigabytes.
		n, err := io.Copy(io.MultiWriter(f, uh), io.LimitReader(ctxReader{ctx, dec}, maxSize+1))
		if err != nil {
			return fmt.Errorf("decompress: %w", err)
		}
		if n > maxSize {
			return index.Invalidf("layer inflates to more than its inflated-bytes budget of %d bytes (index.Options.MaxBlobSize)", maxSize)
		}
		// Hash what the decompressor left unread (trailing padding) too.
		if _, err := io.Copy(io.Discard, br); err != nil {
			return fmt.Errorf("read layer: %w", err)
		}
		if l.digest != "" {
			if got := "sha256:" + hex.EncodeToString(zh.Sum(nil)); got != l.digest {
				return index.Invalidf("layer blob %s changed while it was read: digest %s, want %s", l.file, got, l.digest)
			}
		}
		if got := "sha256:" + hex.EncodeToString(uh.Sum(nil)); got != l.diffID {
			return index.Invalidf("uncompressed layer digest %s does not match diffID %s", got, l.diffID)
		}
		return nil
	})
	return err // atomicfile's own errors name the cache file
}

// sweepStaleTemps removes the temp files of builds killed before they could
// remove their own (SIGKILL, a crash), last modified before cutoff: a
// partial layer is gigabytes the cache would otherwise keep for ever.
// Failures are ignored; a later build tries again.
func sweepStaleTemps(dir string, cutoff time.Time) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), ".tmp-") || !e.Type().IsRegular() {
			continue
		}
		if fi, err := e.Info(); err == nil && fi.ModTime().Before(cutoff) {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}
