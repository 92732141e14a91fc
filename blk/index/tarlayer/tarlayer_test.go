package tarlayer

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
)

// paxRecords formats PAX extended header records.
func paxRecords(kv ...string) string {
	var b strings.Builder
	for i := 0; i < len(kv); i += 2 {
		r := " " + kv[i] + "=" + kv[i+1] + "\n"
		n := len(r) + 1
		for len(strconv.Itoa(n))+len(r) != n {
			n++
		}
		b.WriteString(strconv.Itoa(n) + r)
	}
	return b.String()
}

// patchHeader rewrites field [off, off+len(val)) of the first tar header
// and fixes its checksum, to build archives tar.Writer refuses to write.
func patchHeader(b []byte, off int, val []byte) []byte {
	b = bytes.Clone(b)
	copy(b[off:], val)
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b[:512] {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// mergeTars reads tar layers with the package's reader and merges them
// like oci.FromOCI, without the blob cache.
func mergeTars(t testing.TB, tars ...[]byte) (*index.Index, error) {
	t.Helper()
	var idx []*index.Index
	var names []string
	for i, b := range tars {
		src := index.Source{Kind: index.SourceBlob, ID: indextest.DigestOf(b)}
		ix, err := Read(context.Background(), bytes.NewReader(b), src, 1000, strconv.Itoa(i))
		if err != nil {
			return nil, err
		}
		if err := ix.ValidateLayer(); err != nil {
			t.Fatalf("layer %d index invalid: %v", i, err)
		}
		idx = append(idx, ix)
		names = append(names, strconv.Itoa(i))
	}
	ix, err := overlayfs.Merge(context.Background(), idx, names, 1000)
	if err == nil {
		if verr := ix.Validate(); verr != nil {
			t.Fatalf("merged index invalid: %v", verr)
		}
	}
	return ix, err
}

func TestTarHostile(t *testing.T) {
	long := strings.Repeat("n", 256)
	deep := strings.Repeat(strings.Repeat("p", 200)+"/", 21) + "f"
	file := indextest.BuildTar(t, []indextest.TarEnt{{Name: "f", Body: ""}})
	cases := []struct {
		name string
		tar  []byte
		want string
	}{
		{"dotdot", indextest.BuildTar(t, []indextest.TarEnt{{Name: "../escape", Body: "x"}}), `"../escape": ` + "invalid image index: \"..\" component"},
		{"dotdot-inner", indextest.BuildTar(t, []indextest.TarEnt{{Name: "a/../../b", Body: "x"}}), `".." component`},
		{"absolute", indextest.BuildTar(t, []indextest.TarEnt{{Name: "/etc/passwd", Body: "x"}}), "absolute path"},
		{"long-name", indextest.BuildTar(t, []indextest.TarEnt{{Name: "d/" + long, Body: "x"}}), "name component of 256 bytes"},
		{"long-path", indextest.BuildTar(t, []indextest.TarEnt{{Name: deep, Body: "x"}}), "path of 4222 bytes exceeds 4096"},
		{"link-missing", indextest.BuildTar(t, []indextest.TarEnt{{Name: "l", Typ: tar.TypeLink, Link: "missing"}}), `hard link target "missing" missing`},
		{"link-dir", indextest.BuildTar(t, []indextest.TarEnt{{Name: "d/", Typ: tar.TypeDir}, {Name: "l", Typ: tar.TypeLink, Link: "d"}}), "is a directory"},
		{"link-lower-dir", indextest.BuildTar(t, []indextest.TarEnt{{Name: "d/", Typ: tar.TypeDir}, {Name: "d/l", Typ: tar.TypeLink, Link: "d"}}), "is a directory"},
		{"link-outside", indextest.BuildTar(t, []indextest.TarEnt{{Name: "l", Typ: tar.TypeLink, Link: "../../etc/passwd"}}), "outside the tree"},
		{"link-absolute", indextest.BuildTar(t, []indextest.TarEnt{{Name: "l", Typ: tar.TypeLink, Link: "/etc/passwd"}}), "outside the tree"},
		{"link-whited-out", indextest.BuildTar(t, []indextest.TarEnt{{Name: ".wh.f"}, {Name: "l", Typ: tar.TypeLink, Link: "f"}}), "removed by a whiteout"},
		{"major", indextest.BuildTar(t, []indextest.TarEnt{{Name: "c", Typ: tar.TypeChar, Major: 4096, Minor: 0}}), "device 4096:0 out of range"},
		{"minor", indextest.BuildTar(t, []indextest.TarEnt{{Name: "c", Typ: tar.TypeBlock, Major: 8, Minor: 1 << 20}}), "device 8:1048576 out of range"},
		{"major-64bit", indextest.BuildTar(t, []indextest.TarEnt{{Name: "c", Typ: tar.TypeChar, Major: 1 << 33, Format: tar.FormatGNU}}), "out of range"},
		{"major-negative", patchHeader(indextest.BuildTar(t, []indextest.TarEnt{{Name: "c", Typ: tar.TypeChar}}), 329, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), "negative device number"},
		{"size-negative", patchHeader(file, 124, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), "invalid tar header"},
		{"symlink-long", indextest.BuildTar(t, []indextest.TarEnt{{Name: "s", Typ: tar.TypeSymlink, Link: strings.Repeat("x", 4096)}}), "symlink target of 4096 bytes (max 4095)"},
		{"too-many", indextest.BuildTar(t, func() []indextest.TarEnt {
			var es []indextest.TarEnt
			for i := range 1001 {
				es = append(es, indextest.TarEnt{Name: fmt.Sprintf("f%d", i)})
			}
			return es
		}()), "more than 1000 entries"},
		{"below-symlink", indextest.BuildTar(t, []indextest.TarEnt{{Name: "s", Typ: tar.TypeSymlink, Link: "/etc"}, {Name: "s/passwd", Body: "x"}}), `parent "s" is not a directory`},
		{"below-file", indextest.BuildTar(t, []indextest.TarEnt{{Name: "f", Body: "x"}, {Name: "f/g", Body: "y"}}), `parent "f" is not a directory`},
		{"sparse-gnu", patchHeader(indextest.BuildTar(t, []indextest.TarEnt{{Name: "sp", Body: "x", Format: tar.FormatGNU}}), 156, []byte{'S'}), "sparse"},
		{"sparse-pax", patchHeader(indextest.BuildTar(t, []indextest.TarEnt{{Name: "pax", Body: paxRecords("GNU.sparse.major", "1", "GNU.sparse.minor", "0", "GNU.sparse.name", "sp", "GNU.sparse.realsize", "10")}, {Name: "sp", Body: "1\n0\n1\n" + strings.Repeat("\x00", 506) + "x"}}), 156, []byte{'x'}), "sparse"},
		{"root-not-dir", indextest.BuildTar(t, []indextest.TarEnt{{Name: ".", Body: "x"}}), "root entry is a regular"},
		{"whiteout-empty", indextest.BuildTar(t, []indextest.TarEnt{{Name: "a/.wh."}}), `whiteout of ""`},
		{"whiteout-dotdot", indextest.BuildTar(t, []indextest.TarEnt{{Name: "a/.wh..."}}), `whiteout of ".."`},
		{"garbage", []byte(strings.Repeat("garbage!", 200)), "read tar"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := mergeTars(t, c.tar)
			if err == nil {
				t.Fatalf("accepted")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not mention %q", err, c.want)
			}
			if !strings.HasPrefix(err.Error(), "layer 0") {
				t.Fatalf("error %q does not name the layer", err)
			}
		})
	}
}

func TestTarLayerSemantics(t *testing.T) {
	l1 := indextest.BuildTar(t, []indextest.TarEnt{
		{Name: "a/", Typ: tar.TypeDir, Mode: 0o700},
		{Name: "a/f", Body: "af"},
		{Name: "b/", Typ: tar.TypeDir, Mode: 0o711},
		{Name: "b/old", Body: "old"},
		{Name: "c/", Typ: tar.TypeDir, Mode: 0o750},
		{Name: "c/old", Body: "old"},
		{Name: "x", Body: "x-v1"},
		{Name: "f", Body: "f-v1"},
		{Name: "o/", Typ: tar.TypeDir, Pax: map[string]string{"SCHILY.xattr.user.k": "v"}},
		{Name: "o/keep", Body: "k"},
	})
	l2 := indextest.BuildTar(t, []indextest.TarEnt{
		{Name: "a/g", Body: "ag"},                   // implicit parent keeps lower metadata
		{Name: "b/.wh..wh..opq"},                    // opaque on an implicit directory
		{Name: "b/new", Body: "new"},                //
		{Name: ".wh.c"},                             // whiteout, then implied again:
		{Name: "c/z", Body: "z"},                    // a fresh default directory
		{Name: "l", Typ: tar.TypeLink, Link: "x"},   // link into the lower layer...
		{Name: "x", Body: "x-v2"},                   // ...then x replaced: l keeps v1
		{Name: "zz", Body: "zz"},                    // in-layer link group whose
		{Name: "aa", Typ: tar.TypeLink, Link: "zz"}, // first name sorts last
		{Name: ".wh.f"}, {Name: "f", Body: "f-v2"},  // whiteout plus entry: entry stays
		{Name: "dup", Body: "first"}, {Name: "dup", Body: "second"},
		{Name: "r", Body: "file"}, {Name: "r/", Typ: tar.TypeDir}, {Name: "r/in", Body: "in"},
		{Name: ".wh..wh.plnk"},
		{Name: "o/", Typ: tar.TypeDir, Pax: map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}},
		{Name: "./", Typ: tar.TypeDir, Mode: 0o700},
	})
	longName := strings.Repeat("g", 150) + "/" + strings.Repeat("h", 200)
	l3 := indextest.BuildTar(t, []indextest.TarEnt{
		{Name: longName, Body: "gnu-long", Format: tar.FormatGNU},
		{Name: "paxfile", Body: "pax-data", Pax: map[string]string{"SCHILY.xattr.user.big": strings.Repeat("v", 3000)}},
		{Name: "lf", Typ: tar.TypeLink, Link: "l"}, // joins l's (lower) inode
		{Name: ".wh.l"}, // then l goes: lf carries the data
	})
	ix, err := mergeTars(t, l1, l2, l3)
	indextest.Must(t, err)
	want := []string{".", "a", "a/f", "a/g", "aa", "b", "b/new", "c", "c/z", "dup", "f", strings.Repeat("g", 150), longName, "lf", "o", "o/keep", "paxfile", "r", "r/in", "x", "zz"}
	if got := indextest.Paths(ix); !reflect.DeepEqual(got, want) {
		t.Fatalf("paths %q\nwant  %q", got, want)
	}
	if e := indextest.Lookup(t, ix, "."); e.Mode != 0o700 {
		t.Errorf("root mode %o", e.Mode)
	}
	if e := indextest.Lookup(t, ix, "a"); e.Mode != 0o700 || e.Mtime.Sec != 1700000000 {
		t.Errorf("implicit a lost lower metadata: %+v", e)
	}
	if e := indextest.Lookup(t, ix, "b"); e.Mode != 0o711 {
		t.Errorf("opaque implicit b mode %o", e.Mode)
	}
	if e := indextest.Lookup(t, ix, "c"); e.Mode != 0o755 || e.Mtime.Sec != 0 {
		t.Errorf("re-created c: %+v", e)
	}
	if e := indextest.Lookup(t, ix, "o"); len(e.Xattrs) != 0 {
		t.Errorf("o xattrs %v (upper dir has none; image overlay xattrs must be dropped)", e.Xattrs)
	}
	read := func(p string) string {
		e := indextest.Lookup(t, ix, p)
		if e.Type != index.TypeRegular {
			t.Fatalf("%q is a %s", p, e.Type)
		}
		layer := [][]byte{l1, l2, l3}[e.Data.Source]
		return string(layer[e.Data.Offset : e.Data.Offset+e.Size])
	}
	for p, w := range map[string]string{longName: "gnu-long", "paxfile": "pax-data", "lf": "x-v1", "x": "x-v2", "aa": "zz", "f": "f-v2", "dup": "second", "r/in": "in", "a/f": "af"} {
		if got := read(p); got != w {
			t.Errorf("%q = %q, want %q", p, got, w)
		}
	}
	if e := indextest.Lookup(t, ix, "zz"); e.Type != index.TypeHardlink || e.Linkname != "aa" {
		t.Errorf("zz: %+v", e)
	}
}

// TestEntriesBudgetNamed reads the amplification layer's shape (empty
// directories) under a small entries budget: the error names the budget.
func TestEntriesBudgetNamed(t *testing.T) {
	var buf bytes.Buffer
	indextest.Must(t, indextest.EmptyDirsTar(&buf, 100))
	src := index.Source{Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("0", 64)}
	_, err := Read(context.Background(), bytes.NewReader(buf.Bytes()), src, 50, "dirs")
	if err == nil || !strings.Contains(err.Error(), "max_entries") || !strings.Contains(err.Error(), "layer dirs") {
		t.Fatalf("100 directories under a budget of 50: %v; want an error naming max_entries and the layer", err)
	}
}
