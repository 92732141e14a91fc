package index

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestComparePathsOrder(t *testing.T) {
	paths := []string{"a-b", "a/x", ".", "a", "a/x/y", "ab", "a\x01", "b", "a/x-y", "a!"}
	slices.SortFunc(paths, ComparePaths)
	want := []string{".", "a", "a/x", "a/x/y", "a/x-y", "a\x01", "a!", "a-b", "ab", "b"}
	if !reflect.DeepEqual(paths, want) {
		t.Fatalf("order %q, want %q", paths, want)
	}
}

// lxattrs reads a path's xattrs the plain path-based way, sorted.
func lxattrs(t testing.TB, p string) []Xattr {
	t.Helper()
	sz, err := unix.Llistxattr(p, nil)
	must(t, err)
	if sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	must(t, err)
	var out []Xattr
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		vs, err := unix.Lgetxattr(p, name, nil)
		must(t, err)
		v := make([]byte, vs)
		vs, err = unix.Lgetxattr(p, name, v)
		must(t, err)
		out = append(out, Xattr{Name: name, Value: v[:vs]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func ts(t unix.Timespec) Timespec { return Timespec{Sec: t.Sec, Nsec: uint32(t.Nsec)} }

func typeOf(mode uint32) Type {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return TypeDir
	case unix.S_IFREG:
		return TypeRegular
	case unix.S_IFLNK:
		return TypeSymlink
	case unix.S_IFCHR:
		return TypeChar
	case unix.S_IFBLK:
		return TypeBlock
	case unix.S_IFIFO:
		return TypeFifo
	case unix.S_IFSOCK:
		return TypeSocket
	}
	return 0
}

// checkAgainstHost compares every entry of ix with lstat/lgetxattr/readlink
// of root, then the set of paths with an independent walk, then the file
// contents through HostOpener (reading last, since it moves atimes).
func checkAgainstHost(t *testing.T, ix *Index, root string) {
	t.Helper()
	must(t, ix.Validate())
	groups := map[[2]uint64]string{}
	for i := range ix.Entries {
		e := &ix.Entries[i]
		p := filepath.Join(root, e.Path)
		var st unix.Stat_t
		must(t, unix.Lstat(p, &st))
		want := typeOf(st.Mode)
		if want != TypeDir && st.Nlink > 1 {
			k := [2]uint64{st.Dev, st.Ino}
			if first, ok := groups[k]; ok {
				if e.Type != TypeHardlink || e.Linkname != first {
					t.Errorf("%.100q: type %s link %q, want hard link to %q", e.Path, e.Type, e.Linkname, first)
				}
				want = TypeHardlink
			} else {
				groups[k] = e.Path
			}
		}
		if e.Type != want {
			t.Errorf("%.100q: type %s, want %s", e.Path, e.Type, want)
			continue
		}
		if e.Mode != st.Mode&07777 || e.UID != st.Uid || e.GID != st.Gid {
			t.Errorf("%.100q: mode/uid/gid %o/%d/%d, want %o/%d/%d", e.Path, e.Mode, e.UID, e.GID, st.Mode&07777, st.Uid, st.Gid)
		}
		if e.Atime != ts(st.Atim) || e.Mtime != ts(st.Mtim) || e.Ctime != ts(st.Ctim) {
			t.Errorf("%.100q: times %v %v %v, want %v %v %v", e.Path, e.Atime, e.Mtime, e.Ctime, ts(st.Atim), ts(st.Mtim), ts(st.Ctim))
		}
		if x := lxattrs(t, p); !xattrsEqual(e.Xattrs, x) {
			t.Errorf("%.100q: xattrs %v, want %v", e.Path, e.Xattrs, x)
		}
		switch e.Type {
		case TypeRegular:
			if e.Size != st.Size || e.Data.Path != e.Path || e.Data.Source != 0 {
				t.Errorf("%.100q: size %d data %+v, want size %d", e.Path, e.Size, e.Data, st.Size)
			}
		case TypeSymlink:
			l, err := os.Readlink(p)
			must(t, err)
			if e.Linkname != l {
				t.Errorf("%.100q: target %q, want %q", e.Path, e.Linkname, l)
			}
		case TypeChar, TypeBlock:
			if e.Devmajor != unix.Major(st.Rdev) || e.Devminor != unix.Minor(st.Rdev) {
				t.Errorf("%.100q: device %d:%d, want %d:%d", e.Path, e.Devmajor, e.Devminor, unix.Major(st.Rdev), unix.Minor(st.Rdev))
			}
		}
	}
	// Same set of names as an independent walk.
	var walked []string
	must(t, filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
		r, _ := filepath.Rel(root, p)
		walked = append(walked, r)
		return err
	}))
	var got []string
	for _, e := range ix.Entries {
		got = append(got, e.Path)
	}
	sort.Strings(walked)
	sort.Strings(got)
	if !reflect.DeepEqual(walked, got) {
		t.Errorf("index has %d paths, walk found %d", len(got), len(walked))
	}
	checkContents(t, ix, HostOpener{}, func(p string) ([]byte, error) { return readNoAtime(filepath.Join(root, p)) })
}

// readNoAtime reads a file without updating its atime (which would make
// the kernel write back thousands of inodes during the test).
func readNoAtime(p string) ([]byte, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOATIME, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

func xattrsEqual(a, b []Xattr) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Name != b[i].Name || !bytes.Equal(a[i].Value, b[i].Value) {
			return false
		}
	}
	return true
}

// readEntry reads a regular entry's bytes through an Opener.
func readEntry(t testing.TB, ix *Index, op Opener, e *Entry) []byte {
	t.Helper()
	src := ix.Sources[e.Data.Source]
	r, err := op.Open(src, e.Data.Path)
	if err != nil {
		t.Fatalf("%.100q: open: %v", e.Path, err)
	}
	if c, ok := r.(io.Closer); ok {
		defer c.Close()
	}
	b := make([]byte, e.Size)
	if _, err := r.ReadAt(b, e.Data.Offset); err != nil && !(err == io.EOF && e.Size == 0) {
		t.Fatalf("%.100q: read: %v", e.Path, err)
	}
	return b
}

func checkContents(t *testing.T, ix *Index, op Opener, want func(p string) ([]byte, error)) {
	t.Helper()
	for i := range ix.Entries {
		e := &ix.Entries[i]
		if e.Type != TypeRegular {
			continue
		}
		w, err := want(e.Path)
		must(t, err)
		if got := readEntry(t, ix, op, e); !bytes.Equal(got, w) {
			t.Errorf("%.100q: content differs (%d vs %d bytes)", e.Path, len(got), len(w))
		}
	}
}

func TestFromDirGenerated(t *testing.T) {
	root := t.TempDir()
	gen := genTree(t, root, 1, genOptions{hugeDir: 25000, random: 3000, deep: 1000, specials: true})
	var st Stats
	ix, err := FromDir(context.Background(), root, Options{Stats: &st})
	must(t, err)
	if st.Entries != len(ix.Entries) || len(ix.Entries) < 29000 {
		t.Fatalf("stats %+v for %d entries", st, len(ix.Entries))
	}
	abs, _ := filepath.Abs(root)
	if !reflect.DeepEqual(ix.Sources, []Source{{Kind: SourceDir, ID: abs}}) {
		t.Fatalf("sources %+v", ix.Sources)
	}
	for name, segs := range gen.sparse {
		e := &ix.Entries[ix.Lookup(name)]
		if !reflect.DeepEqual(e.Data.Segments, segs) {
			t.Errorf("%s: segments %v, want %v", name, e.Data.Segments, segs)
		}
	}
	for _, name := range []string{"one", "empty", "a/x"} {
		if s := ix.Entries[ix.Lookup(name)].Data.Segments; s != nil {
			t.Errorf("%s: segments %v for a dense file", name, s)
		}
	}
	for _, name := range gen.caps {
		if v, ok := XattrValue(ix.Entries[ix.Lookup(name)].Xattrs, "security.capability"); !ok || !bytes.Equal(v, vfsCapV2) {
			t.Errorf("%s: security.capability %x", name, v)
		}
	}
	if len(gen.caps) == 0 {
		t.Log("security.capability could not be set on this host; not checked")
	}
	// The subtree of "a" directly follows it, before "a!b" and "a-b".
	i := ix.Lookup("a")
	if !strings.HasPrefix(ix.Entries[i+1].Path, "a/") {
		t.Errorf("after %q comes %q", "a", ix.Entries[i+1].Path)
	}
	// Deterministic: a second walk gives the same index, and it survives
	// an encode/decode round trip.
	ix2, err := FromDir(context.Background(), root, Options{})
	must(t, err)
	// readlink moves a symlink's atime when relatime says so (here: mtimes
	// in the future), so only those may differ between walks.
	cmp := &Index{Sources: ix2.Sources, Entries: slices.Clone(ix2.Entries)}
	for i := range cmp.Entries {
		if cmp.Entries[i].Type == TypeSymlink && i < len(ix.Entries) {
			cmp.Entries[i].Atime = ix.Entries[i].Atime
		}
	}
	if !reflect.DeepEqual(ix, cmp) {
		for i := range ix.Entries {
			if !reflect.DeepEqual(ix.Entries[i], cmp.Entries[i]) {
				t.Fatalf("second walk differs at %d: %.200v vs %.200v", i, ix.Entries[i], cmp.Entries[i])
			}
		}
		t.Fatal("second walk differs")
	}
	var buf bytes.Buffer
	must(t, Encode(&buf, ix))
	dec, err := Decode(&buf)
	must(t, err)
	if !reflect.DeepEqual(normalize(ix), normalize(dec)) {
		t.Fatal("decode(encode(ix)) differs")
	}
	checkAgainstHost(t, ix2, root)
}

// normalize makes nil and empty xattr values compare equal.
func normalize(ix *Index) *Index {
	out := *ix
	out.Entries = slices.Clone(ix.Entries)
	for i := range out.Entries {
		xs := slices.Clone(out.Entries[i].Xattrs)
		for j := range xs {
			if xs[j].Value == nil {
				xs[j].Value = []byte{}
			}
		}
		out.Entries[i].Xattrs = xs
	}
	return &out
}

func TestFromDirLimitsAndSymlinkRoot(t *testing.T) {
	root := t.TempDir()
	for i := range 10 {
		writeFile(t, filepath.Join(root, string(rune('a'+i))), nil, 0o644)
	}
	_, err := FromDir(context.Background(), root, Options{MaxEntries: 5})
	if err == nil || !strings.Contains(err.Error(), "more than 5 entries") {
		t.Fatalf("entry limit: %v", err)
	}
	// A symlink as the root is refused rather than followed.
	link := filepath.Join(t.TempDir(), "l")
	must(t, os.Symlink(root, link))
	if _, err := FromDir(context.Background(), link, Options{}); err == nil {
		t.Fatal("indexed through a symlinked root")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := FromDir(ctx, root, Options{}); err == nil {
		t.Fatal("cancelled context not honoured")
	}
}

func TestHostOpenerRefusesSymlinks(t *testing.T) {
	root := t.TempDir()
	must(t, os.Mkdir(filepath.Join(root, "d"), 0o755))
	writeFile(t, filepath.Join(root, "d", "f"), []byte("ok"), 0o644)
	must(t, os.Symlink("d", filepath.Join(root, "dl")))
	must(t, os.Symlink("d/f", filepath.Join(root, "fl")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(root, "esc")))
	src := Source{Kind: SourceDir, ID: root}
	op := HostOpener{}
	r, err := op.Open(src, "d/f")
	must(t, err)
	r.(io.Closer).Close()
	for _, p := range []string{"dl/f", "fl", "esc", "../etc/passwd", "/etc/passwd", "d", "d/../d/f"} {
		if r, err := op.Open(src, p); err == nil {
			r.(io.Closer).Close()
			t.Errorf("opened %q", p)
		}
	}
	// The fallback walk for kernels without openat2 behaves the same.
	dfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	defer unix.Close(dfd)
	f, err := openWalk(dfd, "d/f")
	must(t, err)
	f.Close()
	for _, p := range []string{"dl/f", "fl", "esc", "../x", "d/./f"} {
		if f, err := openWalk(dfd, p); err == nil {
			f.Close()
			t.Errorf("walk opened %q", p)
		}
	}
	if _, err := op.Open(Source{Kind: SourceBlob, ID: "sha256:../../etc"}, ""); err == nil {
		t.Error("opened a blob by a bad digest")
	}
}
