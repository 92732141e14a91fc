package blockmap

import (
	"bytes"
	"testing"
)

// agree fails unless a and b answer every Lookup and At alike.
func agree(t testing.TB, a, b *Map) {
	t.Helper()
	if a.BlockSize() != b.BlockSize() || a.Blocks() != b.Blocks() || a.Len() != b.Len() {
		t.Fatalf("geometry %d x %d, %d extents; want %d x %d, %d", b.Blocks(), b.BlockSize(), b.Len(), a.Blocks(), a.BlockSize(), a.Len())
	}
	for i := 0; i < a.Len(); i++ {
		if a.At(i) != b.At(i) {
			t.Fatalf("extent %d: %+v, want %+v", i, b.At(i), a.At(i))
		}
	}
	blocks := []uint64{a.Blocks(), a.Blocks() + 1}
	for blk := uint64(0); blk <= a.Blocks() && blk < 1<<12; blk++ {
		blocks = append(blocks, blk)
	}
	for i := 0; i < a.Len(); i++ {
		e := a.At(i)
		blocks = append(blocks, e.First, e.End()-1, e.End())
	}
	for _, blk := range blocks {
		ka, la, ea := a.Lookup(blk)
		kb, lb, eb := b.Lookup(blk)
		if ka != kb || la != lb || ea != eb {
			t.Fatalf("Lookup(%d) = %v %+v %+v, want %v %+v %+v", blk, kb, lb, eb, ka, la, ea)
		}
	}
}

// A map read in place answers as the decoded one, without allocating,
// and re-encodes to its own bytes.
func TestViewMatchesDecode(t *testing.T) {
	m := sample(t)
	enc, err := m.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	v, err := View(enc)
	if err != nil {
		t.Fatal(err)
	}
	agree(t, m, v)
	if n := testing.AllocsPerRun(100, func() {
		for b := uint64(0); b < 50; b++ {
			v.Lookup(b)
		}
	}); n != 0 {
		t.Fatalf("Lookup on a view allocates %v times per run", n)
	}
	again, err := v.MarshalBinary()
	if err != nil || !bytes.Equal(again, enc) {
		t.Fatalf("re-encoding a view: %v, equal %t", err, bytes.Equal(again, enc))
	}
}
