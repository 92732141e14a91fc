package main

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestPfnInfoMatchesKernelLayout checks the info block field by field
// against struct nd_pfn_sb (drivers/nvdimm/pfn.h) and its checksum against
// the kernel's definition: every 32-bit word of the block, the checksum
// field read as zero, summed Fletcher-style.
func TestPfnInfoMatchesKernelLayout(t *testing.T) {
	b := pfnInfo(2<<20, 2<<20)
	if !bytes.Equal(b[:16], []byte("NVDIMM_PFN_INFO\x00")) {
		t.Fatalf("signature %q", b[:16])
	}
	le := binary.LittleEndian
	if le.Uint16(b[52:]) != 0 || le.Uint16(b[54:]) != 2 {
		t.Fatalf("version %d.%d, want 0.2", le.Uint16(b[52:]), le.Uint16(b[54:]))
	}
	if le.Uint64(b[56:]) != 2<<20 || le.Uint64(b[64:]) != 0 || le.Uint32(b[72:]) != 1 || le.Uint32(b[76:]) != 0 || le.Uint32(b[80:]) != 0 || le.Uint32(b[84:]) != 2<<20 {
		t.Fatalf("dataoff %d npfns %d mode %d start_pad %d end_trunc %d align %d", le.Uint64(b[56:]), le.Uint64(b[64:]), le.Uint32(b[72:]), le.Uint32(b[76:]), le.Uint32(b[80:]), le.Uint32(b[84:]))
	}
	c := b
	for i := len(c) - 8; i < len(c); i++ {
		c[i] = 0
	}
	var lo32 uint32
	var hi uint64
	for i := 0; i < len(c); i += 4 {
		lo32 += le.Uint32(c[i:])
		hi += uint64(lo32)
	}
	if want := hi<<32 | uint64(lo32); le.Uint64(b[len(b)-8:]) != want {
		t.Fatalf("checksum %#x, want %#x", le.Uint64(b[len(b)-8:]), want)
	}
}

func TestMBRRefusesBadGeometry(t *testing.T) {
	for _, g := range [][2]int64{{1000, 1 << 20}, {1 << 20, 1 << 20}, {512, 3 << 40}} {
		if _, err := mbr(g[0], g[1]); err == nil {
			t.Errorf("mbr(%d, %d) accepted", g[0], g[1])
		}
	}
}

// TestLayoutOnRealFilesystem makes an ext4 filesystem at 3 MiB with
// mkfs.ext4 (as build-image.sh does), writes the layout and has sfdisk,
// when installed, read both tables.
func TestLayoutOnRealFilesystem(t *testing.T) {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Skip("mkfs.ext4 not installed (e2fsprogs)")
	}
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, "-q", "-F", "-b", "4096", "-E", "offset=3145728", img, "13M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	if err := run(img); err != nil {
		t.Fatal(err)
	}
	// A second run rewrites the same bytes.
	if err := run(img); err != nil {
		t.Fatalf("second run: %v", err)
	}
	sfdisk, err := exec.LookPath("sfdisk")
	if err != nil {
		return
	}
	out, err := exec.Command(sfdisk, "--dump", img).CombinedOutput()
	if err != nil {
		t.Fatalf("sfdisk --dump: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "start=        6144, size=       26624, type=83") {
		t.Fatalf("sfdisk reads MBR #1 as:\n%s", out)
	}
}

func TestLayoutRefusesAFileWithoutExt4(t *testing.T) {
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, make([]byte, 8<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(img); err == nil || !strings.Contains(err.Error(), "no ext4 filesystem") {
		t.Fatalf("got %v", err)
	}
}
