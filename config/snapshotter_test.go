package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSnapshotterTable(t *testing.T) {
	host := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	c, err := LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if s := c.KataFSX.Snapshotter; s != DefaultSnapshotter() || !s.Remote || s.Address != "/run/kata-fsx/snapshotter.sock" {
		t.Fatalf("defaults %+v", s)
	}
	c, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"),
		"[hypervisor.qemu]\n[kata_fsx.snapshotter]\naddress = \"/tmp/s.sock\"\nroot = \"/tmp/snaps\"\nremote = false\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if s := c.KataFSX.Snapshotter; s != (Snapshotter{Address: "/tmp/s.sock", Root: "/tmp/snaps"}) {
		t.Fatalf("set keys read as %+v", s)
	}
	if err := Validate(c, host); err != nil && strings.Contains(err.Error(), "kata_fsx.snapshotter") {
		t.Fatalf("good table refused: %v", err)
	}
	c, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"),
		"[hypervisor.qemu]\n[kata_fsx.snapshotter]\naddress = \"snap.sock\"\nroot = \"\"\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	bad := map[string]bool{}
	var ce *Error
	for _, e := range unwrapAll(Validate(c, host)) {
		if errors.As(e, &ce) {
			bad[ce.Key] = true
		}
	}
	for _, k := range []string{"address", "root"} {
		if !bad["kata_fsx.snapshotter."+k] {
			t.Errorf("bad %s not refused by name (refused: %v)", k, bad)
		}
	}
	c.KataFSX.Snapshotter = DefaultSnapshotter()
	c.KataFSX.Snapshotter.Address = "/" + strings.Repeat("s", 120)
	if err := Validate(c, host); err == nil || !strings.Contains(err.Error(), "kata_fsx.snapshotter.address") {
		t.Errorf("a socket path too long for sun_path: %v", err)
	}
	_, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n[kata_fsx.snapshotter]\nremotes = true\n", 0o644))
	if err == nil || !strings.Contains(err.Error(), "kata_fsx.snapshotter.remotes") {
		t.Errorf("misspelt key: %v, want it named", err)
	}
}

// TestShippedSnapshotterTable: configuration.toml.in's table is the
// defaults.
func TestShippedSnapshotterTable(t *testing.T) {
	data, err := os.ReadFile("../configuration.toml.in")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"[kata_fsx.snapshotter]", `address = "` + DefaultSnapshotterAddress + `"`, `root = "` + DefaultSnapshotterRoot + `"`, "remote = true"} {
		if !strings.Contains(string(data), want) {
			t.Errorf("configuration.toml.in lacks %s", want)
		}
	}
}
