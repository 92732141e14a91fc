package index_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"hash/crc32"
	"reflect"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/blk/index/tarlayer"
)

// sampleIndex is a small valid merged index touching every field.
func sampleIndex() *index.Index {
	return &index.Index{
		Sources: []index.Source{{Kind: index.SourceDir, ID: "/var/lib/layer1/fs"}, {Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("ab", 32)}},
		Entries: []index.Entry{
			{Path: ".", Type: index.TypeDir, Mode: 0o755, Mtime: index.Timespec{Sec: -5, Nsec: 999999999}},
			{Path: "a", Type: index.TypeDir, Mode: 0o1777, UID: 1, GID: 2, Xattrs: []index.Xattr{{Name: "user.a", Value: []byte{}}, {Name: "user.b", Value: []byte("x")}}},
			{Path: "a/f", Type: index.TypeRegular, Mode: 0o4755, Size: 10 << 20, Data: index.Data{Source: 0, Path: "a/f", Segments: []index.Range{{Off: 4096, Len: 4096}}}, Atime: index.Timespec{Sec: 1}, Ctime: index.Timespec{Sec: 2, Nsec: 3}},
			{Path: "a/g", Type: index.TypeHardlink, Linkname: "a/f", Size: 10 << 20, Mode: 0o4755},
			{Path: "a-b", Type: index.TypeRegular, Size: 5, Data: index.Data{Source: 1, Offset: 512}, Ino: 77},
			{Path: "c", Type: index.TypeChar, Devmajor: 4095, Devminor: 1<<20 - 1},
			{Path: "e", Type: index.TypeRegular, Size: 0, Data: index.Data{Source: 0, Path: "other/e", Segments: []index.Range{}}},
			{Path: "l", Type: index.TypeSymlink, Linkname: "/x"},
			{Path: "p", Type: index.TypeFifo},
			{Path: "s", Type: index.TypeSocket},
		},
	}
}

func encoded(t testing.TB, ix *index.Index) []byte {
	var buf bytes.Buffer
	indextest.Must(t, index.Encode(&buf, ix))
	return buf.Bytes()
}

// withPayload wraps a raw payload in a valid header.
func withPayload(p []byte) []byte { return withPayloadFlags(p, 0) }

func withPayloadFlags(p []byte, flags uint32) []byte {
	h := make([]byte, index.EncHeaderSize)
	copy(h, index.EncMagic)
	binary.LittleEndian.PutUint32(h[8:], index.EncVersion)
	binary.LittleEndian.PutUint32(h[12:], flags)
	binary.LittleEndian.PutUint64(h[16:], uint64(len(p)))
	binary.LittleEndian.PutUint32(h[24:], crc32.Checksum(p, index.Castagnoli))
	return append(h, p...)
}

func TestEncodeDecode(t *testing.T) {
	ix := sampleIndex()
	indextest.Must(t, ix.Validate())
	b := encoded(t, ix)
	got, err := index.Decode(bytes.NewReader(b))
	indextest.Must(t, err)
	if !reflect.DeepEqual(got, ix) {
		t.Fatalf("round trip:\n%+v\n%+v", got, ix)
	}
	bad := map[string][]byte{
		"empty":     nil,
		"magic":     append([]byte("XXXXXXXX"), b[8:]...),
		"version":   append(append(append([]byte{}, b[:8]...), 9, 0, 0, 0), b[12:]...),
		"checksum":  append(bytes.Clone(b[:len(b)-1]), b[len(b)-1]^1),
		"truncated": b[:len(b)-3],
		"trailing":  withPayload(append(bytes.Clone(b[index.EncHeaderSize:]), 0)),
		// Counts far beyond the data must fail before allocating.
		"sources-count": withPayload(binary.AppendUvarint(nil, 1<<60)),
		"entries-count": withPayload(binary.AppendUvarint([]byte{0}, 1<<40)),
		"huge-length":   append(append(bytes.Clone(b[:16]), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f), b[24:]...),
	}
	for name, in := range bad {
		if _, err := index.Decode(bytes.NewReader(in)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// Structurally fine but semantically invalid indexes are rejected.
	mut := map[string]func(ix *index.Index){
		"order":        func(ix *index.Index) { ix.Entries[4], ix.Entries[5] = ix.Entries[5], ix.Entries[4] },
		"no-parent":    func(ix *index.Index) { ix.Entries[2].Path = "z/f"; ix.Entries[2].Data.Path = "z/f" },
		"link-target":  func(ix *index.Index) { ix.Entries[3].Linkname = "nope" },
		"link-to-dir":  func(ix *index.Index) { ix.Entries[3].Linkname = "a" },
		"dotdot":       func(ix *index.Index) { ix.Entries[7].Path = "l/../x" },
		"dev":          func(ix *index.Index) { ix.Entries[5].Devmajor = 4096 },
		"segments":     func(ix *index.Index) { ix.Entries[2].Data.Segments = []index.Range{{Off: 10 << 20, Len: 1}} },
		"source":       func(ix *index.Index) { ix.Entries[4].Data.Source = 9 },
		"mode":         func(ix *index.Index) { ix.Entries[1].Mode = 0o170000 },
		"xattr-order":  func(ix *index.Index) { ix.Entries[1].Xattrs[0].Name = "user.c" },
		"overlay":      func(ix *index.Index) { ix.Entries[1].Xattrs[1].Name = "trusted.overlay.opaque" },
		"blob-id":      func(ix *index.Index) { ix.Sources[1].ID = "sha256:../../x" },
		"type":         func(ix *index.Index) { ix.Entries[8].Type = 42 },
		"root":         func(ix *index.Index) { ix.Entries[0].Type = index.TypeRegular },
		"symlink-long": func(ix *index.Index) { ix.Entries[7].Linkname = strings.Repeat("x", 4096) },
	}
	for name, f := range mut {
		ix := sampleIndex()
		f(ix)
		if _, err := index.Decode(bytes.NewReader(encoded(t, ix))); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzDecode(f *testing.F) {
	b := encoded(f, sampleIndex())
	f.Add(b)
	f.Add(b[:40])
	f.Add(withPayload([]byte{0, 1, 0, 0, 1, '.', 2, 0}))
	for _, tb := range indextest.FuzzSeedTars(f)[:3] {
		ix, err := tarlayer.Read(context.Background(), bytes.NewReader(tb), index.Source{Kind: index.SourceBlob, ID: indextest.DigestOf(tb)}, 100, "seed")
		indextest.Must(f, err)
		var buf bytes.Buffer
		indextest.Must(f, index.EncodeLayer(&buf, ix))
		f.Add(buf.Bytes())
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// The checksum stops almost every mutation, so also feed the data as
		// a payload behind a valid header, as a merged and as a layer index.
		if len(data) > index.EncHeaderSize && string(data[:len(index.EncMagic)]) == index.EncMagic {
			fuzzDecodeOne(t, data)
			fuzzDecodeOne(t, withPayload(data[index.EncHeaderSize:]))
			fuzzDecodeOne(t, withPayloadFlags(data[index.EncHeaderSize:], index.FlagLayer))
			return
		}
		fuzzDecodeOne(t, data)
		fuzzDecodeOne(t, withPayload(data))
		fuzzDecodeOne(t, withPayloadFlags(data, index.FlagLayer))
	})
}

func fuzzDecodeOne(t *testing.T, data []byte) {
	{
		// The layer cache path: decode, relaxed validation, merge.
		if lx, err := index.DecodeLayer(bytes.NewReader(data)); err == nil && len(lx.Sources) == 1 {
			if m, err := overlayfs.Merge(context.Background(), []*index.Index{lx}, []string{"fuzz"}, 5000); err == nil {
				if err := m.Validate(); err != nil {
					t.Fatalf("merge of a cached layer gives an invalid index: %v", err)
				}
			}
		}
		ix, err := index.Decode(bytes.NewReader(data))
		if err != nil {
			return
		}
		var buf bytes.Buffer
		indextest.Must(t, index.Encode(&buf, ix))
		again, err := index.Decode(&buf)
		if err != nil {
			t.Fatalf("re-encoded index does not decode: %v", err)
		}
		if !reflect.DeepEqual(indextest.Normalize(again), indextest.Normalize(ix)) {
			t.Fatal("round trip differs")
		}
	}
}
