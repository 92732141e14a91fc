package lazyimage

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/content/registry"
)

// fakeRegistry is a fake OCI registry on loopback (httptest) speaking as
// much of the distribution API as Resolve uses: manifests by tag or
// digest, blobs whole or by one Range, and the referrers API. A hostile
// blob is answered by a function that writes what it likes, so that a
// test can send what no real registry would store. It counts the requests
// for each path.
type fakeRegistry struct {
	srv    *httptest.Server
	client *registry.Client
	ref    registry.Reference // repository kata/fake, tag v1

	mu        sync.Mutex
	manifests map[string][]byte // by tag and by digest
	blobs     map[digest.Digest][]byte
	hostile   map[digest.Digest]http.HandlerFunc
	referrers []ocispec.Descriptor
	requests  map[string]int
}

// fakeRepo is the one repository the fake registry serves.
const fakeRepo = "kata/fake"

func newFakeRegistry(t *testing.T) *fakeRegistry {
	t.Helper()
	f := &fakeRegistry{manifests: map[string][]byte{}, blobs: map[digest.Digest][]byte{},
		hostile: map[digest.Digest]http.HandlerFunc{}, requests: map[string]int{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	host := strings.TrimPrefix(f.srv.URL, "http://")
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, host), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, host, "hosts.toml"), []byte(fmt.Sprintf("server = %q\n", f.srv.URL)), 0o644); err != nil {
		t.Fatal(err)
	}
	f.client = registry.New(registry.Options{ConfigPath: dir, Attempts: 2, Backoff: time.Millisecond})
	ref, err := registry.ParseReference(host + "/" + fakeRepo + ":v1")
	if err != nil {
		t.Fatal(err)
	}
	f.ref = ref
	return f
}

func (f *fakeRegistry) serve(w http.ResponseWriter, r *http.Request) {
	rest, ok := strings.CutPrefix(r.URL.Path, "/v2/"+fakeRepo+"/")
	kind, name, _ := strings.Cut(rest, "/")
	f.mu.Lock()
	f.requests[r.URL.Path]++
	manifest, isManifest := f.manifests[name]
	blob, isBlob := f.blobs[digest.Digest(name)]
	hostile := f.hostile[digest.Digest(name)]
	referrers := slices.Clone(f.referrers)
	f.mu.Unlock()
	switch {
	case !ok || r.Method != http.MethodGet:
		http.NotFound(w, r)
	case kind == "manifests" && isManifest:
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.Write(manifest)
	case kind == "blobs" && hostile != nil:
		hostile(w, r)
	case kind == "blobs" && isBlob:
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(blob))
	case kind == "referrers":
		var out []ocispec.Descriptor
		for _, d := range referrers {
			if at := r.URL.Query().Get("artifactType"); at == "" || at == d.ArtifactType {
				out = append(out, d)
			}
		}
		idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: out}
		idx.SchemaVersion = 2
		w.Header().Set("Content-Type", ocispec.MediaTypeImageIndex)
		json.NewEncoder(w).Encode(idx)
	default:
		http.NotFound(w, r)
	}
}

// blobRequests is how many times blob d was asked for.
func (f *fakeRegistry) blobRequests(d digest.Digest) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests["/v2/"+fakeRepo+"/blobs/"+d.String()]
}

func (f *fakeRegistry) addManifest(t *testing.T, m ocispec.Manifest, tag string) ocispec.Descriptor {
	t.Helper()
	m.SchemaVersion = 2
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	d := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(b), Size: int64(len(b)), ArtifactType: m.ArtifactType,
		Annotations: m.Annotations}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.manifests[d.Digest.String()] = b
	if tag != "" {
		f.manifests[tag] = b
	}
	return d
}

// image serves, as tag v1, an image of one gzip layer whose manifest
// says it has layerSize bytes; the layer blob itself is not served, so a
// Resolve that has to stream it fails.
func (f *fakeRegistry) image(t *testing.T, layerSize int64) ocispec.Descriptor {
	t.Helper()
	cfg := ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromString("layer tar")}}}
	cb, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cd := digest.FromBytes(cb)
	f.mu.Lock()
	f.blobs[cd] = cb
	f.mu.Unlock()
	return f.addManifest(t, ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: cd, Size: int64(len(cb))},
		Layers: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: fakeLayer, Size: layerSize}}}, "v1")
}

// fakeLayer is the digest of the fake image's one layer.
var fakeLayer = digest.FromString("layer blob")

// indexArtifact serves an index artifact referring to subject whose one
// index blob, of the fake image's layer, is blob, answered by serve; it
// is created at the given time, which orders artifacts newest first.
func (f *fakeRegistry) indexArtifact(t *testing.T, subject, blob ocispec.Descriptor, created time.Time, serve http.HandlerFunc) ocispec.Descriptor {
	t.Helper()
	blob.MediaType = IndexMediaType
	blob.Annotations = map[string]string{AnnotationLayerDigest: fakeLayer.String()}
	d := f.addManifest(t, ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: ArtifactType,
		Config: ocispec.DescriptorEmptyJSON, Layers: []ocispec.Descriptor{blob}, Subject: &subject,
		Annotations: map[string]string{ocispec.AnnotationCreated: created.Format(time.RFC3339Nano)}}, "")
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostile[blob.Digest] = serve
	f.referrers = append(f.referrers, d)
	return d
}

// garbage writes n bytes that are no index, made as they are sent, until
// the client hangs up.
func garbage(w io.Writer, n int64) {
	chunk := bytes.Repeat([]byte("not an index "), 2500)
	for n > 0 {
		k := min(n, int64(len(chunk)))
		if _, err := w.Write(chunk[:k]); err != nil {
			return
		}
		n -= k
	}
}

// serveGarbage answers with total bytes of garbage, or the range of them
// asked for, declaring contentLength (-1: none, so the body is chunked and
// only its end tells its length).
func serveGarbage(total, contentLength int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := total
		status := http.StatusOK
		var start, end int64
		if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &start, &end); err == nil && start <= end && end < total {
			n, status = end-start+1, http.StatusPartialContent
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end, total))
		}
		if contentLength >= 0 {
			w.Header().Set("Content-Length", fmt.Sprint(contentLength))
			n = min(n, contentLength)
		}
		w.WriteHeader(status)
		w.(http.Flusher).Flush()
		garbage(w, n)
	}
}
