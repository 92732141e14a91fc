package index

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// tarEnt is one entry of a test tar; typ 0 means a regular file.
type tarEnt struct {
	name, body, link string
	typ              byte
	mode             int64
	major, minor     int64
	pax              map[string]string
	format           tar.Format
}

func buildTar(t testing.TB, ents []tarEnt) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: e.mode,
			Devmajor: e.major, Devminor: e.minor, PAXRecords: e.pax, Format: e.format,
			ModTime: time.Unix(1700000000, 0)}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatalf("write %q: %v", e.name, err)
		}
		if _, err := tw.Write([]byte(e.body)); err != nil {
			t.Fatal(err)
		}
	}
	must(t, tw.Close())
	return buf.Bytes()
}

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
// like FromOCI, without the blob cache.
func mergeTars(t testing.TB, tars ...[]byte) (*Index, error) {
	t.Helper()
	var idx []*Index
	var names []string
	for i, b := range tars {
		src := Source{Kind: SourceBlob, ID: digestOf(b)}
		ix, err := readTarLayer(context.Background(), bytes.NewReader(b), src, 1000, strconv.Itoa(i))
		if err != nil {
			return nil, err
		}
		if err := ix.ValidateLayer(); err != nil {
			t.Fatalf("layer %d index invalid: %v", i, err)
		}
		idx = append(idx, ix)
		names = append(names, strconv.Itoa(i))
	}
	ix, err := merge(context.Background(), idx, names, 1000)
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
	file := buildTar(t, []tarEnt{{name: "f", body: ""}})
	cases := []struct {
		name string
		tar  []byte
		want string
	}{
		{"dotdot", buildTar(t, []tarEnt{{name: "../escape", body: "x"}}), `"../escape": ` + "invalid image index: \"..\" component"},
		{"dotdot-inner", buildTar(t, []tarEnt{{name: "a/../../b", body: "x"}}), `".." component`},
		{"absolute", buildTar(t, []tarEnt{{name: "/etc/passwd", body: "x"}}), "absolute path"},
		{"long-name", buildTar(t, []tarEnt{{name: "d/" + long, body: "x"}}), "name component of 256 bytes"},
		{"long-path", buildTar(t, []tarEnt{{name: deep, body: "x"}}), "path of 4222 bytes exceeds 4096"},
		{"link-missing", buildTar(t, []tarEnt{{name: "l", typ: tar.TypeLink, link: "missing"}}), `hard link target "missing" missing`},
		{"link-dir", buildTar(t, []tarEnt{{name: "d/", typ: tar.TypeDir}, {name: "l", typ: tar.TypeLink, link: "d"}}), "is a directory"},
		{"link-lower-dir", buildTar(t, []tarEnt{{name: "d/", typ: tar.TypeDir}, {name: "d/l", typ: tar.TypeLink, link: "d"}}), "is a directory"},
		{"link-outside", buildTar(t, []tarEnt{{name: "l", typ: tar.TypeLink, link: "../../etc/passwd"}}), "outside the tree"},
		{"link-absolute", buildTar(t, []tarEnt{{name: "l", typ: tar.TypeLink, link: "/etc/passwd"}}), "outside the tree"},
		{"link-whited-out", buildTar(t, []tarEnt{{name: ".wh.f"}, {name: "l", typ: tar.TypeLink, link: "f"}}), "removed by a whiteout"},
		{"major", buildTar(t, []tarEnt{{name: "c", typ: tar.TypeChar, major: 4096, minor: 0}}), "device 4096:0 out of range"},
		{"minor", buildTar(t, []tarEnt{{name: "c", typ: tar.TypeBlock, major: 8, minor: 1 << 20}}), "device 8:1048576 out of range"},
		{"major-64bit", buildTar(t, []tarEnt{{name: "c", typ: tar.TypeChar, major: 1 << 33, format: tar.FormatGNU}}), "out of range"},
		{"major-negative", patchHeader(buildTar(t, []tarEnt{{name: "c", typ: tar.TypeChar}}), 329, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), "negative device number"},
		{"size-negative", patchHeader(file, 124, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), "invalid tar header"},
		{"symlink-long", buildTar(t, []tarEnt{{name: "s", typ: tar.TypeSymlink, link: strings.Repeat("x", 4096)}}), "symlink target of 4096 bytes (max 4095)"},
		{"too-many", buildTar(t, func() []tarEnt {
			var es []tarEnt
			for i := range 1001 {
				es = append(es, tarEnt{name: fmt.Sprintf("f%d", i)})
			}
			return es
		}()), "more than 1000 entries"},
		{"below-symlink", buildTar(t, []tarEnt{{name: "s", typ: tar.TypeSymlink, link: "/etc"}, {name: "s/passwd", body: "x"}}), `parent "s" is not a directory`},
		{"below-file", buildTar(t, []tarEnt{{name: "f", body: "x"}, {name: "f/g", body: "y"}}), `parent "f" is not a directory`},
		{"sparse-gnu", patchHeader(buildTar(t, []tarEnt{{name: "sp", body: "x", format: tar.FormatGNU}}), 156, []byte{'S'}), "sparse"},
		{"sparse-pax", patchHeader(buildTar(t, []tarEnt{{name: "pax", body: paxRecords("GNU.sparse.major", "1", "GNU.sparse.minor", "0", "GNU.sparse.name", "sp", "GNU.sparse.realsize", "10")}, {name: "sp", body: "1\n0\n1\n" + strings.Repeat("\x00", 506) + "x"}}), 156, []byte{'x'}), "sparse"},
		{"root-not-dir", buildTar(t, []tarEnt{{name: ".", body: "x"}}), "root entry is a regular"},
		{"whiteout-empty", buildTar(t, []tarEnt{{name: "a/.wh."}}), `whiteout of ""`},
		{"whiteout-dotdot", buildTar(t, []tarEnt{{name: "a/.wh..."}}), `whiteout of ".."`},
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

// TestFromOCIHostileNamesEntryAndLayer checks the error at the API surface.
func TestFromOCIHostileNamesEntryAndLayer(t *testing.T) {
	good := buildTar(t, []tarEnt{{name: "ok", body: "fine"}})
	bad := buildTar(t, []tarEnt{{name: "x/../../../etc/shadow", body: "x"}})
	dir := t.TempDir()
	writeOCILayout(t, dir, compressLayers(t, [][]byte{good, bad}), map[string]int{"t": 2})
	_, err := FromOCI(context.Background(), dir, "t", Options{CacheDir: t.TempDir()})
	if err == nil {
		t.Fatal("accepted")
	}
	for _, s := range []string{"layer 1 (" + digestOf(bad) + ")", `"x/../../../etc/shadow"`, `".." component`} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q lacks %q", err, s)
		}
	}
}

func paths(ix *Index) []string {
	var out []string
	for _, e := range ix.Entries {
		out = append(out, e.Path)
	}
	return out
}

func entry(t *testing.T, ix *Index, p string) *Entry {
	t.Helper()
	i := ix.Lookup(p)
	if i < 0 {
		t.Fatalf("%q missing from %q", p, paths(ix))
	}
	return &ix.Entries[i]
}

func TestTarLayerSemantics(t *testing.T) {
	l1 := buildTar(t, []tarEnt{
		{name: "a/", typ: tar.TypeDir, mode: 0o700},
		{name: "a/f", body: "af"},
		{name: "b/", typ: tar.TypeDir, mode: 0o711},
		{name: "b/old", body: "old"},
		{name: "c/", typ: tar.TypeDir, mode: 0o750},
		{name: "c/old", body: "old"},
		{name: "x", body: "x-v1"},
		{name: "f", body: "f-v1"},
		{name: "o/", typ: tar.TypeDir, pax: map[string]string{"SCHILY.xattr.user.k": "v"}},
		{name: "o/keep", body: "k"},
	})
	l2 := buildTar(t, []tarEnt{
		{name: "a/g", body: "ag"},                   // implicit parent keeps lower metadata
		{name: "b/.wh..wh..opq"},                    // opaque on an implicit directory
		{name: "b/new", body: "new"},                //
		{name: ".wh.c"},                             // whiteout, then implied again:
		{name: "c/z", body: "z"},                    // a fresh default directory
		{name: "l", typ: tar.TypeLink, link: "x"},   // link into the lower layer...
		{name: "x", body: "x-v2"},                   // ...then x replaced: l keeps v1
		{name: "zz", body: "zz"},                    // in-layer link group whose
		{name: "aa", typ: tar.TypeLink, link: "zz"}, // first name sorts last
		{name: ".wh.f"}, {name: "f", body: "f-v2"},  // whiteout plus entry: entry stays
		{name: "dup", body: "first"}, {name: "dup", body: "second"},
		{name: "r", body: "file"}, {name: "r/", typ: tar.TypeDir}, {name: "r/in", body: "in"},
		{name: ".wh..wh.plnk"},
		{name: "o/", typ: tar.TypeDir, pax: map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}},
		{name: "./", typ: tar.TypeDir, mode: 0o700},
	})
	longName := strings.Repeat("g", 150) + "/" + strings.Repeat("h", 200)
	l3 := buildTar(t, []tarEnt{
		{name: longName, body: "gnu-long", format: tar.FormatGNU},
		{name: "paxfile", body: "pax-data", pax: map[string]string{"SCHILY.xattr.user.big": strings.Repeat("v", 3000)}},
		{name: "lf", typ: tar.TypeLink, link: "l"}, // joins l's (lower) inode
		{name: ".wh.l"}, // then l goes: lf carries the data
	})
	ix, err := mergeTars(t, l1, l2, l3)
	must(t, err)
	want := []string{".", "a", "a/f", "a/g", "aa", "b", "b/new", "c", "c/z", "dup", "f", strings.Repeat("g", 150), longName, "lf", "o", "o/keep", "paxfile", "r", "r/in", "x", "zz"}
	if got := paths(ix); !reflect.DeepEqual(got, want) {
		t.Fatalf("paths %q\nwant  %q", got, want)
	}
	if e := entry(t, ix, "."); e.Mode != 0o700 {
		t.Errorf("root mode %o", e.Mode)
	}
	if e := entry(t, ix, "a"); e.Mode != 0o700 || e.Mtime.Sec != 1700000000 {
		t.Errorf("implicit a lost lower metadata: %+v", e)
	}
	if e := entry(t, ix, "b"); e.Mode != 0o711 {
		t.Errorf("opaque implicit b mode %o", e.Mode)
	}
	if e := entry(t, ix, "c"); e.Mode != 0o755 || e.Mtime.Sec != 0 {
		t.Errorf("re-created c: %+v", e)
	}
	if e := entry(t, ix, "o"); len(e.Xattrs) != 0 {
		t.Errorf("o xattrs %v (upper dir has none; image overlay xattrs must be dropped)", e.Xattrs)
	}
	read := func(p string) string {
		e := entry(t, ix, p)
		if e.Type != TypeRegular {
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
	if e := entry(t, ix, "zz"); e.Type != TypeHardlink || e.Linkname != "aa" {
		t.Errorf("zz: %+v", e)
	}
}

func TestFromDirRejectsEntryLimitInLayers(t *testing.T) {
	d := t.TempDir()
	for i := range 20 {
		writeFile(t, filepath.Join(d, fmt.Sprint(i)), nil, 0o644)
	}
	if _, err := FromLayers(context.Background(), []string{d}, Options{MaxEntries: 10}); err == nil {
		t.Fatal("limit ignored")
	}
	if _, err := FromLayers(context.Background(), []string{d, d}, Options{LayerKeys: []string{"x"}}); err == nil {
		t.Fatal("key count mismatch accepted")
	}
	if _, err := FromLayers(context.Background(), []string{filepath.Join(d, "nope")}, Options{}); !os.IsNotExist(unwrapAll(err)) {
		t.Fatalf("missing layer: %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok || u.Unwrap() == nil {
			return err
		}
		err = u.Unwrap()
	}
}
