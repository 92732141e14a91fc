package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestLinkShapesAndTearsDown runs the benchmark's harness on a tiny image:
// namespace, veth, registry, skopeo push, then a 2 MiB incompressible
// blob fetched over the veth shaped to 8 Mbit/s. tbf cannot let 16.8 Mbit
// through in under a second (2.1 s at the rate, minus one 64 KiB bucket),
// so that lower bound is a property of the shaping, not a speed claim. The
// veth's counters must see the blob, and teardown must leave no namespace,
// veth or registry process behind.
func TestLinkShapesAndTearsDown(t *testing.T) {
	testenv.Root(t, "network namespaces and tc")
	for _, tool := range [][2]string{{"ip", "iproute2"}, {"tc", "iproute2"}, {"docker-registry", "docker-registry"}, {"skopeo", "skopeo"}, {"tar", "tar"}} {
		testenv.Tool(t, tool[0], tool[1])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()

	root := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(filepath.Join(root, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "hello"), []byte("hello\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	layout := filepath.Join(dir, "oci")
	sizes, err := buildLayout(layout, root, 1, 2, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	if got := sizes[tagLarge].CompressedBytes; got < 2<<20 {
		t.Fatalf("large image of the tiny layout is %d bytes compressed, want at least the 2 MiB of random data", got)
	}
	blob := lastLayer(t, layout, tagLarge)

	lk, err := newLink(ctx, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			lk.Close()
		}
	}()
	reg, err := startRegistry(ctx, lk, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	if err := reg.push(ctx, layout, tagLarge, "coldbench/tiny"); err != nil {
		t.Fatal(err)
	}

	if err := lk.Shape(ctx, 8_000_000); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("tc", "-n", lk.NS, "qdisc", "show", "dev", lk.NSDev).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "tbf") || !strings.Contains(string(out), "8Mbit") {
		t.Fatalf("namespace end after Shape(8 Mbit/s): %v: %s, want a tbf at 8Mbit", err, out)
	}
	rx0, _, err := lk.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	n := fetch(t, "http://"+reg.Addr+"/v2/coldbench/tiny/blobs/"+blob)
	took := time.Since(t0)
	rx1, _, err := lk.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d bytes over the 8 Mbit/s veth in %v; veth rx %d bytes", n, took, rx1-rx0)
	if n < 2<<20 {
		t.Fatalf("fetched %d bytes of the blob, want at least 2 MiB", n)
	}
	if rx1-rx0 < uint64(n) {
		t.Fatalf("veth %s counted %d bytes received while %d bytes of blob arrived over it", lk.HostDev, rx1-rx0, n)
	}
	if took < time.Second {
		t.Fatalf("2 MiB over a link shaped to 8 Mbit/s took %v: the shaping does not bound the transfer", took)
	}

	if err := lk.Shape(ctx, 0); err != nil {
		t.Fatal(err)
	}
	out, _ = exec.Command("tc", "-n", lk.NS, "qdisc", "show", "dev", lk.NSDev).CombinedOutput()
	if strings.Contains(string(out), "tbf") {
		t.Fatalf("Shape(0) left a tbf on %s: %s", lk.NSDev, out)
	}

	reg.Stop()
	if reg.cmd.ProcessState == nil {
		t.Fatalf("registry process %d not reaped after Stop", reg.cmd.Process.Pid)
	}
	if err := lk.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	if linkExists(lk.HostDev) {
		t.Fatalf("veth %s left behind", lk.HostDev)
	}
	if nsExists(lk.NS) {
		t.Fatalf("network namespace %s left behind", lk.NS)
	}
	if err := lk.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// lastLayer reads the layout's manifest for tag and returns its last
// layer's digest.
func lastLayer(t *testing.T, layout, tag string) string {
	t.Helper()
	var idx struct{ Manifests []blobRef }
	readJSON(t, filepath.Join(layout, "index.json"), &idx)
	for _, m := range idx.Manifests {
		if m.Annotations["org.opencontainers.image.ref.name"] != tag {
			continue
		}
		var man struct{ Layers []blobRef }
		readJSON(t, filepath.Join(layout, "blobs", "sha256", strings.TrimPrefix(m.Digest, "sha256:")), &man)
		if len(man.Layers) == 0 {
			t.Fatalf("manifest of %s has no layers", tag)
		}
		return man.Layers[len(man.Layers)-1].Digest
	}
	t.Fatalf("layout %s has no image tagged %s", layout, tag)
	return ""
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func fetch(t *testing.T, url string) int64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v after %d bytes", url, err, n)
	}
	return n
}

// TestEditConfig checks a node's configuration keeps every other line,
// replaces keys in their own table only, and adds missing keys and tables.
func TestEditConfig(t *testing.T) {
	in := "[kata_fsx]\nstate_dir = \"/run/kata-fsx\"\n\n[kata_fsx.imagefs_blk]\n# state_dir = \"commented\"\nstate_dir = \"/var/lib/x\"\nblock_size = 4096\n\n[kata_fsx.registry]\nconfig_path = \"/etc/containerd/certs.d\"\n"
	got := editConfig(in, map[string]map[string]string{
		"kata_fsx.imagefs_blk": {"state_dir": `"/n/imagefs-blk"`},
		"kata_fsx.registry":    {"config_path": `"/h"`, "prefetch": "false"},
		"extra":                {"k": "1"},
	})
	want := "[kata_fsx]\nstate_dir = \"/run/kata-fsx\"\n\n[kata_fsx.imagefs_blk]\n# state_dir = \"commented\"\nstate_dir = \"/n/imagefs-blk\"\nblock_size = 4096\n\n[kata_fsx.registry]\nconfig_path = \"/h\"\nprefetch = false\n\n[extra]\nk = 1\n"
	if got != want {
		t.Fatalf("editConfig:\n%s\nwant:\n%s", got, want)
	}
}
