package oci

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// memFiles is an image layout in memory, so that a fuzz input costs only
// the parsing.
type memFiles map[string][]byte

func (m memFiles) open(name string) (io.ReadCloser, error) {
	b, ok := m[name]
	if !ok {
		return nil, fmt.Errorf("%s: %w", name, os.ErrNotExist)
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

func (m memFiles) has(name string) bool { _, ok := m[name]; return ok }
func (m memFiles) close()               {}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// checkLayers holds for whatever imageLayers accepts: one clean relative
// file name and one diffID per layer, and digests where FromOCI will look.
func checkLayers(t *testing.T, layers []layerRef) {
	for i, l := range layers {
		if err := index.CheckPath(l.file); err != nil || l.file == "." {
			t.Fatalf("layer %d: file name %q escapes the image: %v", i, l.file, err)
		}
		if l.digest != "" {
			if h, err := index.BlobHex(l.digest); err != nil || l.file != "blobs/sha256/"+h {
				t.Fatalf("layer %d: digest %q but file %q", i, l.digest, l.file)
			}
		}
		if l.size < 0 {
			t.Fatalf("layer %d: negative size %d", i, l.size)
		}
	}
}

// FuzzOCILayout feeds hostile index.json, manifest, config and docker
// manifest.json documents to the layout parser. "@MANIFEST@" in the index
// and "@CONFIG@" in the manifest stand for the other documents' digests,
// so inputs reach past the digest checks.
func FuzzOCILayout(f *testing.F) {
	cfg := `{"rootfs":{"type":"layers","diff_ids":["sha256:` + strings.Repeat("a", 64) + `"]}}`
	man := `{"schemaVersion":2,"config":{"digest":"@CONFIG@"},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:` + strings.Repeat("b", 64) + `","size":10}]}`
	idx := `{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"@MANIFEST@","annotations":{"org.opencontainers.image.ref.name":"x"}}]}`
	nested := `{"manifests":[{"mediaType":"application/vnd.oci.image.index.v1+json","digest":"@MANIFEST@"}]}`
	docker := `[{"Config":"config.json","RepoTags":["x:latest"],"Layers":["l/layer.tar","blobs/sha256/` + strings.Repeat("c", 64) + `"]}]`
	f.Add([]byte(idx), []byte(man), []byte(cfg), []byte(nil), "x")
	f.Add([]byte(idx), []byte(man), []byte(cfg), []byte(docker), "")
	f.Add([]byte(nested), []byte(`{"manifests":[{"digest":"@CONFIG@","platform":{"os":"linux","architecture":"amd64"}}]}`), []byte(man), []byte(nil), "")
	f.Add([]byte(nil), []byte(nil), []byte(`{"rootfs":{"diff_ids":["x","y"]}}`), []byte(docker), "x")
	f.Add([]byte(`{"manifests":[{"digest":"sha256:../../etc"}]}`), []byte("{}"), []byte("[]"), []byte(`[{"Config":"../c","Layers":["/abs"]}]`), "")
	f.Fuzz(func(t *testing.T, idx, man, cfg, docker []byte, tag string) {
		files := memFiles{}
		cfgDigest := sha(cfg)
		man = bytes.ReplaceAll(man, []byte("@CONFIG@"), []byte(cfgDigest))
		idx = bytes.ReplaceAll(idx, []byte("@MANIFEST@"), []byte(sha(man)))
		for _, b := range [][]byte{man, cfg} {
			files["blobs/sha256/"+strings.TrimPrefix(sha(b), "sha256:")] = b
		}
		if idx != nil {
			files["oci-layout"] = []byte(`{"imageLayoutVersion":"1.0.0"}`)
			files["index.json"] = idx
		}
		if docker != nil {
			files["manifest.json"] = docker
			files["config.json"] = cfg
		}
		layers, err := imageLayers(files, tag)
		if err != nil {
			return
		}
		checkLayers(t, layers)
	})
}

// buildArchive turns a compact archive description into a tar: members
// separated by "\n--\n", each a header line "TYPE NAME[ LINK]" (TYPE f
// for a file, l for a symlink, h for a hard link) then the file's content.
// "@N@" in a later member's name or content stands for the sha256 of
// member N's content ("sha256:<hex>"), "#N#" for the bare hex, and
// "#self#" in a name for the member's own content's hex, so inputs
// reach past the digest checks. Fuzzing a compact form rather than raw tar
// bytes keeps inputs small: the engine minimizes every new input, and a
// tar of a few members is kilobytes of headers, which made it spend most
// of a run minimizing instead of fuzzing.
func buildArchive(spec []byte) ([]byte, bool) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	var sums [][]byte
	for _, m := range bytes.Split(spec, []byte("\n--\n")) {
		for i, sum := range sums {
			m = bytes.ReplaceAll(m, []byte(fmt.Sprintf("@%d@", i)), []byte("sha256:"+hex.EncodeToString(sum)))
			m = bytes.ReplaceAll(m, []byte(fmt.Sprintf("#%d#", i)), []byte(hex.EncodeToString(sum)))
		}
		head, body, _ := bytes.Cut(m, []byte("\n"))
		f := strings.SplitN(string(head), " ", 3)
		if len(f) < 2 {
			return nil, false
		}
		own := sha256.Sum256(body)
		name := strings.ReplaceAll(f[1], "#self#", hex.EncodeToString(own[:]))
		hdr := &tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}
		switch f[0] {
		case "f":
		case "l", "h":
			if len(f) < 3 {
				return nil, false
			}
			hdr.Typeflag, hdr.Linkname, hdr.Size, body = tar.TypeSymlink, f[2], 0, nil
			if f[0] == "h" {
				hdr.Typeflag = tar.TypeLink
			}
		default:
			return nil, false
		}
		if tw.WriteHeader(hdr) != nil {
			return nil, false
		}
		if _, err := tw.Write(body); err != nil {
			return nil, false
		}
		sums = append(sums, own[:])
	}
	if tw.Close() != nil {
		return nil, false
	}
	return buf.Bytes(), true
}

// FuzzOCIArchive feeds hostile image archives (tar files holding an OCI
// layout or a docker save, described as for buildArchive) to the archive
// reader and the layout parser: member scanning, symlink resolution and
// document parsing.
func FuzzOCIArchive(f *testing.F) {
	diff := `"sha256:` + strings.Repeat("a", 64) + `"`
	cfg := `f cfg.json
{"rootfs":{"type":"layers","diff_ids":[` + diff + `,` + diff + `]}}`
	f.Add([]byte(cfg+`
--
f l1/layer.tar
x
--
l dup/layer.tar ../l1/layer.tar
--
f manifest.json
[{"Config":"cfg.json","RepoTags":["x:latest"],"Layers":["l1/layer.tar","dup/layer.tar"]}]`), "x")
	f.Add([]byte(`f blobs/sha256/#self#
{"rootfs":{"diff_ids":[`+diff+`]}}
--
f blobs/sha256/#self#
{"config":{"digest":"@0@"},"layers":[{"digest":"sha256:`+strings.Repeat("b", 64)+`","size":1}]}
--
f oci-layout
{"imageLayoutVersion":"1.0.0"}
--
f index.json
{"manifests":[{"digest":"@1@","annotations":{"org.opencontainers.image.ref.name":"x"}}]}`), "")
	f.Add([]byte("l a b\n--\nl b a\n--\nf manifest.json\n[{\"Config\":\"a\"}]"), "")
	f.Fuzz(func(t *testing.T, spec []byte, tag string) {
		archive, ok := buildArchive(spec)
		if !ok {
			return
		}
		files, err := scanArchive(memArchive{bytes.NewReader(archive)})
		if err != nil {
			return
		}
		defer files.close()
		layers, err := imageLayers(files, tag)
		if err != nil {
			return
		}
		checkLayers(t, layers)
	})
}

// memArchive is an image archive in memory.
type memArchive struct{ *bytes.Reader }

func (memArchive) Close() error { return nil }
