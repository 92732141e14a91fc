package indextest

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// EmptyDirsTar writes a layer tar of n empty directories under the root,
// the amplification layer: about 100 compressed bytes of tar per directory
// become an inode and a 4 KiB directory block of ext4 metadata. It streams,
// so a test can make one far larger than it wants to hold.
func EmptyDirsTar(w io.Writer, n int) error {
	tw := tar.NewWriter(w)
	mt := time.Unix(1700000000, 0)
	for i := 0; i < n; i++ {
		h := &tar.Header{Name: fmt.Sprintf("d%07d/", i), Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mt, Format: tar.FormatUSTAR}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
	}
	return tw.Close()
}

// WriteGzipLayerLayout writes an OCI image layout in dir with one image of
// one gzip layer, whose tar fill writes; it returns the compressed size.
// The layer is streamed to its blob while both digests are computed.
func WriteGzipLayerLayout(t testing.TB, dir string, fill func(io.Writer) error) int64 {
	t.Helper()
	blobs := filepath.Join(dir, "blobs", "sha256")
	Must(t, os.MkdirAll(blobs, 0o755))
	tmp, err := os.CreateTemp(blobs, ".layer-*")
	Must(t, err)
	compressed, diff := sha256.New(), sha256.New()
	zw := gzip.NewWriter(io.MultiWriter(tmp, compressed))
	Must(t, fill(io.MultiWriter(zw, diff)))
	Must(t, zw.Close())
	st, err := tmp.Stat()
	Must(t, err)
	Must(t, tmp.Close())
	layerDigest := "sha256:" + hex.EncodeToString(compressed.Sum(nil))
	Must(t, os.Rename(tmp.Name(), filepath.Join(blobs, layerDigest[len("sha256:"):])))
	diffID := "sha256:" + hex.EncodeToString(diff.Sum(nil))

	put := func(v any) (string, int) {
		b, err := json.Marshal(v)
		Must(t, err)
		d := DigestOf(b)
		Must(t, os.WriteFile(filepath.Join(blobs, d[len("sha256:"):]), b, 0o644))
		return d, len(b)
	}
	cfg, cfgSize := put(map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{diffID}}})
	man, manSize := put(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfgSize},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layerDigest, "size": st.Size()}},
	})
	idx, err := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man, "size": manSize,
		"annotations": map[string]string{"org.opencontainers.image.ref.name": "latest"}}}})
	Must(t, err)
	Must(t, os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644))
	Must(t, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))
	return st.Size()
}
