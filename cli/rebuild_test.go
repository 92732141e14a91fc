package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestImageRebuildSeesNestedEdits reproduces the stale layer-index cache
// end to end: `image build layers:DIR`, a nested file rewritten from "v1"
// to "longer-content" and a new file added, `image build` again with the
// same cache, and the exported filesystem read with debugfs. The cache
// keyed the layer by its top directory's identity, so the rebuild served
// the old tree: the file read "lo" and the new one was missing.
func TestImageRebuildSeesNestedEdits(t *testing.T) {
	testenv.Tool(t, "debugfs", "e2fsprogs")
	layer, work := t.TempDir(), t.TempDir()
	cache := filepath.Join(work, "cache")
	conf := filepath.Join(layer, "etc", "app", "conf")
	must(t, os.MkdirAll(filepath.Dir(conf), 0o755))
	must(t, os.WriteFile(conf, []byte("v1"), 0o644))
	build := func(name string) string {
		t.Helper()
		out, raw := filepath.Join(work, name), filepath.Join(work, name+".raw")
		if code, _, stderr := run(t, "image", "build", "-q", "--cache", cache, "--writable-size", "0", "-o", out, "layers:"+layer); code != 0 {
			t.Fatalf("image build: exit %d: %s", code, stderr)
		}
		if code, _, stderr := run(t, "image", "export", "--cache", cache, "--raw", raw, out); code != 0 {
			t.Fatalf("image export: exit %d: %s", code, stderr)
		}
		return raw
	}
	cat := func(raw, p string) string {
		t.Helper()
		out, err := exec.Command("debugfs", "-R", "cat "+p, raw).Output()
		if err != nil {
			t.Fatalf("debugfs cat %s: %v", p, err)
		}
		return string(out)
	}
	if got := cat(build("first"), "/etc/app/conf"); got != "v1" {
		t.Fatalf("first build: /etc/app/conf reads %q", got)
	}
	must(t, os.WriteFile(conf, []byte("longer-content"), 0o644))
	must(t, os.WriteFile(filepath.Join(layer, "etc", "app", "new"), []byte("new file"), 0o644))
	raw := build("second")
	if got := cat(raw, "/etc/app/conf"); got != "longer-content" {
		t.Errorf("rebuild: /etc/app/conf reads %q, want %q", got, "longer-content")
	}
	out, err := exec.Command("debugfs", "-R", "ls -l /etc/app", raw).Output()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), " new") {
		t.Errorf("rebuild: /etc/app lacks the new file:\n%s", out)
	}
}
