package cli

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/klauspost/compress/gzip"
	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// cliEnv makes the test binary run the kata-fsx command line (cli.Run,
// signal handling included) on its arguments instead of the tests.
const cliEnv = "KATA_FSX_TEST_RUN_CLI"

func TestMain(m *testing.M) {
	if os.Getenv(cliEnv) == "1" {
		os.Exit(Run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// startCLI starts `kata-fsx ARGS...` as a child process.
func startCLI(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), cliEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return cmd, &stderr
}

// waitExit waits up to d for cmd to end and returns its wait error, or
// fails the test (and kills cmd) if it did not end.
func waitExit(t *testing.T, cmd *exec.Cmd, d time.Duration, what string) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		cmd.Process.Kill()
		<-done
		t.Fatalf("%s: still running %v later", what, d)
		return nil
	}
}

// leftFiles lists everything but directories under dir.
func leftFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			out = append(out, p)
		}
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	return out
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// ociLayout writes a one-layer OCI layout tagged "x" around a gzip blob.
func ociLayout(t *testing.T, dir string, blob []byte, diffID string) {
	t.Helper()
	put := func(b []byte) string {
		d := digest(b)
		p := filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:"))
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, b, 0o644))
		return d
	}
	js := func(v any) []byte {
		b, err := json.Marshal(v)
		must(t, err)
		return b
	}
	cfg := js(map[string]any{"rootfs": map[string]any{"type": "layers", "diff_ids": []string{diffID}}})
	man := js(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(cfg), "size": len(cfg)},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put(blob), "size": len(blob)}}})
	idx := js(map[string]any{"schemaVersion": 2, "manifests": []any{map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(man), "size": len(man),
		"annotations": map[string]string{"org.opencontainers.image.ref.name": "x"}}}})
	must(t, os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644))
	must(t, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func gz(t *testing.T, b []byte) []byte {
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	_, err := w.Write(b)
	must(t, err)
	must(t, w.Close())
	return buf.Bytes()
}

// TestImageBuildFIFOIndexStopsOnSIGTERM: `image build` of an OCI layout
// whose index.json is a FIFO hung in open(2), and SIGTERM did not stop
// it. It must end promptly, on its own with an error naming the FIFO or
// at the latest on SIGTERM, leaving no output directory and nothing in
// the cache.
func TestImageBuildFIFOIndexStopsOnSIGTERM(t *testing.T) {
	layout, work := t.TempDir(), t.TempDir()
	ociLayout(t, layout, gz(t, make([]byte, 1024)), digest(make([]byte, 1024)))
	must(t, os.Remove(filepath.Join(layout, "index.json")))
	fifo := filepath.Join(layout, "index.json")
	must(t, unix.Mkfifo(fifo, 0o644))
	out, cache := filepath.Join(work, "out"), filepath.Join(work, "cache")
	cmd, stderr := startCLI(t, "image", "build", "-q", "--cache", cache, "-o", out, "oci:"+layout)
	t.Cleanup(func() {
		// Release an open stuck on the FIFO, should the build be.
		if fd, err := unix.Open(fifo, unix.O_RDWR|unix.O_NONBLOCK, 0); err == nil {
			unix.Close(fd)
		}
	})
	time.Sleep(time.Second)
	cmd.Process.Signal(syscall.SIGTERM)
	err := waitExit(t, cmd, 10*time.Second, "image build of a layout whose index.json is a FIFO, after SIGTERM")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() <= 0 {
		t.Fatalf("exit: %v, want a non-zero exit status (stderr: %s)", err, stderr)
	}
	if !strings.Contains(stderr.String(), "index.json: is a FIFO") {
		t.Errorf("stderr does not say index.json is a FIFO: %s", stderr)
	}
	if _, err := os.Lstat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("output directory left behind: %v", err)
	}
	if f := leftFiles(t, cache); len(f) != 0 {
		t.Errorf("left in the cache: %q", f)
	}
}

// TestImageBuildSIGTERMMidLayer: SIGTERM while `image build` inflates a
// large layer stops it within seconds, with no partial blob in the cache
// and no output directory.
func TestImageBuildSIGTERMMidLayer(t *testing.T) {
	// A tar header and then 16 GiB of zeros, as 256 gzip members of 64
	// MiB each: gzip readers read concatenated members as one stream.
	hdr := make([]byte, 512)
	copy(hdr, "zeros")
	copy(hdr[100:], "0000644\x00")
	copy(hdr[124:], "200000000000") // octal size: 16 GiB
	hdr[156] = '0'
	blob := gz(t, hdr)
	member := gz(t, make([]byte, 64<<20))
	for range 256 {
		blob = append(blob, member...)
	}
	layout, work := t.TempDir(), t.TempDir()
	// The diffID cannot match: the build would fail at the end, if the
	// signal did not stop it first.
	ociLayout(t, layout, blob, digest([]byte("whatever")))
	out, cache := filepath.Join(work, "out"), filepath.Join(work, "cache")
	cmd, stderr := startCLI(t, "image", "build", "-q", "--cache", cache, "-o", out, "oci:"+layout)
	// Wait for the inflation to be under way: its temp file has grown.
	testenv.Eventually(t, 20*time.Second, func() (bool, error) {
		for _, p := range leftFiles(t, cache) {
			if fi, err := os.Stat(p); err == nil && fi.Size() >= 1<<20 {
				return true, nil
			}
		}
		return false, fmt.Errorf("no blob of 1 MiB being written (stderr: %s)", stderr)
	})
	t0 := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	err := waitExit(t, cmd, 5*time.Second, "image build after SIGTERM")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() <= 0 {
		t.Fatalf("exit: %v, want a non-zero exit status (stderr: %s)", err, stderr)
	}
	if !strings.Contains(stderr.String(), "context canceled") {
		t.Errorf("stderr does not say the build was cancelled: %s", stderr)
	}
	t.Logf("stopped %v after SIGTERM: %s", time.Since(t0).Round(time.Millisecond), strings.TrimSpace(stderr.String()))
	if _, err := os.Lstat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("output directory left behind: %v", err)
	}
	if f := leftFiles(t, cache); len(f) != 0 {
		t.Errorf("left in the cache: %q", f)
	}
}
