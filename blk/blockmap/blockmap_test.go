package blockmap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"testing"
)

func sample(t testing.TB) *Map {
	t.Helper()
	b := NewBuilder(4096, 1000)
	b.Add(Extent{First: 0, Count: 3, Kind: Meta, Loc: Location{Offset: 0}, Bytes: 3 * 4096})
	b.Add(Extent{First: 3, Count: 2, Kind: Meta, Loc: Location{Offset: 3 * 4096}, Bytes: 2 * 4096}) // merges
	b.Add(Extent{First: 5, Count: 10, Kind: Zero})
	b.Add(Extent{First: 15, Count: 5, Kind: Zero}) // merges
	b.Add(Extent{First: 30, Count: 2, Kind: Data, Loc: Location{Source: 1, Path: "a/b", Offset: 0}, Bytes: 4097})
	b.Add(Extent{First: 32, Count: 1, Kind: Data, Loc: Location{Source: 1, Path: "a/b", Offset: 8192}, Bytes: 10}) // does not merge: prev partial
	b.Add(Extent{First: 40, Count: 4, Kind: Data, Loc: Location{Source: 0, Path: "c", Offset: 1 << 20}, Bytes: 4 * 4096})
	m, err := b.Map()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestLookup(t *testing.T) {
	m := sample(t)
	if m.Len() != 5 {
		t.Fatalf("Len = %d, want 5 (merged)", m.Len())
	}
	for _, c := range []struct {
		block      uint64
		kind       Kind
		first, cnt uint64
		path       string
		offset     int64
		bytes      uint64
	}{
		{0, Meta, 0, 5, "", 0, 5 * 4096},
		{4, Meta, 0, 5, "", 0, 5 * 4096},
		{5, Zero, 5, 15, "", 0, 0},
		{19, Zero, 5, 15, "", 0, 0},
		{20, Free, 20, 10, "", 0, 0},
		{29, Free, 20, 10, "", 0, 0},
		{31, Data, 30, 2, "a/b", 0, 4097},
		{32, Data, 32, 1, "a/b", 8192, 10},
		{33, Free, 33, 7, "", 0, 0},
		{43, Data, 40, 4, "c", 1 << 20, 4 * 4096},
		{44, Free, 44, 956, "", 0, 0},
		{999, Free, 44, 956, "", 0, 0},
		{1000, Free, 1000, 0, "", 0, 0},
	} {
		k, loc, e := m.Lookup(c.block)
		if k != c.kind || e.First != c.first || e.Count != c.cnt || loc.Path != c.path || loc.Offset != c.offset || e.Bytes != c.bytes {
			t.Errorf("Lookup(%d) = %v %+v %+v, want %v first %d count %d path %q off %d bytes %d",
				c.block, k, loc, e, c.kind, c.first, c.cnt, c.path, c.offset, c.bytes)
		}
	}
}

func TestLookupDoesNotAllocate(t *testing.T) {
	m := sample(t)
	n := testing.AllocsPerRun(100, func() {
		for b := uint64(0); b < 50; b++ {
			m.Lookup(b)
		}
	})
	if n != 0 {
		t.Fatalf("Lookup allocates %v times per run", n)
	}
}

func TestBuilderRejects(t *testing.T) {
	for name, exts := range map[string][]Extent{
		"overlap":      {{First: 0, Count: 4, Kind: Zero}, {First: 3, Count: 1, Kind: Zero}},
		"beyond end":   {{First: 999, Count: 2, Kind: Zero}},
		"wrap":         {{First: ^uint64(0), Count: 2, Kind: Zero}},
		"empty":        {{First: 1, Count: 0, Kind: Zero}},
		"free kind":    {{First: 1, Count: 1, Kind: Free}},
		"too many":     {{First: 1, Count: 1, Kind: Data, Bytes: 4097}},
		"neg offset":   {{First: 1, Count: 1, Kind: Data, Loc: Location{Offset: -1}, Bytes: 1}},
		"meta source":  {{First: 1, Count: 1, Kind: Meta, Loc: Location{Path: "x"}, Bytes: 1}},
		"zero w/ data": {{First: 1, Count: 1, Kind: Zero, Bytes: 1}},
	} {
		b := NewBuilder(4096, 1000)
		for _, e := range exts {
			b.Add(e)
		}
		if _, err := b.Map(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestEncodeRoundTrip(t *testing.T) {
	m := sample(t)
	enc, err := m.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	d, err := decode(enc)
	if err != nil {
		t.Fatal(err)
	}
	if d.BlockSize() != m.BlockSize() || d.Blocks() != m.Blocks() || d.Len() != m.Len() {
		t.Fatalf("decoded geometry differs")
	}
	for i := 0; i < m.Len(); i++ {
		if d.At(i) != m.At(i) {
			t.Errorf("extent %d: %+v, want %+v", i, d.At(i), m.At(i))
		}
	}
	again, _ := d.MarshalBinary()
	if !bytes.Equal(again, enc) {
		t.Fatal("re-encoding differs")
	}
}

// decode and View check the same things: every flipped byte and every
// truncation is refused by both.
func TestDecodeRejectsCorruption(t *testing.T) {
	enc, err := sample(t).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for name, open := range map[string]func([]byte) (*Map, error){"decode": decode, "View": View} {
		for i := 0; i < len(enc); i++ {
			bad := bytes.Clone(enc)
			bad[i] ^= 0x40
			if _, err := open(bad); !errors.Is(err, ErrFormat) {
				t.Fatalf("%s, flipping byte %d: err %v, want ErrFormat", name, i, err)
			}
		}
		for n := 0; n < len(enc); n++ {
			if _, err := open(enc[:n]); err == nil {
				t.Fatalf("%s, truncated to %d bytes: accepted", name, n)
			}
		}
	}
}

func FuzzDecode(f *testing.F) {
	enc, err := sample(f).MarshalBinary()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(enc)
	f.Add([]byte{})
	f.Add([]byte(magic))
	f.Add(make([]byte, headerSize+4))
	f.Fuzz(func(t *testing.T, b []byte) {
		// Reseal the checksum half the time so the parser behind it is
		// exercised, not only the checksum gate.
		if len(b) > 0 && b[0]&1 == 1 && len(b) >= headerSize+4 {
			body := bytes.Clone(b[:len(b)-4])
			copy(body, magic)
			b = binary.LittleEndian.AppendUint32(body, crc32.Checksum(body, castagnoli))
		}
		m, err := decode(b)
		v, verr := View(b)
		if (err == nil) != (verr == nil) {
			t.Fatalf("Decode: %v, View: %v", err, verr)
		}
		if err != nil {
			return
		}
		agree(t, m, v)
		for i := 0; i < m.Len(); i++ {
			e := m.At(i)
			k, _, got := m.Lookup(e.First)
			if k != e.Kind || got != e {
				t.Fatalf("Lookup(%d) = %+v, want %+v", e.First, got, e)
			}
		}
		if _, err := m.MarshalBinary(); err != nil {
			t.Fatal(err)
		}
	})
}

func BenchmarkLookup(b *testing.B) {
	const n = 200000
	bl := NewBuilder(4096, 4*n)
	for i := uint64(0); i < n; i++ {
		bl.Add(Extent{First: 4 * i, Count: 3, Kind: Data, Loc: Location{Source: 0, Path: "p", Offset: int64(i) << 20}, Bytes: 3 * 4096})
	}
	m, err := bl.Map()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		m.Lookup(uint64(i*7919) % (4 * n))
	}
}

// decode parses an encoded map, trusting nothing in it. The map holds
// its extents on the heap; see View for one that reads them from b.
func decode(b []byte) (*Map, error) {
	return parse(b, false)
}
