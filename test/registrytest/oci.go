package registrytest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TarDir returns an uncompressed layer tar of the tree at root (regular
// files, directories and symlinks, owned by root).
func TarDir(t testing.TB, root string) []byte {
	t.Helper()
	b, err := Tar(root)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Tar is TarDir for callers without a testing.TB.
func Tar(root string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name, h.Uid, h.Gid, h.Uname, h.Gname = filepath.ToSlash(rel), 0, 0, "", ""
		if fi.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("tar %s: %w", root, err)
	}
	return buf.Bytes(), nil
}

// WriteBlob stores data in the OCI layout dir's blobs and returns its digest.
func WriteBlob(t testing.TB, dir string, data []byte) digest.Digest {
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

// WriteOCI writes an OCI image layout in dir whose image, tagged tag, has
// the given uncompressed layer tars (lowest first), gzip-compressed.
func WriteOCI(t testing.TB, dir, tag string, layers ...[]byte) {
	t.Helper()
	blob := func(data []byte) digest.Digest { return WriteBlob(t, dir, data) }
	cfg := ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"}, RootFS: ocispec.RootFS{Type: "layers"}}
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest}
	m.SchemaVersion = 2
	for _, l := range layers {
		var gz bytes.Buffer
		zw := gzip.NewWriter(&gz)
		zw.Write(l)
		zw.Close()
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, digest.FromBytes(l))
		m.Layers = append(m.Layers, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: blob(gz.Bytes()), Size: int64(gz.Len())})
	}
	cb, _ := json.Marshal(cfg)
	m.Config = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: blob(cb), Size: int64(len(cb))}
	mb, _ := json.Marshal(m)
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest,
		Digest: blob(mb), Size: int64(len(mb)), Annotations: map[string]string{ocispec.AnnotationRefName: tag}}}}
	idx.SchemaVersion = 2
	ib, _ := json.Marshal(idx)
	if err := os.WriteFile(filepath.Join(dir, "index.json"), ib, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		t.Fatal(err)
	}
}

// ArchiveImage is one image of a docker-archive: a name and the "config"
// object of its image configuration.
type ArchiveImage struct {
	Name   string
	Config map[string]any
}

// WriteDockerArchive writes a docker-archive (the `docker save` format
// that `ctr images import` reads) whose images share one layer: root.
func WriteDockerArchive(path, root string, images []ArchiveImage) error {
	layer, err := Tar(root)
	if err != nil {
		return fmt.Errorf("layer of %s: %w", root, err)
	}
	diffID := sha256.Sum256(layer)
	type file struct {
		name string
		data []byte
	}
	files := []file{{"layer.tar", layer}}
	var manifest []map[string]any
	for _, im := range images {
		cfg, err := json.Marshal(map[string]any{
			"architecture": "amd64", "os": "linux", "config": im.Config,
			"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
		})
		if err != nil {
			return fmt.Errorf("image config of %s: %w", im.Name, err)
		}
		sum := sha256.Sum256(cfg)
		name := hex.EncodeToString(sum[:]) + ".json"
		files = append(files, file{name, cfg})
		manifest = append(manifest, map[string]any{"Config": name, "RepoTags": []string{im.Name}, "Layers": []string{"layer.tar"}})
	}
	m, err := json.Marshal(manifest)
	if err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	files = append(files, file{"manifest.json", m})
	var out bytes.Buffer
	aw := tar.NewWriter(&out)
	for _, f := range files {
		if err := aw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.data)), Typeflag: tar.TypeReg}); err != nil {
			return fmt.Errorf("archive %s: %w", f.name, err)
		}
		if _, err := aw.Write(f.data); err != nil {
			return fmt.Errorf("archive %s: %w", f.name, err)
		}
	}
	if err := aw.Close(); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	return os.WriteFile(path, out.Bytes(), 0o600)
}
