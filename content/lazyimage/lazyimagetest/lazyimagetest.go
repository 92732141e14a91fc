// Package lazyimagetest writes small OCI image layouts with gzip layers
// for tests that push them to a registry (test/registrytest) and read them
// back lazily.
package lazyimagetest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// File is a regular file of a layer.
type File struct {
	Name string
	Data []byte
}

// Layer is one layer: its files, plus whiteouts (names whose base gets the
// .wh. prefix) and directories.
type Layer struct {
	Dirs      []string
	Files     []File
	Whiteouts []string
}

// Image is an OCI layout written by Write.
type Image struct {
	Dir      string // the layout directory
	Tag      string // its one image's ref name
	Tars     [][]byte
	Blobs    [][]byte // the gzip layer blobs, as pushed
	Manifest ocispec.Manifest
	Config   ocispec.Image
}

// Write writes an OCI layout of one image with the given layers, each
// gzip-compressed, tagged tag.
func Write(t testing.TB, tag string, layers []Layer) *Image {
	t.Helper()
	img := &Image{Dir: t.TempDir(), Tag: tag}
	img.Config = ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"}, RootFS: ocispec.RootFS{Type: "layers"}}
	img.Manifest = ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest}
	img.Manifest.SchemaVersion = 2
	for _, l := range layers {
		tb := tarOf(t, l)
		var gz bytes.Buffer
		zw := gzip.NewWriter(&gz)
		if _, err := zw.Write(tb); err != nil {
			t.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
		img.Tars = append(img.Tars, tb)
		img.Blobs = append(img.Blobs, gz.Bytes())
		img.Config.RootFS.DiffIDs = append(img.Config.RootFS.DiffIDs, digest.FromBytes(tb))
		img.Manifest.Layers = append(img.Manifest.Layers, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip,
			Digest: writeBlob(t, img.Dir, gz.Bytes()), Size: int64(gz.Len())})
	}
	cfg, err := json.Marshal(img.Config)
	if err != nil {
		t.Fatal(err)
	}
	img.Manifest.Config = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: writeBlob(t, img.Dir, cfg), Size: int64(len(cfg))}
	mb, err := json.Marshal(img.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	md := writeBlob(t, img.Dir, mb)
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest,
		Digest: md, Size: int64(len(mb)), Annotations: map[string]string{ocispec.AnnotationRefName: tag}}}}
	idx.SchemaVersion = 2
	ib, err := json.Marshal(idx)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(img.Dir, "index.json"), ib, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(img.Dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	return img
}

func tarOf(t testing.TB, l Layer) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range l.Dirs {
		if err := tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range l.Files {
		if err := tw.WriteHeader(&tar.Header{Name: f.Name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.Data))}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(f.Data); err != nil {
			t.Fatal(err)
		}
	}
	for _, w := range l.Whiteouts {
		dir, base := filepath.Split(w)
		if err := tw.WriteHeader(&tar.Header{Name: dir + ".wh." + base, Typeflag: tar.TypeReg, Mode: 0o644}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func writeBlob(t testing.TB, dir string, data []byte) digest.Digest {
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

// Random returns n bytes that do not compress, from seed.
func Random(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// Text returns n bytes of words from a small vocabulary, from seed: they
// compress a few times, as real files do.
func Text(seed uint64, n int) []byte {
	words := []string{"kata ", "fsx ", "lazy ", "image ", "layer ", "index ", "registry ", "gzip ", "checkpoint ", "span ", "\n"}
	rng := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, 0, n+16)
	for len(b) < n {
		b = append(b, words[rng.IntN(len(words))]...)
	}
	return b[:n]
}

// TwoLayers is the usual test image: a lower layer of about 20 MiB
// (random data, so its blob takes several of the streamer's Range GETs,
// and text, so its index has several checkpoints) and an upper layer that
// whites out one lower file and adds one.
func TwoLayers(t testing.TB, tag string) *Image {
	return Write(t, tag, []Layer{
		{Dirs: []string{"etc", "data"}, Files: []File{
			{Name: "etc/a", Data: []byte("lower a\n")},
			{Name: "etc/b", Data: []byte("lower b, whited out above\n")},
			{Name: "data/random", Data: Random(1, 12<<20)},
			{Name: "data/text", Data: Text(2, 8<<20)},
		}},
		{Dirs: []string{"etc"}, Files: []File{{Name: "etc/c", Data: []byte("upper c\n")}}, Whiteouts: []string{"etc/b"}},
	})
}
