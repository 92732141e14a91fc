package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestImageBuildFromRegistry: `image build registry:REF` writes the
// metadata of a registry image and pins its manifest; `image export` then
// reads its file data through the node's lazy store, and debugfs finds
// the files' bytes in the exported filesystem.
func TestImageBuildFromRegistry(t *testing.T) {
	testenv.Tool(t, "debugfs", "e2fsprogs")
	reg := registrytest.Start(t, registrytest.Options{})
	img := lazyimagetest.TwoLayers(t, "v1")
	reg.Push(t, img.Dir, "v1", "kata/build:v1")
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	state := t.TempDir()
	cfg := writeConfig(t, "[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nstate_dir = \""+state+"\"\n[kata_fsx.registry]\nprefetch = false\nconfig_path = \""+reg.HostsDir(t, "")+"\"\n")
	t.Setenv(config.EnvConfigFile, cfg)
	work := t.TempDir()
	out, raw := filepath.Join(work, "img"), filepath.Join(work, "img.raw")
	src := "registry:" + reg.Addr + "/kata/build:v1"
	if code, _, stderr := run(t, "image", "build", "-q", "--writable-size", "0", "-o", out, src); code != 0 {
		t.Fatalf("image build: exit %d: %s", code, stderr)
	}
	var info BuildInfo
	b, err := os.ReadFile(filepath.Join(out, buildInfoFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &info); err != nil {
		t.Fatal(err)
	}
	if want := "registry:" + reg.Addr + "/kata/build@sha256:"; info.Source != src || !strings.HasPrefix(info.Resolved, want) {
		t.Fatalf("build.json source %q resolved %q, want %q pinned as %s...", info.Source, info.Resolved, src, want)
	}
	if code, _, stderr := run(t, "image", "export", "--raw", raw, out); code != 0 {
		t.Fatalf("image export: exit %d: %s", code, stderr)
	}
	want := map[string][]byte{"etc/a": []byte("lower a\n"), "etc/c": []byte("upper c\n"),
		"data/random": lazyimagetest.Random(1, 12<<20), "data/text": lazyimagetest.Text(2, 8<<20)}
	for name, data := range want {
		got, err := exec.Command("debugfs", "-R", "cat /"+name, raw).Output()
		if err != nil {
			t.Fatalf("debugfs cat %s: %v", name, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("/%s in the exported image: %d bytes that differ from the layer's %d", name, len(got), len(data))
		}
	}
	if got, _ := exec.Command("debugfs", "-R", "stat /etc/b", raw).CombinedOutput(); !strings.Contains(string(got), "not found") {
		t.Errorf("/etc/b, whited out by the upper layer, is in the image: %s", got)
	}
	if fi, err := os.Stat(filepath.Join(state, "content", "layers")); err != nil || !fi.IsDir() {
		t.Errorf("the node store under the state dir was not used: %v", err)
	}
}
