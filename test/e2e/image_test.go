package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// fixture runs a test/fixtures script (cached builds of real trees); tool
// is what the script needs, debootstrap or npm, each packaged under its
// own name.
func fixture(t *testing.T, script, tool string) string {
	t.Helper()
	testenv.Tool(t, tool, tool)
	cmd := exec.Command(filepath.Join(repoRoot, "test", "fixtures", script))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	return strings.TrimSpace(string(out))
}

func runCLI(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(kataFSX(t), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("kata-fsx %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String()
}

// checkImageOfTree builds an image of src through the CLI, exports it raw,
// runs e2fsck -fn and compares a read-only loop mount with src.
func checkImageOfTree(t *testing.T, src string) {
	testenv.Root(t, "loop mounts")
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	work := t.TempDir()
	img, raw, cache := filepath.Join(work, "img"), filepath.Join(work, "disk.raw"), filepath.Join(work, "cache")
	out := runCLI(t, "image", "build", "dir:"+src, "-o", img, "--cache", cache, "-q")
	t.Log(strings.TrimSpace(out))
	runCLI(t, "image", "export", img, "--raw", raw, "--cache", cache)
	fsck := exec.Command("e2fsck", "-fn", raw)
	if b, err := fsck.CombinedOutput(); err != nil {
		t.Fatalf("e2fsck -fn: %v\n%s", err, b)
	}
	mnt := filepath.Join(work, "mnt")
	os.Mkdir(mnt, 0o755)
	if b, err := exec.Command("mount", "-o", "loop,ro,noload", raw, mnt).CombinedOutput(); err != nil {
		t.Fatalf("loop mount of the exported image: %v %s", err, b)
	}
	defer func() {
		if b, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount: %v %s", err, b)
		}
	}()
	compareTrees(t, src, mnt)
}

// compareTrees checks that mounted shows exactly src: paths, types, modes,
// owners, mtime and ctime to the nanosecond, sizes, xattrs, symlink
// targets, device numbers, hard-link groups, holes and content.
func compareTrees(t *testing.T, src, mounted string) {
	t.Helper()
	ctx := context.Background()
	a, err := hostfs.FromDir(ctx, src, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := hostfs.FromDir(ctx, mounted, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	be := map[string]*index.Entry{}
	for i := range b.Entries {
		be[b.Entries[i].Path] = &b.Entries[i]
	}
	problems := 0
	report := func(format string, args ...any) {
		problems++
		if problems <= 20 {
			t.Errorf(format, args...)
		}
	}
	for i := range a.Entries {
		x := &a.Entries[i]
		y, ok := be[x.Path]
		if !ok {
			report("%s: missing from the image", x.Path)
			continue
		}
		delete(be, x.Path)
		if x.Path == "." {
			continue // the root's times and mode come from the source too, but lost+found changes its nlink
		}
		if x.Type != y.Type || x.Mode != y.Mode || x.UID != y.UID || x.GID != y.GID {
			report("%s: type/mode/owner %v %o %d:%d vs %v %o %d:%d", x.Path, x.Type, x.Mode, x.UID, x.GID, y.Type, y.Mode, y.UID, y.GID)
		}
		if x.Mtime != y.Mtime || x.Ctime != y.Ctime {
			report("%s: mtime/ctime %v %v vs %v %v", x.Path, x.Mtime, x.Ctime, y.Mtime, y.Ctime)
		}
		if x.Linkname != y.Linkname || x.Devmajor != y.Devmajor || x.Devminor != y.Devminor {
			report("%s: link %q dev %d:%d vs %q %d:%d", x.Path, x.Linkname, x.Devmajor, x.Devminor, y.Linkname, y.Devmajor, y.Devminor)
		}
		if fmt.Sprint(x.Xattrs) != fmt.Sprint(y.Xattrs) {
			report("%s: xattrs %v vs %v", x.Path, x.Xattrs, y.Xattrs)
		}
		if x.Type == index.TypeRegular {
			if x.Size != y.Size || fmt.Sprint(x.Data.Segments) != fmt.Sprint(y.Data.Segments) {
				report("%s: size %d holes %v vs %d %v", x.Path, x.Size, x.Data.Segments, y.Size, y.Data.Segments)
			} else if ha, hb := fileHash(t, filepath.Join(src, x.Path)), fileHash(t, filepath.Join(mounted, x.Path)); ha != hb {
				report("%s: content differs", x.Path)
			}
		}
	}
	for p := range be {
		if p != "lost+found" {
			report("%s: in the image but not in the source", p)
		}
	}
	if problems > 0 {
		t.Fatalf("%d differences between %s and its image", problems, src)
	}
	t.Logf("%d entries identical", len(a.Entries))
}

func fileHash(t *testing.T, p string) string {
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

func TestImageOfDebianRootfs(t *testing.T) {
	checkImageOfTree(t, fixture(t, "debian-rootfs.sh", "debootstrap"))
}

func TestImageOfNodeModules(t *testing.T) {
	checkImageOfTree(t, filepath.Join(fixture(t, "node-modules.sh", "npm"), "node_modules"))
}

// TestImageOfGeneratedTree covers what real trees rarely have: every file
// type, odd names, deep nesting, a huge directory, hard links, sparse and
// large sparse files, xattrs, setuid/sticky, high ids, ns timestamps.
func TestImageOfGeneratedTree(t *testing.T) {
	testenv.Root(t, "device nodes and ownership")
	root := filepath.Join(t.TempDir(), "tree")
	genTree(t, root, 42)
	checkImageOfTree(t, root)
}

func genTree(t *testing.T, root string, seed int64) {
	t.Helper()
	r := rand.New(rand.NewSource(seed))
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(root, 0o755))
	// Deep nesting and long, non-ASCII names.
	deep := root
	for i := 0; i < 60; i++ {
		deep = filepath.Join(deep, fmt.Sprintf("d%02d", i))
	}
	must(os.MkdirAll(deep, 0o755))
	must(os.WriteFile(filepath.Join(deep, strings.Repeat("n", 255)), []byte("deep"), 0o644))
	must(os.WriteFile(filepath.Join(root, "ünïcødé-名前-🙂"), []byte("utf8"), 0o600))
	// A huge directory (htree) with files of 0..9000 bytes.
	big := filepath.Join(root, "big")
	must(os.Mkdir(big, 0o755))
	for i := 0; i < 20000; i++ {
		data := make([]byte, r.Intn(9000))
		r.Read(data)
		must(os.WriteFile(filepath.Join(big, fmt.Sprintf("f%06d", i)), data, 0o644))
	}
	// Hard links, empty and 1-byte files.
	must(os.WriteFile(filepath.Join(root, "empty"), nil, 0o644))
	must(os.WriteFile(filepath.Join(root, "one"), []byte("x"), 0o644))
	for i := 0; i < 30; i++ {
		must(os.Link(filepath.Join(root, "one"), filepath.Join(root, fmt.Sprintf("link%02d", i))))
	}
	// Sparse files: holes in the middle, a 5 GiB one with a written tail.
	sp, err := os.Create(filepath.Join(root, "sparse"))
	must(err)
	for _, off := range []int64{0, 1 << 20, 7 << 20, 64 << 20} {
		_, err := sp.WriteAt(bytes.Repeat([]byte{byte(off >> 20)}, 8192), off)
		must(err)
	}
	sp.Close()
	huge, err := os.Create(filepath.Join(root, "huge"))
	must(err)
	_, err = huge.WriteAt([]byte("tail"), 5<<30)
	must(err)
	huge.Close()
	// Every other file type.
	must(syscall.Mknod(filepath.Join(root, "chr"), syscall.S_IFCHR|0o600, int(mkdev(1, 3))))
	must(syscall.Mknod(filepath.Join(root, "blk"), syscall.S_IFBLK|0o600, int(mkdev(259, 70000))))
	must(syscall.Mkfifo(filepath.Join(root, "fifo"), 0o644))
	must(syscall.Mknod(filepath.Join(root, "sock"), syscall.S_IFSOCK|0o755, 0))
	must(os.Symlink("one", filepath.Join(root, "fast-link")))
	must(os.Symlink(strings.Repeat("long/", 30)+"target", filepath.Join(root, "slow-link")))
	must(os.Symlink("/etc/passwd", filepath.Join(root, "abs-link")))
	// Modes, owners, xattrs, times.
	must(os.WriteFile(filepath.Join(root, "suid"), []byte("#!/bin/sh\n"), 0o755))
	must(os.Chmod(filepath.Join(root, "suid"), 0o4755|os.ModeSetuid))
	must(syscall.Chmod(filepath.Join(root, "suid"), 0o4755))
	must(os.Mkdir(filepath.Join(root, "sticky"), 0o755))
	must(syscall.Chmod(filepath.Join(root, "sticky"), 0o1777))
	must(os.Lchown(filepath.Join(root, "one"), 100000, 4000000000))
	must(syscall.Setxattr(filepath.Join(root, "one"), "user.kata", []byte("fsx"), 0))
	must(syscall.Setxattr(filepath.Join(root, "suid"), "security.capability", []byte{1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0))
	must(syscall.Setxattr(filepath.Join(root, "empty"), "user.big", bytes.Repeat([]byte("v"), 3000), 0))
	ts := time.Unix(1234567890, 123456789)
	must(os.Chtimes(filepath.Join(root, "empty"), ts, ts))
}

func mkdev(major, minor uint32) uint64 {
	return uint64(minor&0xff) | uint64(major&0xfff)<<8 | uint64(minor&^0xff)<<12 | uint64(major&^0xfff)<<32
}
