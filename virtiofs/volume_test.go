package virtiofs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// mountOptions returns the per-mount options of mount point mp.
func mountOptions(t *testing.T, mp string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	opts := ""
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 5 && f[4] == mp {
			opts = f[5] // the last one stacked there
		}
	}
	return opts
}

func TestShareVolume(t *testing.T) {
	testenv.Root(t, "bind mounts")
	base := t.TempDir()
	src := filepath.Join(base, "src")
	// An empty directory in a volume: Cleanup must never remove it.
	if err := os.MkdirAll(filepath.Join(src, "empty"), 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(base, "hosts")
	if err := os.WriteFile(file, []byte("127.0.0.1 localhost\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := NewSharedDir(filepath.Join(base, "sb"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Cleanup()

	rw, err := s.ShareVolume("c1", src, "/data", VolumeOptions{Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(rw.Name, "c1-") || !strings.HasSuffix(rw.Name, "-data") || len(rw.Name) != len("c1-")+16+len("-data") {
		t.Errorf("name %q, want Kata's c1-<16 hex>-data", rw.Name)
	}
	if err := os.WriteFile(filepath.Join(rw.HostPath, "new"), []byte("x"), 0o644); err != nil {
		t.Fatalf("write through the rw bind: %v", err)
	}
	if _, err := os.Stat(filepath.Join(src, "new")); err != nil {
		t.Errorf("the write did not reach the source: %v", err)
	}
	ro, err := s.ShareVolume("c1", src, "/data-ro", VolumeOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ro.HostPath, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write through the ro bind: %v, want EROFS", err)
	}
	if o := mountOptions(t, ro.HostPath); !strings.HasPrefix(o, "ro") {
		t.Errorf("ro bind options %q", o)
	}
	if _, err := os.Stat(filepath.Join(base, "sb", "private")); err == nil {
		t.Errorf("the private ro mount was left behind")
	}
	f, err := s.ShareVolume("c1", file, "/etc/hosts", VolumeOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(f.HostPath); err != nil || string(b) != "127.0.0.1 localhost\n" {
		t.Errorf("single-file bind reads %q, %v", b, err)
	}

	for _, bad := range []struct{ src, want string }{
		{"/dev/null", "character device"},
		{filepath.Join(base, "missing"), "no such file or directory"},
	} {
		if _, err := s.ShareVolume("c1", bad.src, "/x", VolumeOptions{}); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("share %s: %v, want %q", bad.src, err, bad.want)
		}
	}

	if err := s.UnshareVolume(f); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.HostPath); !os.IsNotExist(err) {
		t.Errorf("the single file's mount point stays: %v", err)
	}
	if _, err := os.Stat(file); err != nil {
		t.Errorf("unshare removed the source file: %v", err)
	}
	// The rest goes with Cleanup, binds still in place.
	if err := s.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if m, _ := mount.Under(filepath.Join(base, "sb")); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
	if _, err := os.Stat(s.Root); !os.IsNotExist(err) {
		t.Errorf("shared directory left: %v", err)
	}
	if _, err := os.Stat(filepath.Join(src, "empty")); err != nil {
		t.Errorf("Cleanup removed a directory of a volume: %v", err)
	}
}

// TestShareVolumeMountsBelow: a read-only rbind of a tree with a mount
// below it closes the top and leaves the mount below writable (ro), or
// closes both (rro), on the host where the daemon writes.
func TestShareVolumeMountsBelow(t *testing.T) {
	testenv.Root(t, "bind mounts")
	base := t.TempDir()
	src := filepath.Join(base, "src")
	sub := filepath.Join(src, "tmpfs")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("none", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(sub, unix.MNT_DETACH) })
	s, err := NewSharedDir(filepath.Join(base, "sb"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Cleanup()
	for _, tc := range []struct {
		o             VolumeOptions
		subWritable   bool
		writableBelow bool
	}{
		{VolumeOptions{Recursive: true, ReadOnly: true}, true, true},
		{VolumeOptions{Recursive: true, ReadOnly: true, RecursiveReadOnly: true}, false, false},
		{VolumeOptions{Recursive: false, ReadOnly: true}, false, false}, // bind: no mount below is cloned
	} {
		v, err := s.ShareVolume("c1", src, "/mnt", tc.o)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(v.HostPath, "top"), nil, 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("%+v: write to the top: %v, want EROFS", tc.o, err)
		}
		err = os.WriteFile(filepath.Join(v.HostPath, "tmpfs", "f"), nil, 0o644)
		if tc.subWritable && err != nil {
			t.Errorf("%+v: write below: %v, want it writable", tc.o, err)
		}
		if !tc.subWritable && err == nil {
			t.Errorf("%+v: write below succeeded, want it refused", tc.o)
		}
		if v.WritableBelow != tc.writableBelow {
			t.Errorf("%+v: WritableBelow %v, want %v", tc.o, v.WritableBelow, tc.writableBelow)
		}
		if err := s.UnshareVolume(v); err != nil {
			t.Fatal(err)
		}
	}
}
