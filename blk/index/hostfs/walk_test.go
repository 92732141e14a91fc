package hostfs

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

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"golang.org/x/sys/unix"
)

func ts(t unix.Timespec) index.Timespec { return index.Timespec{Sec: t.Sec, Nsec: uint32(t.Nsec)} }

func typeOf(mode uint32) index.Type {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return index.TypeDir
	case unix.S_IFREG:
		return index.TypeRegular
	case unix.S_IFLNK:
		return index.TypeSymlink
	case unix.S_IFCHR:
		return index.TypeChar
	case unix.S_IFBLK:
		return index.TypeBlock
	case unix.S_IFIFO:
		return index.TypeFifo
	case unix.S_IFSOCK:
		return index.TypeSocket
	}
	return 0
}

// checkAgainstHost compares every entry of ix with lstat/lgetxattr/readlink
// of root, then the set of paths with an independent walk, then the file
// contents through Opener (reading last, since it moves atimes).
func checkAgainstHost(t *testing.T, ix *index.Index, root string) {
	t.Helper()
	indextest.Must(t, ix.Validate())
	groups := map[[2]uint64]string{}
	for i := range ix.Entries {
		e := &ix.Entries[i]
		p := filepath.Join(root, e.Path)
		var st unix.Stat_t
		indextest.Must(t, unix.Lstat(p, &st))
		want := typeOf(st.Mode)
		if want != index.TypeDir && st.Nlink > 1 {
			k := [2]uint64{st.Dev, st.Ino}
			if first, ok := groups[k]; ok {
				if e.Type != index.TypeHardlink || e.Linkname != first {
					t.Errorf("%.100q: type %s link %q, want hard link to %q", e.Path, e.Type, e.Linkname, first)
				}
				want = index.TypeHardlink
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
		if x := indextest.Lxattrs(t, p); !xattrsEqual(e.Xattrs, x) {
			t.Errorf("%.100q: xattrs %v, want %v", e.Path, e.Xattrs, x)
		}
		switch e.Type {
		case index.TypeRegular:
			if e.Size != st.Size || e.Data.Path != e.Path || e.Data.Source != 0 {
				t.Errorf("%.100q: size %d data %+v, want size %d", e.Path, e.Size, e.Data, st.Size)
			}
		case index.TypeSymlink:
			l, err := os.Readlink(p)
			indextest.Must(t, err)
			if e.Linkname != l {
				t.Errorf("%.100q: target %q, want %q", e.Path, e.Linkname, l)
			}
		case index.TypeChar, index.TypeBlock:
			if e.Devmajor != unix.Major(st.Rdev) || e.Devminor != unix.Minor(st.Rdev) {
				t.Errorf("%.100q: device %d:%d, want %d:%d", e.Path, e.Devmajor, e.Devminor, unix.Major(st.Rdev), unix.Minor(st.Rdev))
			}
		}
	}
	// Same set of names as an independent walk.
	var walked []string
	indextest.Must(t, filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
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
	indextest.CheckContents(t, ix, Opener{}, func(p string) ([]byte, error) { return readNoAtime(filepath.Join(root, p)) })
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

func xattrsEqual(a, b []index.Xattr) bool {
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

func TestFromDirGenerated(t *testing.T) {
	root := t.TempDir()
	gen := indextest.GenTree(t, root, 1, indextest.GenOptions{HugeDir: 25000, Random: 3000, Deep: 1000, Specials: true})
	var st index.Stats
	ix, err := FromDir(context.Background(), root, index.Options{Stats: &st})
	indextest.Must(t, err)
	if st.Entries != len(ix.Entries) || len(ix.Entries) < 29000 {
		t.Fatalf("stats %+v for %d entries", st, len(ix.Entries))
	}
	abs, _ := filepath.Abs(root)
	if !reflect.DeepEqual(ix.Sources, []index.Source{{Kind: index.SourceDir, ID: abs}}) {
		t.Fatalf("sources %+v", ix.Sources)
	}
	for name, segs := range gen.Sparse {
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
	for _, name := range gen.Caps {
		if v, ok := index.XattrValue(ix.Entries[ix.Lookup(name)].Xattrs, "security.capability"); !ok || !bytes.Equal(v, indextest.VfsCapV2) {
			t.Errorf("%s: security.capability %x", name, v)
		}
	}
	if len(gen.Caps) == 0 {
		t.Log("security.capability could not be set on this host; not checked")
	}
	// The subtree of "a" directly follows it, before "a!b" and "a-b".
	i := ix.Lookup("a")
	if !strings.HasPrefix(ix.Entries[i+1].Path, "a/") {
		t.Errorf("after %q comes %q", "a", ix.Entries[i+1].Path)
	}
	// Deterministic: a second walk gives the same index, and it survives
	// an encode/decode round trip.
	ix2, err := FromDir(context.Background(), root, index.Options{})
	indextest.Must(t, err)
	// readlink moves a symlink's atime when relatime says so (here: mtimes
	// in the future), so only those may differ between walks.
	cmp := &index.Index{Sources: ix2.Sources, Entries: slices.Clone(ix2.Entries)}
	for i := range cmp.Entries {
		if cmp.Entries[i].Type == index.TypeSymlink && i < len(ix.Entries) {
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
	indextest.Must(t, index.Encode(&buf, ix))
	dec, err := index.Decode(&buf)
	indextest.Must(t, err)
	if !reflect.DeepEqual(indextest.Normalize(ix), indextest.Normalize(dec)) {
		t.Fatal("decode(encode(ix)) differs")
	}
	checkAgainstHost(t, ix2, root)
}

func TestFromDirLimitsAndSymlinkRoot(t *testing.T) {
	root := t.TempDir()
	for i := range 10 {
		indextest.WriteFile(t, filepath.Join(root, string(rune('a'+i))), nil, 0o644)
	}
	_, err := FromDir(context.Background(), root, index.Options{MaxEntries: 5})
	if err == nil || !strings.Contains(err.Error(), "more than 5 entries") {
		t.Fatalf("entry limit: %v", err)
	}
	// A symlink as the root is refused rather than followed.
	link := filepath.Join(t.TempDir(), "l")
	indextest.Must(t, os.Symlink(root, link))
	if _, err := FromDir(context.Background(), link, index.Options{}); err == nil {
		t.Fatal("indexed through a symlinked root")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := FromDir(ctx, root, index.Options{}); err == nil {
		t.Fatal("cancelled context not honoured")
	}
}
