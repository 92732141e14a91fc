package hypervisor

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// qemuBinary returns the installed qemu-system-x86_64 or ends the test
// through testenv.
func qemuBinary(t *testing.T) string {
	t.Helper()
	return testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
}

func TestProbeRealQEMU(t *testing.T) {
	qemu := qemuBinary(t)
	caps, err := Probe(context.Background(), qemu)
	if err != nil {
		t.Fatal(err)
	}
	// Cross-check the parsed version against the raw output rather than a constant.
	raw, err := exec.Command(qemu, "-version").Output()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), "version "+caps.Version.String()) && !strings.Contains(string(raw), "version "+strings.TrimSuffix(caps.Version.String(), ".0")) {
		t.Errorf("version %s not found in %q", caps.Version, raw)
	}
	if caps.Version.Major < 5 {
		t.Errorf("implausible version %s", caps.Version)
	}
	for _, d := range []string{"virtio-blk-pci", "virtio-serial-pci", "pci-bridge"} {
		if !caps.HasDevice(d) {
			t.Errorf("device %s missing from %d devices", d, len(caps.Devices))
		}
	}
	if caps.HasDevice("no-such-device-xyz") {
		t.Error("HasDevice accepts unknown names")
	}
	if !caps.VirtioBlk || !caps.VirtioSerial || !caps.PCIBridge {
		t.Errorf("flags not set: %+v", caps)
	}
	if !caps.HasMachine("q35") || !caps.HasMachine("pc") {
		t.Errorf("q35/pc missing: %+v", caps.Machines)
	}
	// DAX must agree with what QEMU itself says about cache-size.
	if caps.VhostUserFS {
		out, err := exec.Command(qemu, "-nodefaults", "-machine", "none", "-device", "vhost-user-fs-pci,help").Output()
		if err != nil {
			t.Fatal(err)
		}
		want := strings.Contains(string(out), "cache-size=")
		if caps.DAX != want {
			t.Errorf("DAX = %v, -device vhost-user-fs-pci,help mentions cache-size: %v", caps.DAX, want)
		}
		if len(caps.FSProperties) == 0 {
			t.Error("no vhost-user-fs-pci properties parsed")
		}
	}
}

func TestProbeMissingBinary(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "qemu-system-nope")
	_, err := Probe(context.Background(), missing)
	if !errors.Is(err, ErrNotFound) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("err = %v, want ErrNotFound wrapping fs.ErrNotExist", err)
	}
	if !strings.Contains(err.Error(), missing) {
		t.Errorf("error %q does not name the path", err)
	}
	if _, err := Probe(context.Background(), "qemu-system-nope-not-in-path"); !errors.Is(err, ErrNotFound) {
		t.Errorf("bare name: err = %v", err)
	}
	notExec := filepath.Join(t.TempDir(), "qemu")
	if err := os.WriteFile(notExec, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Probe(context.Background(), notExec); !errors.Is(err, ErrNotFound) {
		t.Errorf("non-executable: err = %v", err)
	}
}

func TestProbeBrokenBinary(t *testing.T) {
	// A script that is not QEMU must give a parse error, not garbage caps.
	fake := filepath.Join(t.TempDir(), "qemu")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho hello\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Probe(context.Background(), fake); err == nil || !strings.Contains(err.Error(), "unrecognised -version output") {
		t.Fatalf("err = %v", err)
	}
	failing := filepath.Join(t.TempDir(), "qemu")
	if err := os.WriteFile(failing, []byte("#!/bin/sh\necho boom >&2\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Probe(context.Background(), failing); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("err = %v, want stderr in it", err)
	}
}

func TestProbeCancelled(t *testing.T) {
	slow := filepath.Join(t.TempDir(), "qemu")
	if err := os.WriteFile(slow, []byte("#!/bin/sh\nexec sleep 60\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Probe(ctx, slow); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestParseVersion(t *testing.T) {
	cases := []struct {
		in   string
		want Version
		ok   bool
	}{
		{"QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright", Version{7, 2, 22}, true},
		{"QEMU emulator version 8.1.0\n", Version{8, 1, 0}, true},
		{"QEMU emulator version 9.0\n", Version{9, 0, 0}, true},
		{"QEMU emulator version v\n", Version{}, false},
		{"", Version{}, false},
		{"QEMU emulator version 99999999999999999999.1.1", Version{}, false},
	}
	for _, c := range cases {
		_, v, err := ParseVersion([]byte(c.in))
		if (err == nil) != c.ok || v != c.want {
			t.Errorf("ParseVersion(%q) = %v, %v; want %v ok=%v", c.in, v, err, c.want, c.ok)
		}
	}
	if !(Version{7, 2, 0}).AtLeast(7, 2) || (Version{7, 1, 9}).AtLeast(7, 2) || !(Version{8, 0, 0}).AtLeast(7, 2) || (Version{6, 9, 0}).AtLeast(7, 0) {
		t.Error("AtLeast wrong")
	}
}

func TestParseMachines(t *testing.T) {
	out := "Supported machines are:\nmicrovm              microvm (i386)\npc                   Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-7.2)\npc-i440fx-7.2        Standard PC (i440FX + PIIX, 1996) (default)\nq35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)\nnone                 empty machine\n"
	ms := ParseMachines([]byte(out))
	if len(ms) != 5 {
		t.Fatalf("got %d machines: %+v", len(ms), ms)
	}
	if ms[1] != (Machine{Name: "pc", Description: "Standard PC (i440FX + PIIX, 1996)", Alias: "pc-i440fx-7.2"}) {
		t.Errorf("pc = %+v", ms[1])
	}
	if !ms[2].Default || ms[2].Alias != "" {
		t.Errorf("default = %+v", ms[2])
	}
	caps := &Caps{Machines: ms}
	if !caps.HasMachine("pc-q35-7.2") || caps.HasMachine("virt") {
		t.Error("HasMachine wrong")
	}
}

func TestParseDeviceProperties(t *testing.T) {
	out := "vhost-user-fs-pci options:\n  cache-size=<size>      -  (default: 0)\n  chardev=<str>          - ID of a chardev to use as a backend\n  tag=<str>\n"
	got := strings.Join(ParseDeviceProperties([]byte(out)), ",")
	if got != "cache-size,chardev,tag" {
		t.Errorf("got %s", got)
	}
}

func FuzzParseVersion(f *testing.F) {
	f.Add([]byte("QEMU emulator version 7.2.22 (Debian)\n"))
	f.Add([]byte("version 1.2"))
	f.Add([]byte("version 999999.999999.999999"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, v, err := ParseVersion(b)
		if err == nil && (v.Major < 0 || v.Minor < 0 || v.Micro < 0) {
			t.Fatalf("negative version %v", v)
		}
	})
}

func FuzzParseHelp(f *testing.F) {
	f.Add([]byte("name \"virtio-blk-pci\", bus PCI, alias \"virtio-blk\"\nname \""))
	f.Add([]byte("Supported machines are:\nq35  Standard (alias of pc-q35-7.2) (default)\n (alias of )\n"))
	f.Add([]byte("x options:\n  a=<b>\n  =\n   \n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, d := range ParseDeviceList(b) {
			if d == "" {
				t.Fatal("empty device name")
			}
		}
		for _, m := range ParseMachines(b) {
			if m.Name == "" {
				t.Fatalf("empty machine name in %+v", m)
			}
		}
		for _, p := range ParseDeviceProperties(b) {
			if p == "" || strings.ContainsAny(p, " \t") {
				t.Fatalf("bad property %q", p)
			}
		}
	})
}

func TestProbeIOUring(t *testing.T) {
	testenv.Tool(t, "qemu-io", "qemu-utils")
	f := filepath.Join(t.TempDir(), "probe.raw")
	if err := os.WriteFile(f, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	aio, why := ProbeIOUring(context.Background(), f)
	if (aio != "io_uring" && aio != "threads") || why == "" {
		t.Fatalf("ProbeIOUring = %q, %q", aio, why)
	}
	// A file qemu-io cannot read never yields io_uring.
	if aio, why := ProbeIOUring(context.Background(), filepath.Join(t.TempDir(), "missing")); aio != "threads" || !strings.Contains(why, "probe failed") {
		t.Fatalf("missing file: %q, %q", aio, why)
	}
}
