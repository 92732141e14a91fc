package config

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestMakeInstallLeavesKataAlone runs the Makefile's install target into a
// DESTDIR that already holds Kata's configuration.toml in both of Kata's
// directories: they must come out untouched, and ours must land where
// DefaultPaths looks.
func TestMakeInstallLeavesKataAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries")
	}
	if _, err := exec.LookPath("make"); err != nil {
		if os.Getenv("KATA_FSX_REQUIRE_ALL") == "1" {
			t.Fatalf("make is required: %v", err)
		}
		t.Skipf("no make: %v", err)
	}
	dest := t.TempDir()
	kata := map[string]string{
		filepath.Join(dest, "etc/kata-containers/configuration.toml"):                "# Kata's override\n",
		filepath.Join(dest, "usr/share/defaults/kata-containers/configuration.toml"): "# Kata's default\n",
	}
	for p, content := range kata {
		writeFile(t, p, content, 0o644)
	}
	cmd := exec.Command("make", "-C", "..", "install", "DESTDIR="+dest, "PREFIX=/usr/local")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make install: %v\n%s", err, out)
	}
	for p, content := range kata {
		got, err := os.ReadFile(p)
		if err != nil || string(got) != content {
			t.Errorf("Kata's %s changed: %q, %v", p, got, err)
		}
	}
	ours := filepath.Join(dest, DefaultPaths[len(DefaultPaths)-1])
	if filepath.Base(ours) != "configuration-fsx.toml" {
		t.Fatalf("DefaultPaths ends with %s, not configuration-fsx.toml", ours)
	}
	if _, err := LoadFile(ours); err != nil {
		t.Fatalf("installed configuration does not load: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dest, DefaultPaths[0])); err == nil {
		t.Errorf("make install wrote the admin override %s", DefaultPaths[0])
	}
	for _, b := range []string{"kata-fsx", "containerd-shim-kata-fsx-v2"} {
		if _, err := os.Stat(filepath.Join(dest, "usr/local/bin", b)); err != nil {
			t.Errorf("binary not installed: %v", err)
		}
	}
}

func TestDefaultPathsAreOurs(t *testing.T) {
	want := []string{"/etc/kata-containers/configuration-fsx.toml", "/usr/share/defaults/kata-containers/configuration-fsx.toml"}
	if len(DefaultPaths) != len(want) || DefaultPaths[0] != want[0] || DefaultPaths[1] != want[1] {
		t.Fatalf("DefaultPaths = %v, want %v", DefaultPaths, want)
	}
}
