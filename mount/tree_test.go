package mount

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// canary is a host directory outside the tree that nothing may touch: it
// holds a file and an empty directory (what a removal would take).
func canary(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "canary")
	if err := os.MkdirAll(filepath.Join(dir, "empty"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "passwd"), []byte("root:x:0:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// checkCanary fails unless the canary is as canary made it and unmounted.
func checkCanary(t *testing.T, dir string) {
	t.Helper()
	if b, err := os.ReadFile(filepath.Join(dir, "passwd")); err != nil || string(b) != "root:x:0:0\n" {
		t.Errorf("canary file reads %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "empty")); err != nil || !fi.IsDir() {
		t.Errorf("canary's empty directory: %v", err)
	}
	if ms, _ := Under(dir); len(ms) > 0 {
		t.Errorf("canary is mounted: %v", ms)
	}
}

// refused says whether err is the kernel refusing a symlink on the way:
// ELOOP, or ENOTDIR where a directory was asked for without following.
func refused(err error) bool {
	return errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR)
}

func openTree(t *testing.T) (*Tree, string) {
	t.Helper()
	dir := t.TempDir()
	tr, err := OpenTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		tr.UnmountAll(".")
		tr.Close()
	})
	return tr, dir
}

func image(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "passwd"), []byte("image's copy\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// A symlink planted where a mount point's parent should be is never
// followed: the bind fails and nothing outside the tree is mounted.
func TestAttachRefusesPlantedSymlink(t *testing.T) {
	testenv.Root(t, "bind mounts")
	tr, dir := openTree(t)
	host := canary(t)
	if err := os.Symlink(host, filepath.Join(dir, "c1")); err != nil {
		t.Fatal(err)
	}
	src, err := Clone(image(t), true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := tr.Attach(src, "c1/rootfs", BindOptions{}); !refused(err) {
		t.Errorf("attach below a planted symlink: %v, want ELOOP or ENOTDIR", err)
	}
	if _, err := tr.Attach(src, "c1", BindOptions{}); !errors.Is(err, unix.EEXIST) {
		t.Errorf("attach onto a planted symlink: %v, want EEXIST", err)
	}
	if err := tr.Mkdir("c1/x", 0o755); !refused(err) {
		t.Errorf("mkdir below a planted symlink: %v, want ELOOP or ENOTDIR", err)
	}
	checkCanary(t, host)
	if _, err := os.Stat(filepath.Join(host, "rootfs")); !os.IsNotExist(err) {
		t.Errorf("a mount point was made in the canary: %v", err)
	}
}

// A bind's attributes are set before it is attached: nosuid and nodev
// always, read-only when asked, on the mount and every mount below it.
func TestAttachAttributes(t *testing.T) {
	testenv.Root(t, "bind mounts")
	tr, dir := openTree(t)
	src, err := Clone(image(t), true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := tr.Attach(src, "ro", BindOptions{ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Join(dir, "ro"), &fs); err != nil {
		t.Fatal(err)
	}
	want := int64(unix.ST_RDONLY | unix.ST_NOSUID | unix.ST_NODEV)
	if fs.Flags&want != want {
		t.Errorf("bind flags %#x, want ro, nosuid, nodev (%#x)", fs.Flags, want)
	}
	if err := os.WriteFile(filepath.Join(dir, "ro", "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write through a read-only bind: %v", err)
	}
}

// Unmount takes only the mount it made: a name swapped for a symlink to
// a host mount, or a mount that is not the one made, is left alone.
func TestUnmountOnlyWhatWasMade(t *testing.T) {
	testenv.Root(t, "bind mounts")
	tr, dir := openTree(t)
	// A host mount the guest would like detached, named as the
	// container's rootfs is.
	host := filepath.Join(t.TempDir(), "rootfs")
	if err := os.Mkdir(host, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(host, host, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(host, unix.MNT_DETACH)
	if err := tr.Mkdir("c1", 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := Clone(image(t), true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	id, err := tr.Attach(src, "c1/rootfs", BindOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Swap the container's directory for a symlink to the host mount's.
	if err := os.Rename(filepath.Join(dir, "c1"), filepath.Join(dir, "moved")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Dir(host), filepath.Join(dir, "c1")); err != nil {
		t.Fatal(err)
	}
	if err := tr.Unmount("c1/rootfs", id); !refused(err) {
		t.Errorf("unmount through a planted symlink: %v, want ELOOP or ENOTDIR", err)
	}
	if ms, _ := Under(host); len(ms) != 1 {
		t.Errorf("host mount after the refused unmount: %v", ms)
	}
	// The id of another mount at the right place is refused too.
	if err := os.Remove(filepath.Join(dir, "c1")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "moved"), filepath.Join(dir, "c1")); err != nil {
		t.Fatal(err)
	}
	// Another id: not the mount found there, so that mount stays.
	tr.Unmount("c1/rootfs", id+1000)
	if ms, _ := Under(filepath.Join(dir, "c1")); len(ms) != 1 {
		t.Errorf("unmount of another mount id took %s/c1/rootfs: %v", dir, ms)
	}
	if err := tr.Unmount("c1/rootfs", id); err != nil {
		t.Fatal(err)
	}
	if ms, _ := Under(filepath.Join(dir, "c1")); len(ms) != 0 {
		t.Errorf("still mounted: %v", ms)
	}
	if err := tr.Unmount("c1/rootfs", id); err != nil {
		t.Errorf("unmount of a mount already gone: %v", err)
	}
}

// RemoveEmpty removes empty directories and files reached without a
// symlink, and nothing else: not through a symlink, not a file with
// data, not a directory with a mount still on it.
func TestRemoveEmpty(t *testing.T) {
	testenv.Root(t, "bind mounts")
	tr, dir := openTree(t)
	host := canary(t)
	for _, d := range []string{"a/b/c", "m"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "a", "b", "mp"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(dir, "a", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(dir, "s")); err != nil {
		t.Fatal(err)
	}
	if err := tr.RemoveEmpty("a"); err == nil {
		t.Error("removed a tree holding a symlink")
	}
	if err := tr.RemoveEmpty("s/empty"); !refused(err) {
		t.Errorf("remove through a symlink: %v, want ELOOP or ENOTDIR", err)
	}
	if err := os.Remove(filepath.Join(dir, "a", "link")); err != nil {
		t.Fatal(err)
	}
	if err := tr.RemoveEmpty("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "a")); !os.IsNotExist(err) {
		t.Errorf("a: %v", err)
	}
	src, err := Clone(host, false)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := tr.Attach(src, "m/host", BindOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := tr.RemoveEmpty("m"); err == nil {
		t.Error("removed a directory with a mount on it")
	}
	if b, err := os.ReadFile(filepath.Join(dir, "m", "host", "passwd")); err != nil || string(b) != "root:x:0:0\n" {
		t.Errorf("through the bind: %q, %v", b, err)
	}
	if err := tr.UnmountAll("."); err != nil {
		t.Fatal(err)
	}
	if err := tr.RemoveEmpty("m"); err != nil {
		t.Fatal(err)
	}
	checkCanary(t, host)
}
