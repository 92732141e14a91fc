package ext4

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
)

// amplificationDirs is the size of the hostile layer: 300,000 empty
// directories, about 2 MB of gzip.
const amplificationDirs = 300000

// buildCLI compiles kata-fsx into a temporary directory.
func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kata-fsx")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/kata-fsx/kata-fsx/cmd/kata-fsx").CombinedOutput(); err != nil {
		t.Fatalf("go build kata-fsx: %v\n%s", err, out)
	}
	return bin
}

// runBuild runs `kata-fsx image build` on an OCI layout and returns its
// stderr, its peak RSS in bytes (the child's ru_maxrss) and its error.
func runBuild(t *testing.T, bin, layout, out string, args ...string) (string, int64, error) {
	t.Helper()
	var stderr bytes.Buffer
	cmd := exec.Command(bin, append(append([]string{"image", "build", "-q", "-o", out, "--cache", out + ".cache"}, args...), "oci:"+layout)...)
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	cmd.Env = append(os.Environ(), "KATA_FSX_CONF_FILE=/nonexistent") // the defaults, whatever the host has
	start := time.Now()
	err := cmd.Run()
	ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	if !ok {
		t.Fatal("no rusage for the child")
	}
	rss := ru.Maxrss << 10 // KiB on Linux
	t.Logf("image build %v: %v in %v, peak RSS %d MiB", args, err, time.Since(start).Round(time.Millisecond), rss>>20)
	return stderr.String(), rss, err
}

// TestAmplificationLayer: a 2 MB gzip layer of
// 300,000 empty directories needs 1.2 GiB of ext4 metadata, which the
// build used to hold in memory twice (2.75 GB RSS). It must now build in
// 512 MiB of RSS, the metadata streamed to its file, into an image e2fsck
// passes; and with a metadata budget below what the layer needs, it must
// be refused naming the budget, before the metadata is made.
func TestAmplificationLayer(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a 1.2 GiB image")
	}
	layout := filepath.Join(t.TempDir(), "layout")
	size := indextest.WriteGzipLayerLayout(t, layout, func(w io.Writer) error { return indextest.EmptyDirsTar(w, amplificationDirs) })
	t.Logf("layer: %d empty directories in %d bytes of gzip", amplificationDirs, size)
	bin := buildCLI(t)
	work := t.TempDir()

	t.Run("refused by the metadata budget", func(t *testing.T) {
		stderr, rss, err := runBuild(t, bin, layout, filepath.Join(work, "refused"), "--max-metadata", "256M")
		if err == nil || !strings.Contains(stderr, BudgetMetadata) {
			t.Fatalf("build with a 256 MiB metadata budget: %v, stderr %q; want a failure naming %s", err, stderr, BudgetMetadata)
		}
		if rss > 512<<20 {
			t.Errorf("refusal took %d MiB of RSS, want <= 512", rss>>20)
		}
		if _, err := os.Stat(filepath.Join(work, "refused", MetaFile)); !os.IsNotExist(err) {
			t.Errorf("a refused build left %s: %v", MetaFile, err)
		}
	})

	t.Run("built in 512 MiB", func(t *testing.T) {
		out := filepath.Join(work, "built")
		stderr, rss, err := runBuild(t, bin, layout, out)
		if err != nil {
			t.Fatalf("build: %v\n%s", err, stderr)
		}
		if rss > 512<<20 {
			t.Errorf("build took %d MiB of RSS, want <= 512", rss>>20)
		}
		img, err := Open(out)
		must(t, err)
		defer img.Close()
		if img.Manifest.Counts["dir"] != amplificationDirs+1 || img.Manifest.MetaBytes < amplificationDirs*4096 {
			t.Fatalf("manifest: %d directories, %d metadata bytes", img.Manifest.Counts["dir"], img.Manifest.MetaBytes)
		}
		entries, err := os.ReadDir(filepath.Dir(out))
		must(t, err)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ".ext4-meta-") {
				t.Errorf("temporary metadata file %s left beside the image", e.Name())
			}
		}
		raw := filepath.Join(t.TempDir(), "disk.img")
		exportMeta(t, img, raw)
		fsck(t, raw)
	})
}
