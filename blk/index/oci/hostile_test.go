package oci

import (
	"context"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"golang.org/x/sys/unix"
)

// hostileLayer is one layer as a hostile layout may describe it: the
// manifest's digest and size and the config's diffID are whatever the
// author wrote, not what the blob holds.
type hostileLayer struct {
	blob   []byte
	digest string // the manifest's claim; the blob is stored under it
	size   int64
	diffID string
}

// writeHostileLayout writes a one-image, one-layer OCI layout tagged "x".
func writeHostileLayout(t *testing.T, dir string, l hostileLayer) {
	t.Helper()
	put := func(b []byte, digest string) string {
		if digest == "" {
			digest = indextest.DigestOf(b)
		}
		p := filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(digest, "sha256:"))
		indextest.Must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		indextest.Must(t, os.WriteFile(p, b, 0o644))
		return digest
	}
	cfg, err := json.Marshal(map[string]any{"rootfs": map[string]any{"type": "layers", "diff_ids": []string{l.diffID}}})
	indextest.Must(t, err)
	man, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(cfg, ""), "size": len(cfg)},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put(l.blob, l.digest), "size": l.size}},
	})
	indextest.Must(t, err)
	idx, err := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(man, ""), "size": len(man),
		"annotations": map[string]string{annotRefName: "x"}}}})
	indextest.Must(t, err)
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644))
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))
}

// cacheFiles lists everything but directories under a cache directory.
func cacheFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	indextest.Must(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			out = append(out, p)
		}
		return nil
	}))
	return out
}

// bomb is a gzip layer of a tar holding n zero bytes: about 1000:1.
func bomb(t *testing.T, n int) (tarDigest string, blob []byte) {
	tb := indextest.BuildTar(t, []indextest.TarEnt{{Name: "zeros", Body: strings.Repeat("\x00", n)}})
	return indextest.DigestOf(tb), gzipBytes(t, tb)
}

// TestFromOCIVerifiesBlobBeforeInflating: a blob that does not match the
// manifest's digest or size is refused before a byte of it is inflated,
// so the error is the digest's, not the inflation budget's, however small
// that budget.
func TestFromOCIVerifiesBlobBeforeInflating(t *testing.T) {
	diffID, blob := bomb(t, 8<<20)
	other := indextest.DigestOf([]byte("another blob"))
	for _, c := range []struct {
		name string
		l    hostileLayer
		want string
	}{
		{"wrong digest", hostileLayer{blob: blob, digest: other, size: int64(len(blob)), diffID: diffID}, "does not match its digest " + other},
		{"longer than its descriptor", hostileLayer{blob: blob, size: int64(len(blob)) - 1, diffID: diffID}, "larger than the manifest's size"},
		{"shorter than its descriptor", hostileLayer{blob: blob, size: int64(len(blob)) + 1, diffID: diffID}, "smaller than the manifest's size"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, cache := t.TempDir(), t.TempDir()
			writeHostileLayout(t, dir, c.l)
			_, err := FromOCI(context.Background(), dir, "x", index.Options{CacheDir: cache, MaxBlobSize: 64 << 10})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error with %q", err, c.want)
			}
			if f := cacheFiles(t, cache); len(f) != 0 {
				t.Fatalf("left in the cache: %q", f)
			}
		})
	}
}

// TestFromOCIGzipBombWrongDiffID: a blob that matches its digest but
// inflates past the per-layer budget, or to content other than its
// diffID, is refused leaving nothing in the cache.
func TestFromOCIGzipBombWrongDiffID(t *testing.T) {
	_, blob := bomb(t, 32<<20)
	wrong := indextest.DigestOf([]byte("not this layer"))
	for _, c := range []struct {
		name   string
		budget int64
		want   string
	}{
		{"over budget", 1 << 20, "inflated-bytes budget of 1048576 bytes"},
		{"within budget", 0, "does not match diffID " + wrong},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, cache := t.TempDir(), t.TempDir()
			writeHostileLayout(t, dir, hostileLayer{blob: blob, size: int64(len(blob)), diffID: wrong})
			_, err := FromOCI(context.Background(), dir, "x", index.Options{CacheDir: cache, MaxBlobSize: c.budget})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error with %q", err, c.want)
			}
			if f := cacheFiles(t, cache); len(f) != 0 {
				t.Fatalf("left in the cache: %q", f)
			}
		})
	}
}

// TestFromOCIRefusesFIFOs: a FIFO anywhere an image file is expected
// (the layout's index.json or oci-layout, a blob, the archive itself) is a
// clear error at once, not an open that waits forever for a writer.
func TestFromOCIRefusesFIFOs(t *testing.T) {
	diffID, blob := bomb(t, 1<<10)
	l := hostileLayer{blob: blob, size: int64(len(blob)), diffID: diffID}
	layerFile := "blobs/sha256/" + strings.TrimPrefix(indextest.DigestOf(blob), "sha256:")
	for _, name := range []string{"index.json", "oci-layout", layerFile, ""} {
		t.Run(strings.ReplaceAll(name+"_", "/", "_"), func(t *testing.T) {
			dir, cache := t.TempDir(), t.TempDir()
			writeHostileLayout(t, dir, l)
			img := dir
			fifo := filepath.Join(dir, name)
			if name == "" {
				img = filepath.Join(t.TempDir(), "image.tar")
				fifo = img
			} else {
				indextest.Must(t, os.Remove(fifo))
			}
			indextest.Must(t, unix.Mkfifo(fifo, 0o644))
			done := make(chan error, 1)
			go func() {
				_, err := FromOCI(context.Background(), img, "x", index.Options{CacheDir: cache})
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), "is a FIFO") {
					t.Fatalf("got %v, want an error saying the file is a FIFO", err)
				}
			case <-time.After(10 * time.Second):
				// Let the stuck open finish so the test can end.
				if fd, err := unix.Open(fifo, unix.O_RDWR|unix.O_NONBLOCK, 0); err == nil {
					defer unix.Close(fd)
				}
				t.Fatalf("FromOCI blocked on the FIFO %s", fifo)
			}
			if f := cacheFiles(t, cache); len(f) != 0 {
				t.Fatalf("left in the cache: %q", f)
			}
		})
	}
}

// TestFromOCISweepsStaleTemps: the partial blob of a build killed mid-layer
// (SIGKILL leaves no chance to clean up) is removed by the next build once
// it is old enough, and a live build's temp file is left alone.
func TestFromOCISweepsStaleTemps(t *testing.T) {
	diffID, blob := bomb(t, 1<<10)
	dir, cache := t.TempDir(), t.TempDir()
	writeHostileLayout(t, dir, hostileLayer{blob: blob, size: int64(len(blob)), diffID: diffID})
	blobs := filepath.Join(cache, "blobs", "sha256")
	indextest.Must(t, os.MkdirAll(blobs, 0o700))
	stale, live := filepath.Join(blobs, ".tmp-killed"), filepath.Join(blobs, ".tmp-live")
	indextest.Must(t, os.WriteFile(stale, make([]byte, 4096), 0o600))
	indextest.Must(t, os.WriteFile(live, make([]byte, 4096), 0o600))
	old := time.Now().Add(-staleTempAge - time.Minute)
	indextest.Must(t, os.Chtimes(stale, old, old))
	if _, err := FromOCI(context.Background(), dir, "x", index.Options{CacheDir: cache}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("stale temp file kept: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("a live build's temp file was removed: %v", err)
	}
}
