package cli

import (
	"context"
	"strings"
	"testing"
	"time"

	godigest "github.com/opencontainers/go-digest"

	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

// TestImageIndex: `image index` streams every layer with progress on
// stderr, pushes the artifact and prints its digest; a node then resolves
// the image from it. A second run finds it and exits 0; --force pushes a
// newer one, which wins; --push=false pushes nothing.
func TestImageIndex(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	img := lazyimagetest.TwoLayers(t, "v1")
	reg.Push(t, img.Dir, "v1", "kata/cli:v1")
	hosts := reg.HostsDir(t, "")
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	cfg := writeConfig(t, "[hypervisor.qemu]\nshared_fs = \"virtio-9p\"\n[kata_fsx.registry]\nconfig_path = \""+hosts+"\"\n")
	src := "registry:" + reg.Addr + "/kata/cli:v1"
	ref, err := registry.ParseReference(reg.Addr + "/kata/cli:v1")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	resolve := func() *lazyimage.Image {
		t.Helper()
		got, err := lazyimage.Resolve(ctx, lazyimage.Options{Client: registry.New(registry.Options{ConfigPath: hosts})}, ref)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}

	code, out, stderr := run(t, "image", "index", src, "--config", cfg)
	if code != 0 {
		t.Fatalf("image index: exit %d\n%s", code, stderr)
	}
	t.Logf("first run, stderr:\n%s", stderr)
	d := godigest.Digest(strings.TrimSpace(out))
	if d.Validate() != nil {
		t.Fatalf("stdout %q is not the artifact digest", out)
	}
	for _, want := range []string{
		"no index artifact refers to manifest",
		"streaming layer 1/2 " + img.Manifest.Layers[0].Digest.String(),
		"indexed layer 1/2 " + img.Manifest.Layers[0].Digest.String(),
		"indexed layer 2/2 " + img.Manifest.Layers[1].Digest.String(),
		"checkpoints",
		"pushed index artifact " + d.String() + " for " + ref.String(),
	} {
		if !strings.Contains(stderr, want) {
			t.Fatalf("stderr lacks %q:\n%s", want, stderr)
		}
	}
	if got, ok := resolve().Artifact(); !ok || got != d {
		t.Fatalf("Resolve after image index: artifact %s (%v), want %s", got, ok, d)
	}

	code, out, stderr = run(t, "image", "index", src, "--config", cfg)
	if code != 0 || strings.TrimSpace(out) != d.String() || !strings.Contains(stderr, "already has index artifact "+d.String()) || strings.Contains(stderr, "streaming") {
		t.Fatalf("second image index: exit %d, stdout %q\n%s", code, out, stderr)
	}

	code, out, stderr = run(t, "image", "index", "--force", src, "--config", cfg)
	d2 := godigest.Digest(strings.TrimSpace(out))
	if code != 0 || d2 == d || d2.Validate() != nil || !strings.Contains(stderr, "streaming layer 2/2") {
		t.Fatalf("image index --force: exit %d, stdout %q\n%s", code, out, stderr)
	}
	if got, ok := resolve().Artifact(); !ok || got != d2 {
		t.Fatalf("Resolve after --force: artifact %s (%v), want the newer %s", got, ok, d2)
	}

	code, out, stderr = run(t, "image", "index", "--push=false", "-q", src, "--config", cfg)
	if code != 0 || !strings.Contains(out, "not pushed") || strings.Contains(stderr, "streaming") {
		t.Fatalf("image index --push=false -q: exit %d, stdout %q\n%s", code, out, stderr)
	}
	c := registry.New(registry.Options{ConfigPath: hosts})
	m, md, err := c.ImageManifest(ctx, ref)
	if err != nil || len(m.Layers) != 2 {
		t.Fatal(err)
	}
	if ds, err := c.Referrers(ctx, ref, md.Digest, lazyimage.ArtifactType); err != nil || len(ds) != 2 {
		t.Fatalf("after --push=false: %d index artifacts (%v), want the 2 pushed before", len(ds), err)
	}
}

func TestImageIndexUsage(t *testing.T) {
	for _, args := range [][]string{
		{"image", "index"},
		{"image", "index", "oci:/tmp/x"},
		{"image", "index", "registry:Bad//ref"},
		{"image", "index", "registry:a/b", "registry:c/d"},
	} {
		code, _, stderr := run(t, args...)
		if code != 2 || !strings.Contains(stderr, "usage: kata-fsx image") {
			t.Errorf("%q: exit %d, want 2 with the usage\n%s", args, code, stderr)
		}
	}
	code, _, stderr := run(t, "image", "index", "registry:127.0.0.1:1/a/b:c", "--config", "/nonexistent/configuration.toml")
	if code != 1 || !strings.Contains(stderr, "/nonexistent/configuration.toml") {
		t.Errorf("missing --config file: exit %d\n%s", code, stderr)
	}
}
