package lazyindex

import (
	"bufio"
	"bytes"
	"compress/flate"
	"errors"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"testing"
)

// testData returns n bytes of a mix the compressor treats differently:
// runs, repeated phrases, text-like bytes and random bytes.
func testData(rng *rand.Rand, n int) []byte {
	b := make([]byte, 0, n)
	for len(b) < n {
		k := min(n-len(b), 1+rng.IntN(4096))
		switch rng.IntN(4) {
		case 0:
			c := byte(rng.IntN(256))
			for i := 0; i < k; i++ {
				b = append(b, c)
			}
		case 1:
			if len(b) > 0 {
				src := rng.IntN(len(b))
				for i := 0; i < k; i++ {
					b = append(b, b[src+i%(len(b)-src)])
				}
			}
		case 2:
			for i := 0; i < k; i++ {
				b = append(b, "etaoin shrdlu\n"[rng.IntN(14)])
			}
		default:
			for i := 0; i < k; i++ {
				b = append(b, byte(rng.Uint32()))
			}
		}
	}
	return b
}

func deflate(t testing.TB, data []byte, level int) []byte {
	var buf bytes.Buffer
	w, err := flate.NewWriter(&buf, level)
	if err != nil {
		t.Fatal(err)
	}
	// Flushes make stored and empty blocks and byte alignments mid-stream.
	for len(data) > 0 {
		k := min(len(data), 100000)
		w.Write(data[:k])
		data = data[k:]
		if k%3 == 0 {
			w.Flush()
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// checkAgainstFlate inflates comp with our inflater and compress/flate and
// fails unless both succeed with the same bytes, or both fail with our
// output a prefix of the oracle's or the oracle's of ours.
//
// Output is capped at maxOut bytes: a 1 MiB fuzzed stream of 2-bit
// length-258 copies expands to a gigabyte.
func checkAgainstFlate(t testing.TB, comp []byte, maxOut int64) {
	want, werr := io.ReadAll(io.LimitReader(flate.NewReader(bytes.NewReader(comp)), maxOut))
	got, gerr := io.ReadAll(io.LimitReader(newRawStream(bytes.NewReader(comp), 0), maxOut))
	// The bufio path refills eight bytes at a time; a 16-byte buffer
	// makes it meet the buffer's end often.
	got2, gerr2 := io.ReadAll(io.LimitReader(newRawStream(bufio.NewReaderSize(bytes.NewReader(comp), 16), 0), maxOut))
	if !bytes.Equal(got, got2) || (gerr == nil) != (gerr2 == nil) {
		t.Fatalf("byte reader: %d bytes, err %v; bufio reader: %d bytes, err %v", len(got), gerr, len(got2), gerr2)
	}
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("compress/flate: %d bytes, err %v; ours: %d bytes, err %v", len(want), werr, len(got), gerr)
	}
	if werr == nil {
		if !bytes.Equal(got, want) {
			t.Fatalf("output differs: %d bytes vs compress/flate's %d", len(got), len(want))
		}
		return
	}
	if !bytes.HasPrefix(want, got) && !bytes.HasPrefix(got, want) {
		t.Fatalf("on a corrupt stream our %d bytes and compress/flate's %d disagree", len(got), len(want))
	}
	if !errors.Is(gerr, errCorrupt) && !errors.Is(gerr, io.ErrUnexpectedEOF) {
		t.Fatalf("error %v is neither corrupt data nor unexpected EOF", gerr)
	}
}

func TestInflateMatchesFlate(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, level := range []int{flate.NoCompression, flate.BestSpeed, 5, flate.BestCompression, flate.HuffmanOnly} {
		for _, n := range []int{0, 1, 257, 65536, 1 << 20} {
			checkAgainstFlate(t, deflate(t, testData(rng, n), level), 1<<30)
		}
	}
}

func TestInflateCorruptMatchesFlate(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	comp := deflate(t, testData(rng, 200000), 6)
	for i := 0; i < 300; i++ {
		c := bytes.Clone(comp)
		switch i % 3 {
		case 0:
			c[rng.IntN(len(c))] ^= byte(1 << rng.IntN(8))
		case 1:
			c = c[:rng.IntN(len(c))]
		default:
			for j := 0; j < 8; j++ {
				c[rng.IntN(len(c))] = byte(rng.Uint32())
			}
		}
		checkAgainstFlate(t, c, 1<<30)
	}
}

// FuzzInflate checks the inflater against compress/flate. Seeds are small:
// the engine minimizes every new input, which takes seconds on kilobytes.
func FuzzInflate(f *testing.F) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, level := range []int{0, 1, 9, -2} {
		f.Add(deflate(f, testData(rng, 120), level))
	}
	f.Add([]byte{0x05, 0xc0, 0x21, 0x0d, 0x00, 0x00})
	f.Fuzz(func(t *testing.T, comp []byte) {
		checkAgainstFlate(t, comp, 1<<20)
	})
}

// newRawStream decodes a bare deflate stream from its start.
func newRawStream(r io.Reader, span int64) *stream {
	br := newBitReader(r)
	return &stream{br: br, f: newInflater(br), raw: true, crc: crc32.NewIEEE(), span: span}
}
