package main

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"time"
)

// The two images of the benchmark live in one OCI layout under the cache,
// sharing the bench image's layer: "bench" is the bench image's root as
// one gzip layer, "large" adds a layer of incompressible file data.
const (
	tagBench = "bench"
	tagLarge = "large"
)

// layoutImage is one image of the cached layout, as the report needs it.
type layoutImage struct {
	Tag string `json:"tag"`
	// CompressedBytes is the manifest, config and gzip layers: what a
	// full pull transfers (before HTTP overhead).
	CompressedBytes int64 `json:"compressed_bytes"`
	// UncompressedBytes is the layers' tar streams.
	UncompressedBytes int64 `json:"uncompressed_bytes"`
	Layers            int   `json:"layers"`
	// Set per run: where it was pushed, how long the push took, and the
	// file the pod reads after its first output.
	Ref         string  `json:"ref,omitempty"`
	PushSeconds float64 `json:"push_seconds,omitempty"`
	ReadFile    string  `json:"read_file,omitempty"`
	// IndexSeconds is `kata-fsx image index` building and pushing the
	// lazy-read index artifact; IndexNote says why there is none.
	IndexSeconds float64 `json:"index_seconds,omitempty"`
	IndexNote    string  `json:"index_note,omitempty"`
}

type blobRef struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	// Annotations carry the ref name in index.json.
	Annotations map[string]string `json:"annotations,omitempty"`
}

// layerFile is a gzip layer written into the layout.
type layerFile struct {
	blob   blobRef
	diffID string
	tarLen int64
}

// buildLayout writes (once) the OCI layout with both images under dir and
// returns the two images' sizes. rootfs is the bench image's root;
// largeFiles × largeFileMiB of seeded random data make the large layer.
// A .complete file marks a finished layout, so an interrupted build is
// redone rather than pushed half-written.
func buildLayout(dir, rootfs string, largeFiles, largeFileMiB int, logf func(string, ...any)) (map[string]layoutImage, error) {
	sizes := filepath.Join(dir, "sizes.json")
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		b, err := os.ReadFile(sizes)
		if err != nil {
			return nil, fmt.Errorf("cached layout %s: %w (delete the directory to rebuild it)", dir, err)
		}
		var out map[string]layoutImage
		if err := json.Unmarshal(b, &out); err != nil {
			return nil, fmt.Errorf("cached layout %s: sizes.json: %w (delete the directory to rebuild it)", dir, err)
		}
		return out, nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "blobs", "sha256"), 0o755); err != nil {
		return nil, err
	}
	logf("coldbench: packing %s as a gzip layer into %s (once)", rootfs, dir)
	base, err := rootfsLayer(dir, rootfs)
	if err != nil {
		return nil, fmt.Errorf("bench image layer from %s: %w", rootfs, err)
	}
	logf("coldbench: generating the large layer: %d files of %d MiB of seeded random data (once)", largeFiles, largeFileMiB)
	big, err := writeLayer(dir, func(w io.Writer) error { return randomTree(w, largeFiles, largeFileMiB) })
	if err != nil {
		return nil, fmt.Errorf("large layer: %w", err)
	}
	out := map[string]layoutImage{}
	var index []blobRef
	for _, img := range []struct {
		tag    string
		layers []layerFile
	}{{tagBench, []layerFile{base}}, {tagLarge, []layerFile{base, big}}} {
		m, li, err := writeManifest(dir, img.tag, img.layers)
		if err != nil {
			return nil, err
		}
		index = append(index, m)
		out[img.tag] = li
	}
	if err := writeJSON(filepath.Join(dir, "index.json"), map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": index}); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		return nil, err
	}
	if err := writeJSON(sizes, out); err != nil {
		return nil, err
	}
	return out, os.WriteFile(filepath.Join(dir, ".complete"), nil, 0o644)
}

// rootfsLayer tars the root with GNU tar (it keeps hard links, devices,
// owners and xattrs as an image build would), entries sorted and named
// without a leading "./", as image builders write them.
func rootfsLayer(dir, rootfs string) (layerFile, error) {
	ents, err := os.ReadDir(rootfs)
	if err != nil {
		return layerFile{}, err
	}
	args := []string{"--sort=name", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", rootfs, "-cf", "-"}
	for _, e := range ents {
		args = append(args, e.Name())
	}
	return writeLayer(dir, func(w io.Writer) error {
		cmd := exec.Command("tar", args...)
		cmd.Stdout = w
		var stderr limitedBuffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("tar: %w: %s", err, stderr.String())
		}
		return nil
	})
}

// randomTree writes a tar of data/blob-N files of seeded ChaCha8 output:
// incompressible, like media or model weights, and the same bytes on
// every build.
func randomTree(w io.Writer, files, mib int) error {
	tw := tar.NewWriter(w)
	mtime := time.Unix(1_700_000_000, 0)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "data/", Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return err
	}
	var seed [32]byte
	copy(seed[:], "kata-fsx coldbench large layer")
	rng := rand.NewChaCha8(seed)
	buf := make([]byte, 1<<20)
	for i := 0; i < files; i++ {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("data/blob-%d", i), Mode: 0o644,
			Size: int64(mib) << 20, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
			return err
		}
		for j := 0; j < mib; j++ {
			if _, err := rng.Read(buf); err != nil {
				return err
			}
			if _, err := tw.Write(buf); err != nil {
				return err
			}
		}
	}
	return tw.Close()
}

// writeLayer streams gen's tar through gzip into a blob, hashing both the
// tar (the diff ID) and the gzip stream (the blob digest) on the way.
func writeLayer(dir string, gen func(io.Writer) error) (layerFile, error) {
	tmp, err := os.CreateTemp(filepath.Join(dir, "blobs", "sha256"), ".layer-")
	if err != nil {
		return layerFile{}, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	blobHash := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(tmp, blobHash), 1<<20)
	zw, err := gzip.NewWriterLevel(bw, gzip.DefaultCompression)
	if err != nil {
		return layerFile{}, err
	}
	tarHash := sha256.New()
	cw := &countWriter{w: io.MultiWriter(zw, tarHash)}
	if err := gen(cw); err != nil {
		return layerFile{}, err
	}
	if err := zw.Close(); err != nil {
		return layerFile{}, err
	}
	if err := bw.Flush(); err != nil {
		return layerFile{}, err
	}
	fi, err := tmp.Stat()
	if err != nil {
		return layerFile{}, err
	}
	d := hexDigest(blobHash)
	if err := os.Rename(tmp.Name(), filepath.Join(dir, "blobs", "sha256", d)); err != nil {
		return layerFile{}, err
	}
	return layerFile{
		blob:   blobRef{MediaType: "application/vnd.oci.image.layer.v1.tar+gzip", Digest: "sha256:" + d, Size: fi.Size()},
		diffID: "sha256:" + hexDigest(tarHash), tarLen: cw.n,
	}, nil
}

// writeManifest writes an image's config and manifest blobs and returns
// the manifest's index entry, tagged tag.
func writeManifest(dir, tag string, layers []layerFile) (blobRef, layoutImage, error) {
	li := layoutImage{Tag: tag, Layers: len(layers)}
	var diffIDs []string
	var refs []blobRef
	for _, l := range layers {
		diffIDs = append(diffIDs, l.diffID)
		refs = append(refs, l.blob)
		li.CompressedBytes += l.blob.Size
		li.UncompressedBytes += l.tarLen
	}
	cfg, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Env": []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, "Cmd": []string{"/bin/sh"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	if err != nil {
		return blobRef{}, li, err
	}
	cref, err := putBlob(dir, "application/vnd.oci.image.config.v1+json", cfg)
	if err != nil {
		return blobRef{}, li, err
	}
	man, err := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json", "config": cref, "layers": refs})
	if err != nil {
		return blobRef{}, li, err
	}
	mref, err := putBlob(dir, "application/vnd.oci.image.manifest.v1+json", man)
	if err != nil {
		return blobRef{}, li, err
	}
	li.CompressedBytes += cref.Size + mref.Size
	mref.Annotations = map[string]string{"org.opencontainers.image.ref.name": tag}
	return mref, li, nil
}

func putBlob(dir, mediaType string, b []byte) (blobRef, error) {
	h := sha256.Sum256(b)
	d := hex.EncodeToString(h[:])
	if err := os.WriteFile(filepath.Join(dir, "blobs", "sha256", d), b, 0o644); err != nil {
		return blobRef{}, err
	}
	return blobRef{MediaType: mediaType, Digest: "sha256:" + d, Size: int64(len(b))}, nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func hexDigest(h hash.Hash) string { return hex.EncodeToString(h.Sum(nil)) }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// limitedBuffer keeps the last 4 KiB written to it, for error messages
// from a tool whose full output could be large.
type limitedBuffer struct{ b []byte }

func (l *limitedBuffer) Write(p []byte) (int, error) {
	l.b = append(l.b, p...)
	if len(l.b) > 4096 {
		l.b = l.b[len(l.b)-4096:]
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string { return string(l.b) }

// sortedTags lists the layout's tags in report order.
func sortedTags(m map[string]layoutImage) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] == tagBench || (out[j] != tagBench && out[i] < out[j]) })
	return out
}
