package virtiofs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// hostCanary is a host directory outside the sandbox holding a mount
// point named rootfs (itself mounted), a file and an empty directory:
// what a planted symlink would point the shim at.
func hostCanary(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "host")
	for _, d := range []string{"rootfs", "empty"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "passwd"), []byte("root:x:0:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rootfs := filepath.Join(dir, "rootfs")
	if err := unix.Mount(rootfs, rootfs, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(rootfs, unix.MNT_DETACH) })
	return dir
}

func checkHostCanary(t *testing.T, dir string) {
	t.Helper()
	if b, err := os.ReadFile(filepath.Join(dir, "passwd")); err != nil || string(b) != "root:x:0:0\n" {
		t.Errorf("host file reads %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "empty")); err != nil || !fi.IsDir() {
		t.Errorf("host's empty directory: %v", err)
	}
	ms, err := mount.Under(dir)
	if err != nil || len(ms) != 1 || ms[0] != filepath.Join(dir, "rootfs") {
		t.Errorf("host mounts %v (%v), want only its own %s/rootfs", ms, err, dir)
	}
}

func containerImage(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "passwd"), []byte("image's copy\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// The guest's view of the tree the shim mounts in is read-only: it cannot
// make, rename or replace a name there, while the container's rootfs and
// rw volumes below it stay writable. Everything it sees is nosuid, nodev.
func TestGuestViewIsReadOnly(t *testing.T) {
	testenv.Root(t, "bind mounts")
	base := t.TempDir()
	s, err := NewSharedDir(filepath.Join(base, "sb"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Cleanup()
	if _, err := s.BindRootfs("c1", containerImage(t), false); err != nil {
		t.Fatal(err)
	}
	vol, err := s.ShareVolume("c1", t.TempDir(), "/data", VolumeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	view := s.Root // what the daemon exports
	for what, err := range map[string]error{
		"mkdir in the share":             os.Mkdir(filepath.Join(view, "x"), 0o755),
		"symlink in the share":           os.Symlink("/", filepath.Join(view, "c2")),
		"rename a container's directory": os.Rename(filepath.Join(view, "c1"), filepath.Join(view, "c9")),
		"symlink in a container's dir":   os.Symlink("/", filepath.Join(view, "c1", "x")),
		"remove a container's dir":       os.Remove(filepath.Join(view, "c1")),
		"write a file in the share":      os.WriteFile(filepath.Join(view, "f"), nil, 0o644),
	} {
		if !errors.Is(err, unix.EROFS) && !errors.Is(err, unix.EBUSY) {
			t.Errorf("%s: %v, want EROFS", what, err)
		}
	}
	if err := os.WriteFile(filepath.Join(view, "c1", "rootfs", "new"), []byte("x"), 0o644); err != nil {
		t.Errorf("write to the container's rootfs: %v", err)
	}
	if err := os.WriteFile(filepath.Join(view, vol.Name, "new"), []byte("x"), 0o644); err != nil {
		t.Errorf("write to a rw volume: %v", err)
	}
	for _, p := range []string{view, filepath.Join(view, "c1", "rootfs"), filepath.Join(view, vol.Name)} {
		var fs unix.Statfs_t
		if err := unix.Statfs(p, &fs); err != nil {
			t.Fatal(err)
		}
		if want := int64(unix.ST_NOSUID | unix.ST_NODEV); fs.Flags&want != want {
			t.Errorf("%s: flags %#x, want nosuid and nodev", p, fs.Flags)
		}
	}
	// The share's device nodes do nothing on the host.
	if err := unix.Mknod(filepath.Join(view, "c1", "rootfs", "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	if f, err := os.OpenFile(filepath.Join(view, "c1", "rootfs", "null"), os.O_WRONLY, 0); !errors.Is(err, unix.EACCES) {
		if f != nil {
			f.Close()
		}
		t.Errorf("open a device node made in the share: %v, want EACCES (nodev)", err)
	}
}

// Even with write access to mounts/ itself (more than the guest has), a
// symlink planted or swapped in makes the shim bind, unmount or remove
// nothing outside the sandbox.
func TestPlantedSymlinksChangeNothingOnTheHost(t *testing.T) {
	testenv.Root(t, "bind mounts")
	base := t.TempDir()
	host := hostCanary(t)
	s, err := NewSharedDir(filepath.Join(base, "sb"))
	if err != nil {
		t.Fatal(err)
	}
	img := containerImage(t)
	// Before create: the container's directory is a symlink to the host.
	if err := os.Symlink(host, filepath.Join(s.Mounts, "c1")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.BindRootfs("c1", img, false); err == nil {
		t.Error("bind through a planted container directory succeeded")
	}
	if err := os.Remove(filepath.Join(s.Mounts, "c1")); err != nil {
		t.Fatal(err)
	}
	// After create, before delete: the directory swapped for a symlink.
	if _, err := s.BindRootfs("c2", img, false); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(s.Mounts, "c2"), filepath.Join(s.Mounts, "moved")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(s.Mounts, "c2")); err != nil {
		t.Fatal(err)
	}
	if err := s.Unbind("c2"); err == nil {
		t.Error("unbind through a planted symlink succeeded")
	}
	checkHostCanary(t, host)
	// Teardown still takes down every mount it made, wherever it moved,
	// and removes nothing but the planted link's own name.
	if err := os.Symlink(host, filepath.Join(s.Mounts, "c3")); err != nil {
		t.Fatal(err)
	}
	if err := s.Cleanup(); err == nil {
		t.Error("cleanup with planted symlinks left in mounts/ reported success")
	}
	if ms, _ := mount.Under(filepath.Join(base, "sb")); len(ms) != 0 {
		t.Errorf("mounts left in the sandbox: %v", ms)
	}
	checkHostCanary(t, host)
}
