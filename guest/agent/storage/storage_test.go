package storage

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/guest/agent/pci"
)

func TestBlockNodeAtWalksBridges(t *testing.T) {
	sys := t.TempDir()
	disk := filepath.Join(sys, "pci0000:00", "0000:00:02.0", "0000:01:01.0", "virtio3", "block", "vdb")
	if err := os.MkdirAll(disk, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(sys, "pci0000:00", "0000:00:01.0", "virtio1", "block", "vda"), 0o755); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{"02/01": "/dev/vdb", "01": "/dev/vda"} {
		slots, err := pci.ParsePath(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := blockNodeAt(sys, slots)
		if err != nil || got != want {
			t.Errorf("blockNodeAt(%s) = %q, %v; want %s", path, got, err, want)
		}
	}
	for _, path := range []string{"03", "02/02", "02"} {
		slots, _ := pci.ParsePath(path)
		if got, err := blockNodeAt(sys, slots); err == nil {
			t.Errorf("blockNodeAt(%s) = %q, want an error", path, got)
		}
	}
}

func TestAddDefault(t *testing.T) {
	if got := addDefault("trans=fd", "trans", "virtio"); got != "trans=fd" {
		t.Errorf("addDefault overrode an explicit value: %q", got)
	}
	if got := addDefault("", "version", "9p2000.L"); got != "version=9p2000.L" {
		t.Errorf("addDefault on empty data: %q", got)
	}
	if got := addDefault("cache=mmap", "trans", "virtio"); got != "cache=mmap,trans=virtio" {
		t.Errorf("addDefault appended %q", got)
	}
}
