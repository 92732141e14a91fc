package initproc

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tool"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"PATH=/nonexistent:" + dir}
	if p, err := LookPath("tool", env); err != nil || p != filepath.Join(dir, "tool") {
		t.Errorf("lookPath(tool) = %q, %v", p, err)
	}
	for _, cmd := range []string{"data", "missing", filepath.Join(dir, "missing")} {
		_, err := LookPath(cmd, env)
		if err == nil || !strings.Contains(err.Error(), cmd) {
			t.Errorf("lookPath(%q): want an error naming it, got %v", cmd, err)
		}
	}
	if _, err := LookPath("missing", env); !errors.Is(err, exec.ErrNotFound) {
		t.Errorf("missing command: want exec.ErrNotFound, got %v", err)
	}
}

func TestMkdirNoSymlinks(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "escape", "proc")); err == nil {
		t.Error("created a mount point through a symlink")
	}
	if _, err := os.Stat(filepath.Join(outside, "proc")); err == nil {
		t.Error("directory created outside the rootfs")
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "dev", "pts")); err != nil {
		t.Error(err)
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "..", "x")); err == nil {
		t.Error("accepted a destination outside the rootfs")
	}
}

func TestMountInRootfsRejectsRelative(t *testing.T) {
	if err := mountInRootfs(t.TempDir(), Mount{Destination: "proc", Type: "proc"}); err == nil {
		t.Error("accepted a relative destination")
	}
}

func TestApplySysctls(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"kernel/shm_rmid_forced", "fs/mqueue/msg_max", "net/ipv4/conf/eth0.100/rp_filter"} {
		if err := os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), []byte("0\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	err := applySysctls(dir, map[string]string{
		"kernel.shm_rmid_forced":           "1",
		"fs.mqueue.msg_max":                "100",
		"net/ipv4/conf/eth0.100/rp_filter": "2",
	})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"kernel/shm_rmid_forced": "1", "fs/mqueue/msg_max": "100", "net/ipv4/conf/eth0.100/rp_filter": "2"} {
		got, err := os.ReadFile(filepath.Join(dir, p))
		if err != nil || string(got) != want {
			t.Errorf("%s = %q, %v; want %q", p, got, err, want)
		}
	}
	for _, bad := range []string{"..", "kernel..x", "../etc/passwd", "net/../../x", "", "a/b/"} {
		if err := applySysctls(dir, map[string]string{bad: "1"}); err == nil {
			t.Errorf("sysctl %q: accepted", bad)
		}
	}
	if err := applySysctls(dir, map[string]string{"kernel.no_such": "1"}); err == nil || !strings.Contains(err.Error(), "kernel.no_such") {
		t.Errorf("a sysctl the kernel lacks: %v, want an error naming it", err)
	}
}

// TestBindReadOnlyRecursion: a bind with ro leaves a submount of its
// source writable (the remount reaches the top mount only), one with rro
// makes the submount read-only too.
func TestBindReadOnlyRecursion(t *testing.T) {
	testenv.Root(t, "mounts a tmpfs and binds it")
	src := t.TempDir()
	sub := filepath.Join(src, "sub")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(sub, unix.MNT_DETACH) })
	for _, tc := range []struct {
		opt           string
		subReadOnly   bool
		whyItIsTested string
	}{
		{"ro", false, "CRI's readOnly volume: the submount keeps its own mode"},
		{"rro", true, "CRI's recursiveReadOnly volume"},
	} {
		root := t.TempDir()
		m := Mount{Destination: "/vol", Source: src, Type: "bind", Options: []string{"rbind", tc.opt, "rprivate"}}
		if err := mountInRootfs(root, m); err != nil {
			t.Fatalf("%s: %v", tc.opt, err)
		}
		dest := filepath.Join(root, "vol")
		t.Cleanup(func() { unix.Unmount(dest, unix.MNT_DETACH) })
		if err := os.WriteFile(filepath.Join(dest, "top"), nil, 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("%s (%s): write to the bind's top: %v, want EROFS", tc.opt, tc.whyItIsTested, err)
		}
		err := os.WriteFile(filepath.Join(dest, "sub", "f"), nil, 0o644)
		if tc.subReadOnly && !errors.Is(err, unix.EROFS) {
			t.Errorf("%s (%s): write to the submount: %v, want EROFS", tc.opt, tc.whyItIsTested, err)
		}
		if !tc.subReadOnly && err != nil {
			t.Errorf("%s (%s): write to the submount: %v, want it writable", tc.opt, tc.whyItIsTested, err)
		}
		if err := unix.Unmount(dest, unix.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
	}
}

// Read-only and masked paths behave as runc's: writes below a read-only
// path fail with EROFS, a masked file reads empty, a masked directory is
// empty and unwritable, and a missing path is no error. The mounts are
// made in a private mount namespace of a child (unshare -m), which takes
// them with it.
func TestReadonlyAndMaskedPaths(t *testing.T) {
	if dir := os.Getenv("KATA_FSX_PATHS_HELPER"); dir != "" {
		checkReadonlyAndMasked(t, dir)
		return
	}
	testenv.Root(t, "bind mounts")
	unshare := testenv.Tool(t, "unshare", "util-linux")
	dir := t.TempDir()
	for _, d := range []string{"ro", "masked-dir"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"ro/file", "masked-dir/secret", "masked-file"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("secret\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(unshare, "--mount", "--propagation", "private", os.Args[0], "-test.run=^TestReadonlyAndMaskedPaths$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "KATA_FSX_PATHS_HELPER="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestReadonlyAndMaskedPaths") {
		t.Fatalf("helper in a private mount namespace: %v\n%s", err, out)
	}
	// Nothing of it reached this namespace.
	if err := os.WriteFile(filepath.Join(dir, "ro", "file"), []byte("w\n"), 0o644); err != nil {
		t.Errorf("the read-only path is read-only outside the helper's namespace: %v", err)
	}
}

func checkReadonlyAndMasked(t *testing.T, dir string) {
	ro, mdir, mfile := filepath.Join(dir, "ro"), filepath.Join(dir, "masked-dir"), filepath.Join(dir, "masked-file")
	for _, p := range []string{ro, filepath.Join(dir, "missing")} {
		if err := readonlyPath(p); err != nil {
			t.Fatalf("readonlyPath(%s): %v", p, err)
		}
	}
	for _, p := range []string{mdir, mfile, filepath.Join(dir, "missing")} {
		if err := maskPath(p); err != nil {
			t.Fatalf("maskPath(%s): %v", p, err)
		}
	}
	if err := os.WriteFile(filepath.Join(ro, "file"), []byte("w\n"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write below the read-only path: %v, want EROFS", err)
	}
	if b, err := os.ReadFile(filepath.Join(ro, "file")); err != nil || string(b) != "secret\n" {
		t.Errorf("read below the read-only path: %q, %v", b, err)
	}
	if b, err := os.ReadFile(mfile); err != nil || len(b) != 0 {
		t.Errorf("masked file reads %q, %v; want nothing", b, err)
	}
	if ents, err := os.ReadDir(mdir); err != nil || len(ents) != 0 {
		t.Errorf("masked directory lists %v, %v; want nothing", ents, err)
	}
	if err := os.WriteFile(filepath.Join(mdir, "new"), []byte("w\n"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write in the masked directory: %v, want EROFS", err)
	}
}
