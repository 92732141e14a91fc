package indextest

import (
	"archive/tar"
	"bytes"
	"testing"
	"time"
)

// TarEnt is one entry of a test tar; Typ 0 means a regular file.
type TarEnt struct {
	Name, Body, Link string
	Typ              byte
	Mode             int64
	Major, Minor     int64
	Pax              map[string]string
	Format           tar.Format
}

// BuildTar writes ents as a tar with fixed times.
func BuildTar(t testing.TB, ents []TarEnt) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.Name, Typeflag: e.Typ, Linkname: e.Link, Mode: e.Mode,
			Devmajor: e.Major, Devminor: e.Minor, PAXRecords: e.Pax, Format: e.Format,
			ModTime: time.Unix(1700000000, 0)}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.Body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatalf("write %q: %v", e.Name, err)
		}
		if _, err := tw.Write([]byte(e.Body)); err != nil {
			t.Fatal(err)
		}
	}
	Must(t, tw.Close())
	return buf.Bytes()
}

// FuzzSeedTars are layer tars that seed the fuzz targets reading layers and
// decoding their indexes: whiteouts, opaque markers, links within and below
// the layer, devices, xattrs, an escaping name and an empty input.
func FuzzSeedTars(t testing.TB) [][]byte {
	return [][]byte{
		BuildTar(t, []TarEnt{{Name: "./", Typ: '5'}, {Name: "a/b/c", Body: "abc"}, {Name: "a/.wh..wh..opq"}, {Name: ".wh.x"}, {Name: "l", Typ: '1', Link: "a/b/c"}, {Name: "s", Typ: '2', Link: "/etc"}}),
		BuildTar(t, []TarEnt{{Name: "f", Body: "1", Pax: map[string]string{"SCHILY.xattr.user.x": "y", "SCHILY.xattr.security.capability": string(VfsCapV2)}}, {Name: "c", Typ: '3', Major: 1, Minor: 3}, {Name: "p", Typ: '6'}}),
		BuildTar(t, []TarEnt{{Name: "z", Body: "z"}, {Name: "a", Typ: '1', Link: "z"}, {Name: "lower", Typ: '1', Link: "q"}, {Name: ".wh.q"}}),
		BuildTar(t, []TarEnt{{Name: "../x", Body: "x"}}),
		{},
	}
}
