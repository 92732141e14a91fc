package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// regFetcher reads one layer blob from a registry by Range requests,
// counting them.
type regFetcher struct {
	c        *registry.Client
	ref      registry.Reference
	d        digest.Digest
	requests atomic.Int64
	before   func() // called before each request, for fault injection
}

func (f *regFetcher) FetchRange(ctx context.Context, p []byte, off int64) error {
	f.requests.Add(1)
	if f.before != nil {
		f.before()
	}
	return f.c.FetchRange(ctx, f.ref, f.d, p, off)
}

func writeOCIBlob(t *testing.T, dir string, data []byte) digest.Digest {
	t.Helper()
	d := digest.FromBytes(data)
	p := filepath.Join(dir, "blobs", "sha256", d.Encoded())
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return d
}

// ociImage writes an OCI layout (tag v1) with one gzip layer of tb.
func ociImage(t *testing.T, tb []byte) string {
	t.Helper()
	dir := t.TempDir()
	gz := gzipBytes(t, tb, 6)
	layer := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: writeOCIBlob(t, dir, gz), Size: int64(len(gz))}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(tb)}}})
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: writeOCIBlob(t, dir, cfg), Size: int64(len(cfg))},
		Layers: []ocispec.Descriptor{layer}}
	m.SchemaVersion = 2
	mb, _ := json.Marshal(m)
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest,
		Digest: writeOCIBlob(t, dir, mb), Size: int64(len(mb)), Annotations: map[string]string{ocispec.AnnotationRefName: "v1"}}}}
	idx.SchemaVersion = 2
	ib, _ := json.Marshal(idx)
	if err := os.WriteFile(filepath.Join(dir, "index.json"), ib, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestRegistry serves a gzip image pushed to a real registry (Debian's
// docker-registry, pushed with skopeo) lazily: one file costs a small
// part of the blob, two processes on one node fetch each chunk once, a
// registry killed mid-read fails reads within the deadline and serves
// again when back, and a blob altered in the registry is never served.
func TestRegistry(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	rng := rand.New(rand.NewPCG(20, 20))
	tb, files := randomTar(t, rng, 48, 512*kib)
	reg.Push(t, ociImage(t, tb), "v1", "kata/lazy:v1")

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	hosts := reg.HostsDir(t, "")
	c := registry.New(registry.Options{ConfigPath: hosts, Attempts: 1})
	ref, err := registry.ParseReference(reg.Addr + "/kata/lazy:v1")
	if err != nil {
		t.Fatal(err)
	}
	m, _, err := c.ImageManifest(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	desc := m.Layers[0]
	// The index, built by streaming the layer from the registry once (as
	// a node without an index artifact does).
	br := c.Blob(ctx, ref, desc, time.Minute)
	ix, err := lazyindex.Build(ctx, io.NewSectionReader(br, 0, desc.Size), lazyindex.Options{ChunkSize: 64 * kib, Span: 256 * kib, Layer: desc.Digest.String()})
	if err != nil {
		t.Fatal(err)
	}
	if ix.DiffID != digest.FromBytes(tb).String() {
		t.Fatalf("the registry's layer is not the tar pushed: DiffID %s, want %s", ix.DiffID, digest.FromBytes(tb))
	}
	l := indexLayer(t, tb, files, -1, 64*kib, 0) // for the files' offsets
	l.ix, l.blob = ix, nil
	files = l.files
	t.Logf("layer %s: %d bytes stored, %d chunks, %d checkpoints", desc.Digest, desc.Size, ix.NumChunks(), len(ix.Checkpoints))
	newFetcher := func() *regFetcher { return &regFetcher{c: c, ref: ref, d: desc.Digest} }
	readFile := func(t *testing.T, r io.ReaderAt, f testFile) error {
		p := make([]byte, len(f.data))
		n, err := r.ReadAt(p, f.off)
		if err != nil {
			return err
		}
		if n != len(p) || !bytes.Equal(p, f.data) {
			t.Fatalf("%s: %d bytes read differ from the file's %d", f.name, n, len(f.data))
		}
		return nil
	}

	t.Run("one file", func(t *testing.T) {
		s := openStore(t, Options{Dir: t.TempDir()})
		r := layerReader(t, s, l, newFetcher())
		f := files[11]
		if err := readFile(t, r, f); err != nil {
			t.Fatal(err)
		}
		st := s.Stats()
		t.Logf("read %s (%d bytes): fetched %d of %d bytes in %d requests", f.name, len(f.data), st.FetchedBytes, desc.Size, st.RangeRequests)
		if st.FetchedBytes == 0 || st.FetchedBytes > desc.Size/8 {
			t.Fatalf("one file of %d fetched %d bytes of a blob of %d, want a small fraction", len(files), st.FetchedBytes, desc.Size)
		}
	})

	t.Run("two processes", func(t *testing.T) {
		dir := t.TempDir()
		ixb, _ := ix.MarshalBinary()
		os.WriteFile(filepath.Join(dir, "index"), ixb, 0o600)
		os.WriteFile(filepath.Join(dir, "tar"), tb, 0o600)
		cache := filepath.Join(dir, "cache")
		cmd := exec.Command(os.Args[0], "-test.run=^TestRegistryChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), "STORE_REGISTRY_CHILD="+strings.Join([]string{dir, hosts, ref.String(), desc.Digest.String()}, ","))
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		s := openStore(t, Options{Dir: cache, MaxFetch: 256 * kib})
		fk := newFetcher()
		r := layerReader(t, s, l, fk)
		for _, f := range files {
			if err := readFile(t, r, f); err != nil {
				t.Fatal(err)
			}
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("child: %v\n%s", err, out.String())
		}
		var childChunks, childRequests int64
		if _, err := fmt.Sscan(lastLine(out.String()), &childChunks, &childRequests); err != nil {
			t.Fatalf("child output %q: %v", out.String(), err)
		}
		st := s.Stats()
		t.Logf("this process: %d chunks in %d Range requests; the other: %d chunks in %d; the layer: %d chunks", st.FetchedChunks, fk.requests.Load(), childChunks, childRequests, ix.NumChunks())
		if st.FetchedChunks+childChunks != ix.NumChunks() {
			t.Fatalf("two processes fetched %d + %d chunks of a layer of %d: some twice", st.FetchedChunks, childChunks, ix.NumChunks())
		}
	})

	t.Run("registry killed mid-read", func(t *testing.T) {
		var log logBuf
		s := openStore(t, Options{Dir: t.TempDir(), ReadTimeout: 2 * time.Second, MaxFetch: 128 * kib, Logf: log.logf})
		fk := newFetcher()
		r := layerReader(t, s, l, fk)
		if err := readFile(t, r, files[0]); err != nil {
			t.Fatal(err)
		}
		// Kill the registry once the next read has made its first request.
		var armed atomic.Bool
		armed.Store(true)
		fk.before = func() {
			if armed.CompareAndSwap(true, false) {
				reg.Stop()
			}
		}
		big := files[40]
		start := time.Now()
		err := readFile(t, r, big)
		d := time.Since(start)
		if err == nil || d > 2500*time.Millisecond {
			t.Fatalf("read of %s with the registry killed: %v after %v; want an error within the 2 s deadline", big.name, err, d)
		}
		t.Logf("read with the registry killed: error after %v: %v", d, err)
		if err := readFile(t, r, files[0]); err != nil {
			t.Fatalf("held file with the registry dead: %v", err)
		}
		reg.Start()
		if err := readFile(t, r, big); err != nil {
			t.Fatalf("read after the registry returned: %v", err)
		}
		if st := s.Stats(); st.ReadErrors != 1 || st.VerifyFailures != 0 {
			t.Fatalf("stats %+v", st)
		}
	})

	t.Run("altered blob", func(t *testing.T) {
		p := reg.BlobPath(desc.Digest)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		mid := len(b) / 2
		for i := mid; i < mid+16; i++ {
			b[i] ^= 0x5a
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		var log logBuf
		s := openStore(t, Options{Dir: t.TempDir(), Logf: log.logf})
		r := layerReader(t, s, l, newFetcher())
		bad := int64(mid) / ix.ChunkSize
		var hit, clean int
		for _, f := range files {
			start, end, _ := ix.CompressedRange(f.off, int64(len(f.data)))
			if err := readFile(t, r, f); err != nil {
				if !errors.Is(err, lazyindex.ErrChunkDigest) {
					t.Fatalf("%s: %v, want a chunk digest mismatch", f.name, err)
				}
				if start/ix.ChunkSize > bad || (end-1)/ix.ChunkSize < bad {
					t.Fatalf("%s (compressed [%d, %d)) failed, but it does not need chunk %d: %v", f.name, start, end, bad, err)
				}
				hit++
				continue
			}
			clean++
		}
		st := s.Stats()
		if hit == 0 || clean == 0 || st.VerifyFailures == 0 || len(log.matching(fmt.Sprintf("chunk %d ", bad))) == 0 {
			t.Fatalf("%d files failed, %d read; stats %+v; log %q", hit, clean, st, log.lines)
		}
		t.Logf("%d files refused (need chunk %d), %d served; %s", hit, bad, clean, log.matching("does not match")[0])
	})
}

// TestRegistryChild is the second process of TestRegistry's two
// processes: it reads the layer's files in reverse order.
func TestRegistryChild(t *testing.T) {
	env := os.Getenv("STORE_REGISTRY_CHILD")
	if env == "" {
		return // only as TestRegistry's second process
	}
	parts := strings.Split(env, ",")
	dir, hosts := parts[0], parts[1]
	ref, err := registry.ParseReference(parts[2])
	if err != nil {
		t.Fatal(err)
	}
	ixb, _ := os.ReadFile(filepath.Join(dir, "index"))
	ix, err := lazyindex.Decode(bytes.NewReader(ixb))
	if err != nil {
		t.Fatal(err)
	}
	tb, _ := os.ReadFile(filepath.Join(dir, "tar"))
	fk := &regFetcher{c: registry.New(registry.Options{ConfigPath: hosts, Attempts: 1}), ref: ref, d: digest.Digest(parts[3])}
	s := openStore(t, Options{Dir: filepath.Join(dir, "cache"), MaxFetch: 256 * kib})
	r := layerReader(t, s, &testLayer{ix: ix}, fk)
	for off := int64(len(tb)) - 128*kib; off > -128*kib; off -= 128 * kib {
		checkRead(t, r, tb, max(off, 0), 128*kib)
	}
	fmt.Printf("%d %d\n", s.Stats().FetchedChunks, fk.requests.Load())
}
