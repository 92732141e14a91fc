package ext4

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const testTime = 1700000000

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// writeFile creates p with content and mode.
func writeFile(t testing.TB, p string, content []byte, mode os.FileMode) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(p), 0o755))
	must(t, os.WriteFile(p, content, mode))
	must(t, os.Chmod(p, mode))
}

// writeSparse creates a file of size bytes with data only at offs.
func writeSparse(t testing.TB, p string, size int64, offs []int64, chunk int) {
	t.Helper()
	f, err := os.Create(p)
	must(t, err)
	defer f.Close()
	must(t, f.Truncate(size))
	buf := make([]byte, chunk)
	for i, o := range offs {
		for k := range buf {
			buf[k] = byte(i*7 + k)
		}
		_, err := f.WriteAt(buf, o)
		must(t, err)
	}
}

// makeTree generates the test tree with a fixed seed; big adds the files
// that cost host disk time (a 140 MiB file crossing a backup superblock).
func makeTree(t testing.TB, root string, big bool) {
	rng := rand.New(rand.NewSource(1))
	// Deep nesting.
	deep := root
	for i := 0; i < 40; i++ {
		deep = filepath.Join(deep, fmt.Sprintf("d%02d", i))
	}
	writeFile(t, filepath.Join(deep, "leaf"), []byte("deep"), 0o644)
	// Long and non-ASCII names.
	writeFile(t, filepath.Join(root, "names", strings.Repeat("n", 255)), []byte("x"), 0o644)
	must(t, os.MkdirAll(filepath.Join(root, "names", strings.Repeat("D", 255)), 0o755))
	for _, n := range []string{"日本語のファイル", "é", "straße", "emoji-🙂", "bad-utf8-\xff\xfe", "sp ace", "tab\tname", "new\nline"} {
		writeFile(t, filepath.Join(root, "names", n), []byte(n), 0o644)
	}
	// Sizes around block boundaries, empty and 1-byte files.
	for _, n := range []int{0, 1, 59, 60, 4095, 4096, 4097, 8191, 8192, 8193, 65536 + 3, 1 << 20} {
		b := make([]byte, n)
		rng.Read(b)
		writeFile(t, filepath.Join(root, "sizes", fmt.Sprintf("f%d", n)), b, 0o644)
	}
	// A directory needing an htree (one level), with non-ASCII names so the
	// signed-char hash matters.
	for i := 0; i < 3000; i++ {
		writeFile(t, filepath.Join(root, "wide", fmt.Sprintf("entry-%05d-%s", i, strings.Repeat("é", i%7))), nil, 0o644)
	}
	// Hard links.
	writeFile(t, filepath.Join(root, "links", "orig"), []byte("linked content"), 0o640)
	for i := 0; i < 50; i++ {
		dir := filepath.Join(root, "links", fmt.Sprintf("sub%d", i%5))
		must(t, os.MkdirAll(dir, 0o755))
		must(t, os.Link(filepath.Join(root, "links", "orig"), filepath.Join(dir, fmt.Sprintf("l%d", i))))
	}
	writeFile(t, filepath.Join(root, "links", "empty-orig"), nil, 0o600)
	must(t, os.Link(filepath.Join(root, "links", "empty-orig"), filepath.Join(root, "links", "empty-link")))
	// Sparse files: several GiB with holes, > 4 GiB, many extents.
	must(t, os.MkdirAll(filepath.Join(root, "sparse"), 0o755))
	writeSparse(t, filepath.Join(root, "sparse", "holes-6g"), 6<<30, []int64{0, 1<<30 + 100, 3 << 30, 6<<30 - 10}, 5000)
	writeSparse(t, filepath.Join(root, "sparse", "tail-5g"), 5<<30+1, []int64{5<<30 - 4096}, 4097)
	writeSparse(t, filepath.Join(root, "sparse", "all-hole"), 1<<20, nil, 0)
	var offs []int64
	for i := 0; i < 10; i++ {
		offs = append(offs, int64(i)*65536)
	}
	writeSparse(t, filepath.Join(root, "sparse", "ext10"), 11*65536, offs, 4096)
	offs = offs[:0]
	for i := 0; i < 2000; i++ {
		offs = append(offs, int64(i)*65536)
	}
	writeSparse(t, filepath.Join(root, "sparse", "ext2000"), 2000*65536, offs, 4096) // depth-2 tree
	// Every file type.
	must(t, os.MkdirAll(filepath.Join(root, "dev"), 0o755))
	must(t, unix.Mkfifo(filepath.Join(root, "dev", "fifo"), 0o644))
	must(t, unix.Mknod(filepath.Join(root, "dev", "sock"), unix.S_IFSOCK|0o755, 0))
	must(t, unix.Mknod(filepath.Join(root, "dev", "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, unix.Mknod(filepath.Join(root, "dev", "bigchr"), unix.S_IFCHR|0o600, int(unix.Mkdev(300, 70000))))
	must(t, unix.Mknod(filepath.Join(root, "dev", "blk"), unix.S_IFBLK|0o660, int(unix.Mkdev(8, 1))))
	must(t, unix.Mknod(filepath.Join(root, "dev", "bigblk"), unix.S_IFBLK|0o660, int(unix.Mkdev(259, 256))))
	// Symlinks: fast, boundary, slow.
	must(t, os.MkdirAll(filepath.Join(root, "sym"), 0o755))
	must(t, os.Symlink("../sizes/f1", filepath.Join(root, "sym", "fast")))
	must(t, os.Symlink(strings.Repeat("a", 59), filepath.Join(root, "sym", "b59")))
	must(t, os.Symlink(strings.Repeat("b", 60), filepath.Join(root, "sym", "b60")))
	must(t, os.Symlink(strings.Repeat("long/", 200), filepath.Join(root, "sym", "slow")))
	must(t, os.Symlink("dangling-target", filepath.Join(root, "sym", "dangling")))
	// Modes and owners.
	writeFile(t, filepath.Join(root, "modes", "setuid"), []byte("#!/bin/sh\n"), 0o755)
	must(t, os.Chmod(filepath.Join(root, "modes", "setuid"), 0o4755|os.ModeSetuid))
	must(t, unix.Chmod(filepath.Join(root, "modes", "setuid"), 0o4755))
	must(t, os.MkdirAll(filepath.Join(root, "modes", "sticky"), 0o755))
	must(t, unix.Chmod(filepath.Join(root, "modes", "sticky"), 0o1777))
	must(t, os.MkdirAll(filepath.Join(root, "modes", "setgid"), 0o755))
	must(t, unix.Chmod(filepath.Join(root, "modes", "setgid"), 0o2750))
	writeFile(t, filepath.Join(root, "modes", "bigids"), []byte("ids"), 0o600)
	must(t, os.Lchown(filepath.Join(root, "modes", "bigids"), 100000, 4000000000))
	must(t, os.Lchown(filepath.Join(root, "sym", "fast"), 70000, 70001))
	writeFile(t, filepath.Join(root, "modes", "none"), nil, 0)
	// Xattrs: in-inode, in-block, shared block, ACLs.
	must(t, os.MkdirAll(filepath.Join(root, "xattr"), 0o755))
	small := filepath.Join(root, "xattr", "small")
	writeFile(t, small, []byte("s"), 0o644)
	must(t, unix.Setxattr(small, "user.k", []byte("v"), 0))
	must(t, unix.Setxattr(small, "trusted.t", []byte("trusted value"), 0))
	capv := []byte{0, 0, 0, 2, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	must(t, unix.Setxattr(small, "security.capability", capv, 0))
	bigv := bytes.Repeat([]byte("0123456789abcdef"), 120)
	for i := 0; i < 3; i++ {
		p := filepath.Join(root, "xattr", fmt.Sprintf("big%d", i))
		writeFile(t, p, []byte("b"), 0o644)
		must(t, unix.Setxattr(p, "user.big", bigv, 0))
		must(t, unix.Setxattr(p, "user.small", []byte("x"), 0))
		if i == 2 {
			must(t, unix.Setxattr(p, "user.more", bytes.Repeat([]byte{byte(i)}, 900), 0))
		}
	}
	must(t, unix.Setxattr(filepath.Join(root, "xattr"), "user.dirattr", []byte("on a dir"), 0))
	must(t, unix.Setxattr(filepath.Join(root, "xattr"), "user.empty", nil, 0))
	acl := []byte{2, 0, 0, 0, 1, 0, 6, 0, 0xff, 0xff, 0xff, 0xff, 2, 0, 4, 0, 0xe8, 3, 0, 0, 4, 0, 4, 0, 0xff, 0xff, 0xff, 0xff,
		0x10, 0, 4, 0, 0xff, 0xff, 0xff, 0xff, 0x20, 0, 4, 0, 0xff, 0xff, 0xff, 0xff}
	aclf := filepath.Join(root, "xattr", "acl")
	writeFile(t, aclf, nil, 0o640)
	if err := unix.Setxattr(aclf, "system.posix_acl_access", acl, 0); err != nil {
		t.Logf("host refuses POSIX ACLs, not testing them: %v", err)
	}
	if big {
		p := filepath.Join(root, "bigdata", "140m")
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		f, err := os.Create(p)
		must(t, err)
		blk := make([]byte, 1<<20)
		for i := 0; i < 140; i++ {
			for k := 0; k < len(blk); k += 4096 {
				binary.LittleEndian.PutUint64(blk[k:], uint64(i*256+k/4096))
			}
			_, err := f.Write(blk)
			must(t, err)
		}
		must(t, f.Close())
	}
	// Timestamps last: nanoseconds, pre-1970 and post-2038 seconds.
	stamps := []unix.Timespec{{Sec: 1234567890, Nsec: 123456789}, {Sec: -1000000, Nsec: 999999999}, {Sec: 1 << 33, Nsec: 1}}
	for i, p := range []string{filepath.Join(root, "sizes", "f1"), filepath.Join(root, "sizes", "f0"), filepath.Join(root, "names", "é")} {
		must(t, unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{stamps[i], stamps[(i+1)%3]}, unix.AT_SYMLINK_NOFOLLOW))
	}
	must(t, unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(root, "sym", "slow"), []unix.Timespec{stamps[0], stamps[2]}, unix.AT_SYMLINK_NOFOLLOW))
}

// buildExport builds idx and exports it to a raw file in dir.
func buildExport(t testing.TB, idx *index.Index, opts Options, dir string) (*Image, string) {
	t.Helper()
	img, err := Build(context.Background(), idx, opts)
	must(t, err)
	t.Cleanup(func() { img.Close() })
	out := filepath.Join(dir, "disk.img")
	f, err := os.Create(out)
	must(t, err)
	must(t, Export(context.Background(), img, dirOpener{}, f))
	must(t, f.Close())
	return img, out
}

// fsck runs e2fsck -fn and fails on any problem or non-zero status.
func fsck(t testing.TB, img string) {
	t.Helper()
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	out, err := exec.Command("e2fsck", "-fn", img).CombinedOutput()
	if err != nil {
		t.Fatalf("e2fsck -fn: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if l != "" && !strings.HasPrefix(l, "e2fsck ") && !strings.HasPrefix(l, "Pass ") && !strings.Contains(l, " files (") {
			t.Fatalf("e2fsck reported: %q\n%s", l, out)
		}
	}
}

// mountRO loop-mounts img read-only and returns the mount point.
func mountRO(t testing.TB, img string) string {
	t.Helper()
	testenv.Root(t, "a loop mount")
	testenv.Tool(t, "mount", "mount")
	mnt := t.TempDir()
	if out, err := exec.Command("mount", "-t", "ext4", "-o", "loop,ro,noload", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("loop mount: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount: %v: %s", err, out)
		}
	})
	return mnt
}

func fileHash(t testing.TB, p string) [32]byte {
	t.Helper()
	f, err := os.Open(p)
	must(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	must(t, err)
	var s [32]byte
	h.Sum(s[:0])
	return s
}

// sameRange compares a byte range of two files.
func sameRange(t testing.TB, a, b string, r index.Range) bool {
	t.Helper()
	read := func(p string) []byte {
		f, err := os.Open(p)
		must(t, err)
		defer f.Close()
		buf := make([]byte, r.Len)
		_, err = f.ReadAt(buf, r.Off)
		if err != nil && err != io.EOF {
			t.Fatal(err)
		}
		return buf
	}
	return bytes.Equal(read(a), read(b))
}

// compareTree checks the mounted filesystem against the index and the
// source files it was built from.
func compareTree(t *testing.T, idx *index.Index, src, mnt string, bs int64) {
	t.Helper()
	byPath := make(map[string]*index.Entry)
	subdirs := make(map[string]int)
	links := make(map[string]int)
	for i := range idx.Entries {
		e := &idx.Entries[i]
		byPath[e.Path] = e
		if e.Type == index.TypeDir && e.Path != "." {
			subdirs[filepath.Dir(e.Path)]++
		}
		if e.Type == index.TypeHardlink {
			links[e.Linkname]++
		}
	}
	// Every mounted name is in the index (lost+found aside) and vice versa.
	var seen int
	must(t, filepath.Walk(mnt, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(mnt, p)
		if rel == "lost+found" {
			return filepath.SkipDir
		}
		if byPath[rel] == nil {
			t.Errorf("%q: in the image but not in the index", rel)
		}
		seen++
		return nil
	}))
	if want := len(idx.Entries); seen != want {
		t.Errorf("image has %d names, index %d", seen, want)
	}
	for i := range idx.Entries {
		e := &idx.Entries[i]
		mp := filepath.Join(mnt, e.Path)
		var st unix.Stat_t
		if err := unix.Lstat(mp, &st); err != nil {
			t.Errorf("%q: %v", e.Path, err)
			continue
		}
		if e.Type == index.TypeHardlink {
			var tst unix.Stat_t
			must(t, unix.Lstat(filepath.Join(mnt, e.Linkname), &tst))
			if st.Ino != tst.Ino {
				t.Errorf("%q: inode %d, want %d of %q", e.Path, st.Ino, tst.Ino, e.Linkname)
			}
			continue
		}
		wantType := map[index.Type]uint32{index.TypeRegular: unix.S_IFREG, index.TypeDir: unix.S_IFDIR,
			index.TypeSymlink: unix.S_IFLNK, index.TypeChar: unix.S_IFCHR, index.TypeBlock: unix.S_IFBLK,
			index.TypeFifo: unix.S_IFIFO, index.TypeSocket: unix.S_IFSOCK}[e.Type]
		if st.Mode != wantType|e.Mode {
			t.Errorf("%q: mode %#o, want %#o", e.Path, st.Mode, wantType|e.Mode)
		}
		if st.Uid != e.UID || st.Gid != e.GID {
			t.Errorf("%q: owner %d:%d, want %d:%d", e.Path, st.Uid, st.Gid, e.UID, e.GID)
		}
		for _, c := range []struct {
			name string
			got  unix.Timespec
			want index.Timespec
		}{{"atime", st.Atim, e.Atime}, {"mtime", st.Mtim, e.Mtime}, {"ctime", st.Ctim, e.Ctime}} {
			if c.got.Sec != c.want.Sec || uint32(c.got.Nsec) != c.want.Nsec {
				t.Errorf("%q: %s %d.%09d, want %d.%09d", e.Path, c.name, c.got.Sec, c.got.Nsec, c.want.Sec, c.want.Nsec)
			}
		}
		wantLinks := uint64(1 + links[e.Path])
		if e.Type == index.TypeDir {
			wantLinks = uint64(2 + subdirs[e.Path])
			if e.Path == "." {
				wantLinks++ // lost+found
			}
		}
		if st.Nlink != wantLinks {
			t.Errorf("%q: nlink %d, want %d", e.Path, st.Nlink, wantLinks)
		}
		gotX, err := xattrs(mp)
		must(t, err)
		if fmt.Sprint(gotX) != fmt.Sprint(e.Xattrs) {
			t.Errorf("%q: xattrs %q, want %q", e.Path, gotX, e.Xattrs)
		}
		switch e.Type {
		case index.TypeSymlink:
			if l, err := os.Readlink(mp); err != nil || l != e.Linkname {
				t.Errorf("%q: link %q (%v), want %q", e.Path, l, err, e.Linkname)
			}
		case index.TypeChar, index.TypeBlock:
			if unix.Major(st.Rdev) != e.Devmajor || unix.Minor(st.Rdev) != e.Devminor {
				t.Errorf("%q: device %d:%d, want %d:%d", e.Path, unix.Major(st.Rdev), unix.Minor(st.Rdev), e.Devmajor, e.Devminor)
			}
		case index.TypeRegular:
			if st.Size != e.Size {
				t.Errorf("%q: size %d, want %d", e.Path, st.Size, e.Size)
				continue
			}
			if e.Data.Segments == nil && fileHash(t, mp) != fileHash(t, filepath.Join(src, e.Data.Path)) {
				t.Errorf("%q: content differs from the source", e.Path)
			}
			got, err := segments(mp, e.Size)
			must(t, err)
			var want []index.Range
			if e.Data.Segments == nil && e.Size > 0 {
				want = []index.Range{{Off: 0, Len: e.Size}}
			}
			for _, s := range e.Data.Segments {
				o := s.Off &^ (bs - 1)
				end := min((s.Off+s.Len+bs-1)&^(bs-1), e.Size)
				if k := len(want); k > 0 && want[k-1].Off+want[k-1].Len >= o {
					want[k-1].Len = end - want[k-1].Off
					continue
				}
				want = append(want, index.Range{Off: o, Len: end - o})
			}
			if fmt.Sprint(got) != fmt.Sprint(want) && !(len(got) == 0 && len(want) == 0) {
				t.Errorf("%q: data segments %v, want %v", e.Path, got, want)
			}
			// Holes read as zeros on both sides, so the data ranges decide.
			for _, r := range want {
				if !sameRange(t, mp, filepath.Join(src, e.Data.Path), r) {
					t.Errorf("%q: bytes [%d,+%d) differ from the source", e.Path, r.Off, r.Len)
				}
			}
		}
	}
}

func TestBuildRealTools(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	src := t.TempDir()
	makeTree(t, src, !testing.Short())
	idx := indexDir(t, src)
	img, raw := buildExport(t, idx, Options{Time: time.Unix(testTime, 0)}, t.TempDir())
	fsck(t, raw)
	mnt := mountRO(t, raw)
	compareTree(t, idx, src, mnt, 4096)

	var root, lpf unix.Stat_t
	must(t, unix.Lstat(mnt, &root))
	must(t, unix.Lstat(filepath.Join(mnt, "lost+found"), &lpf))
	if root.Ino != 2 || lpf.Ino != 11 || lpf.Mode != unix.S_IFDIR|0o700 {
		t.Errorf("root ino %d, lost+found ino %d mode %#o; want 2, 11, dir 0700", root.Ino, lpf.Ino, lpf.Mode)
	}
	// debugfs agrees on the structures e2fsck accepted.
	testenv.Tool(t, "debugfs", "e2fsprogs")
	out, err := exec.Command("debugfs", "-R", "htree_dump /wide", raw).CombinedOutput()
	must(t, err)
	if !strings.Contains(string(out), "Indirect levels: 0") || strings.Contains(string(out), "Invalid") {
		t.Errorf("htree_dump /wide:\n%.2000s", out)
	}
	out, err = exec.Command("debugfs", "-R", "stat /sparse/ext2000", raw).CombinedOutput()
	must(t, err)
	if !strings.Contains(string(out), "Level Entries") && !strings.Contains(string(out), "(ETB1)") {
		t.Errorf("stat /sparse/ext2000 shows no depth-2 tree:\n%.2000s", out)
	}
	// Identical external xattr blocks are shared.
	acl := func(p string) string {
		out, err := exec.Command("debugfs", "-R", "stat "+p, raw).CombinedOutput()
		must(t, err)
		for _, f := range strings.Fields(strings.SplitN(string(out), "File ACL:", 2)[1])[:1] {
			return f
		}
		return ""
	}
	if a, b, c := acl("/xattr/big0"), acl("/xattr/big1"), acl("/xattr/big2"); a == "0" || a != b || c == a || c == "0" {
		t.Errorf("xattr blocks: big0 %s big1 %s big2 %s; want big0 == big1 != big2, none 0", a, b, c)
	}
	if img.Manifest.DataBytes == 0 || img.Manifest.MetaBytes == 0 {
		t.Errorf("manifest counts nothing: %+v", img.Manifest)
	}
}

// TestHugeDirectory builds a 100 000-entry directory from an in-memory
// index: its htree needs two index levels.
func TestHugeDirectory(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	idx := &index.Index{Entries: []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}, {Path: "big", Type: index.TypeDir, Mode: 0o755}}}
	const n = 100000
	for i := 0; i < n; i++ {
		idx.Entries = append(idx.Entries, index.Entry{Path: fmt.Sprintf("big/file-with-a-longish-name-%06d", i), Type: index.TypeRegular, Mode: 0o644,
			Mtime: index.Timespec{Sec: int64(i), Nsec: uint32(i)}})
	}
	for i := 0; i < 200; i++ {
		idx.Entries = append(idx.Entries, index.Entry{Path: fmt.Sprintf("big/sub%03d", i), Type: index.TypeDir, Mode: 0o755})
	}
	_, raw := buildExport(t, idx, Options{Time: time.Unix(testTime, 0), WritableSize: -1}, t.TempDir())
	fsck(t, raw)
	out, err := exec.Command("debugfs", "-R", "htree_dump /big", raw).CombinedOutput()
	must(t, err)
	if !strings.Contains(string(out), "Indirect levels: 1") {
		t.Errorf("htree_dump /big does not show two levels:\n%.1000s", out)
	}
	mnt := mountRO(t, raw)
	des, err := os.ReadDir(filepath.Join(mnt, "big"))
	must(t, err)
	if len(des) != n+200 {
		t.Fatalf("readdir: %d entries, want %d", len(des), n+200)
	}
	// Lookups go through the htree.
	for _, i := range []int{0, 1, 4242, 50000, 99999} {
		var st unix.Stat_t
		must(t, unix.Lstat(filepath.Join(mnt, "big", fmt.Sprintf("file-with-a-longish-name-%06d", i)), &st))
		if st.Mtim.Sec != int64(i) || st.Mtim.Nsec != int64(i) {
			t.Errorf("entry %d: mtime %v", i, st.Mtim)
		}
	}
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(mnt, "big"), &st))
	if st.Nlink != 202 {
		t.Errorf("big: nlink %d, want 202", st.Nlink)
	}
}

// TestManySubdirs checks dir_nlink: a directory with more than 65000
// subdirectories has link count 1.
func TestManySubdirs(t *testing.T) {
	if testing.Short() {
		t.Skip("builds 65 002 directories")
	}
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	idx := &index.Index{Entries: []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}, {Path: "p", Type: index.TypeDir, Mode: 0o755}}}
	for i := 0; i < 65001; i++ {
		idx.Entries = append(idx.Entries, index.Entry{Path: fmt.Sprintf("p/%d", i), Type: index.TypeDir, Mode: 0o755})
	}
	_, raw := buildExport(t, idx, Options{WritableSize: -1}, t.TempDir())
	fsck(t, raw)
	mnt := mountRO(t, raw)
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(mnt, "p"), &st))
	if st.Nlink != 1 {
		t.Errorf("nlink %d, want 1", st.Nlink)
	}
}

// TestBlockSize2048 builds the test tree with 2 KiB blocks.
func TestBlockSize2048(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	src := t.TempDir()
	makeTree(t, src, false)
	idx := indexDir(t, src)
	// 2 KiB xattr blocks cannot hold big2's attributes; drop one.
	for i := range idx.Entries {
		if e := &idx.Entries[i]; e.Path == "xattr/big2" {
			e.Xattrs = slices.DeleteFunc(e.Xattrs, func(x index.Xattr) bool { return x.Name == "user.more" })
		}
	}
	_, raw := buildExport(t, idx, Options{Time: time.Unix(testTime, 0), BlockSize: 2048}, t.TempDir())
	fsck(t, raw)
	mnt := mountRO(t, raw)
	compareTree(t, idx, src, mnt, 2048)
	if _, err := Build(context.Background(), idx, Options{BlockSize: 1024}); err == nil {
		t.Error("block size 1024 accepted")
	}
}

func TestDeterministic(t *testing.T) {
	src := t.TempDir()
	makeTree(t, src, false)
	idx := indexDir(t, src)
	var prev [][]byte
	for round := 0; round < 2; round++ {
		img, err := Build(context.Background(), idx, Options{Time: time.Unix(testTime, 5)})
		must(t, err)
		defer img.Close()
		dir := t.TempDir()
		must(t, img.WriteTo(dir))
		var cur [][]byte
		for _, f := range []string{MetaFile, MapFile, ManifestFile} {
			b, err := os.ReadFile(filepath.Join(dir, f))
			must(t, err)
			cur = append(cur, b)
		}
		if prev != nil {
			for k := range cur {
				if !bytes.Equal(cur[k], prev[k]) {
					t.Errorf("file %d differs between builds", k)
				}
			}
		}
		prev = cur
	}
}

func TestWriteToOpenExport(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "a", "f"), bytes.Repeat([]byte("data"), 3000), 0o644)
	idx := indexDir(t, src)
	img, raw1 := buildExport(t, idx, Options{}, t.TempDir())
	dir := t.TempDir()
	must(t, img.WriteTo(dir))
	img2, err := Open(dir)
	must(t, err)
	defer img2.Close()
	if fmt.Sprint(img2.Manifest) != fmt.Sprint(img.Manifest) {
		t.Errorf("manifest changed: %+v vs %+v", img2.Manifest, img.Manifest)
	}
	raw2 := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(raw2)
	must(t, err)
	must(t, Export(context.Background(), img2, dirOpener{}, f))
	must(t, f.Close())
	// Same holes, same bytes in between (hashing the sparse gigabyte of
	// free space would only read zeros).
	st1, err := os.Stat(raw1)
	must(t, err)
	segs1, err := segments(raw1, st1.Size())
	must(t, err)
	segs2, err := segments(raw2, st1.Size())
	must(t, err)
	if fmt.Sprint(segs1) != fmt.Sprint(segs2) || len(segs1) == 0 {
		t.Fatalf("exports have data at %v and %v", segs1, segs2)
	}
	for _, r := range segs1 {
		if !sameRange(t, raw1, raw2, r) {
			t.Fatalf("export of the reopened image differs in [%d,+%d)", r.Off, r.Len)
		}
	}
	fsck(t, raw2)
	// Free space is sparse: the file holds far fewer blocks than its size.
	var st unix.Stat_t
	must(t, unix.Stat(raw2, &st))
	if st.Blocks*512 > st.Size/10 {
		t.Errorf("export allocates %d of %d bytes", st.Blocks*512, st.Size)
	}
	// Rewriting the directory the image was opened from keeps it intact.
	must(t, img2.WriteTo(dir))
	img3, err := Open(dir)
	must(t, err)
	if img3.MetaSize() != img.MetaSize() {
		t.Errorf("rewritten metadata is %d bytes, want %d", img3.MetaSize(), img.MetaSize())
	}
	must(t, img3.Close())
	// A corrupt block map is refused.
	mp := filepath.Join(dir, MapFile)
	b, err := os.ReadFile(mp)
	must(t, err)
	b[len(b)/2] ^= 1
	must(t, os.WriteFile(mp, b, 0o644))
	if _, err := Open(dir); err == nil {
		t.Fatal("Open accepted a corrupt block map")
	}
}

func TestNoJournalAndSmallOptions(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), []byte("x"), 0o644)
	idx := indexDir(t, src)
	for _, o := range []Options{{NoJournal: true, WritableSize: -1}, {WritableSize: -1}, {JournalSize: 64 << 20, WritableSize: 3 << 30, VolumeName: "vol"}} {
		_, raw := buildExport(t, idx, o, t.TempDir())
		fsck(t, raw)
	}
}

func TestHostileIndex(t *testing.T) {
	root := index.Entry{Path: ".", Type: index.TypeDir, Mode: 0o755}
	reg := func(p string, size int64) index.Entry {
		return index.Entry{Path: p, Type: index.TypeRegular, Mode: 0o644, Size: size, Data: index.Data{Path: p}}
	}
	src := []index.Source{{Kind: index.SourceDir, ID: "/nonexistent"}}
	for name, c := range map[string]struct {
		ents []index.Entry
		path string
	}{
		"empty":            {nil, ""},
		"no root":          {[]index.Entry{reg("a", 1)}, ""},
		"duplicate":        {[]index.Entry{root, reg("a", 1), reg("a", 2)}, "a"},
		"missing parent":   {[]index.Entry{root, reg("x/y", 1)}, "x/y"},
		"parent not dir":   {[]index.Entry{root, reg("x", 1), reg("x/y", 1)}, "x/y"},
		"hardlink to dir":  {[]index.Entry{root, {Path: "d", Type: index.TypeDir}, {Path: "h", Type: index.TypeHardlink, Linkname: "d"}}, "h"},
		"dangling link":    {[]index.Entry{root, {Path: "h", Type: index.TypeHardlink, Linkname: "nope"}}, "h"},
		"parent is link":   {[]index.Entry{root, reg("a", 1), {Path: "h", Type: index.TypeHardlink, Linkname: "a"}, reg("h/x", 1)}, "h/x"},
		"link to link":     {[]index.Entry{root, reg("a", 1), {Path: "h", Type: index.TypeHardlink, Linkname: "a"}, {Path: "h2", Type: index.TypeHardlink, Linkname: "h"}}, "h2"},
		"negative size":    {[]index.Entry{root, reg("a", -1)}, "a"},
		"too big":          {[]index.Entry{root, reg("a", 1<<62)}, "a"},
		"bad segments":     {[]index.Entry{root, {Path: "a", Type: index.TypeRegular, Size: 10, Data: index.Data{Path: "a", Segments: []index.Range{{Off: 5, Len: 10}}}}}, "a"},
		"overlap segments": {[]index.Entry{root, {Path: "a", Type: index.TypeRegular, Size: 100, Data: index.Data{Path: "a", Segments: []index.Range{{Off: 5, Len: 10}, {Off: 8, Len: 1}}}}}, "a"},
		"bad source":       {[]index.Entry{root, {Path: "a", Type: index.TypeRegular, Size: 10, Data: index.Data{Source: 7, Path: "a"}}}, "a"},
		"dotdot":           {[]index.Entry{root, reg("../a", 1)}, "../a"},
		"absolute":         {[]index.Entry{root, reg("/a", 1)}, "/a"},
		"long name":        {[]index.Entry{root, reg(strings.Repeat("x", 256), 1)}, strings.Repeat("x", 256)},
		"bad type":         {[]index.Entry{root, {Path: "a", Type: 99}}, "a"},
		"empty symlink":    {[]index.Entry{root, {Path: "a", Type: index.TypeSymlink}}, "a"},
		"bad mode":         {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Mode: 0o170000}}, "a"},
		"reserved ino":     {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Ino: 5}}, "a"},
		"duplicate ino":    {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Ino: 20}, {Path: "b", Type: index.TypeFifo, Ino: 20}}, "b"},
		"huge ino":         {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Ino: 4000000000}}, "a"},
		"bad xattr":        {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Xattrs: []index.Xattr{{Name: "bogus.x", Value: []byte("v")}}}}, "a"},
		"xattr too big":    {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Xattrs: []index.Xattr{{Name: "user.x", Value: make([]byte, 5000)}}}}, "a"},
		"bad acl":          {[]index.Entry{root, {Path: "a", Type: index.TypeFifo, Xattrs: []index.Xattr{{Name: "system.posix_acl_access", Value: []byte{1, 2, 3}}}}}, "a"},
	} {
		_, err := Build(context.Background(), &index.Index{Sources: src, Entries: c.ents}, Options{})
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if c.path != "" && !strings.Contains(err.Error(), fmt.Sprintf("%q", c.path)) {
			t.Errorf("%s: error %q does not name %q", name, err, c.path)
		}
	}
	// Legal files whose sum overflows the largest filesystem.
	ents := []index.Entry{root}
	for i := 0; i < 12; i++ {
		ents = append(ents, index.Entry{Path: fmt.Sprintf("f%d", i), Type: index.TypeRegular, Size: 15 << 40, Data: index.Data{Path: "x"}})
	}
	if _, err := Build(context.Background(), &index.Index{Sources: src, Entries: ents}, Options{}); err == nil || !strings.Contains(err.Error(), `"f`) {
		t.Errorf("180 TiB of files: %v, want an error naming a file", err)
	}
	if _, err := Build(context.Background(), nil, Options{}); err == nil {
		t.Error("nil index accepted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Build(ctx, &index.Index{Entries: []index.Entry{root}}, Options{}); err == nil {
		t.Error("cancelled context ignored")
	}
}

// TestExplicitInodes honours Entry.Ino.
func TestExplicitInodes(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	idx := &index.Index{Entries: []index.Entry{
		{Path: ".", Type: index.TypeDir, Mode: 0o755, Ino: 2},
		{Path: "a", Type: index.TypeDir, Mode: 0o755, Ino: 5000},
		{Path: "a/f", Type: index.TypeFifo, Mode: 0o644},
		{Path: "b", Type: index.TypeSocket, Mode: 0o644, Ino: 12},
		{Path: "lost+found", Type: index.TypeDir, Mode: 0o700},
	}}
	_, raw := buildExport(t, idx, Options{WritableSize: -1}, t.TempDir())
	fsck(t, raw)
	mnt := mountRO(t, raw)
	for p, want := range map[string]uint64{"a": 5000, "b": 12, "lost+found": 11, "a/f": 13} {
		var st unix.Stat_t
		must(t, unix.Lstat(filepath.Join(mnt, p), &st))
		if st.Ino != want {
			t.Errorf("%s: ino %d, want %d", p, st.Ino, want)
		}
	}
}
