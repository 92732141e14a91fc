package lazyindex

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"reflect"
	"testing"
)

// tinyLayer is a small gzip layer whose encoded index makes a seed small
// enough for the engine to minimize quickly.
func tinyLayer(t testing.TB) []byte {
	rng := rand.New(rand.NewPCG(21, 22))
	return gzipGo(t, buildTar(t, []member{{"a", testData(rng, 200)}, {"b", nil}}), 6)
}

// FuzzDecode feeds hostile encodings to Decode: it must refuse them with
// ErrInvalid, never panic, and whatever it accepts must encode back to an
// index that decodes the same.
func FuzzDecode(f *testing.F) {
	for _, layer := range [][]byte{tinyLayer(f), buildTar(f, []member{{"x", []byte("y")}})} {
		ix, err := Build(context.Background(), bytes.NewReader(layer), Options{})
		if err != nil {
			f.Fatal(err)
		}
		b, err := ix.MarshalBinary()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		if ix.Format == FormatGzip {
			// A span over MaxSpan, the one field an artifact's writer
			// could set to make reads costly, with everything else valid.
			f.Add(withSpan(f, b, 64<<20))
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ix, err := Decode(bytes.NewReader(b))
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		again, err := ix.MarshalBinary()
		if err != nil {
			t.Fatalf("a decoded index does not encode: %v", err)
		}
		ix2, err := Decode(bytes.NewReader(again))
		if err != nil || !reflect.DeepEqual(ix, ix2) {
			t.Fatalf("re-encoded index decodes differently: %v", err)
		}
	})
}

// shiftBits returns b read from bit k on, re-aligned to bit 0: the way
// compress/flate can be made to start at a block header inside a byte.
func shiftBits(b []byte, k uint) []byte {
	if k == 0 {
		return b
	}
	out := make([]byte, len(b))
	for i := range b {
		out[i] = b[i] >> k
		if i+1 < len(b) {
			out[i] |= b[i+1] << (8 - k)
		}
	}
	return out
}

// FuzzInflateFromCheckpoint resumes inflating at a block boundary with a
// preset window, as a range read does, and checks the output against
// compress/flate given the same window as its dictionary. Starting inside
// a byte is checked against the byte-aligned read of the same bits
// re-aligned, as long as no stored block (whose padding is relative to the
// original bytes, which is why re-aligning bytes for compress/flate is not
// enough) is met. Mid-block checkpoint kinds are decoded too, for panics.
func FuzzInflateFromCheckpoint(f *testing.F) {
	rng := rand.New(rand.NewPCG(23, 24))
	dict := testData(rng, 300)
	for _, level := range []int{1, 9} {
		var buf bytes.Buffer
		w, _ := flate.NewWriterDict(&buf, level, dict)
		w.Write(append(bytes.Clone(dict[100:200]), testData(rng, 100)...))
		w.Close()
		f.Add(uint8(0), dict, buf.Bytes())
		f.Add(uint8(3), dict[:10], append([]byte{0}, buf.Bytes()...))
	}
	f.Fuzz(func(t *testing.T, k uint8, window, data []byte) {
		if len(window) > windowSize {
			window = window[:windowSize]
		}
		read := func(bit int64, data []byte) ([]byte, error) {
			cp := Checkpoint{In: 8*1000 + bit, Out: 1 << 20, Kind: KindBlock, Window: window}
			s, err := newResumeStream(&cp, bytes.NewReader(data), false)
			if err != nil {
				return nil, err
			}
			return io.ReadAll(io.LimitReader(s, 1<<20))
		}
		got, gerr := read(0, data)
		want, werr := io.ReadAll(io.LimitReader(flate.NewReaderDict(bytes.NewReader(data), window), 1<<20))
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("compress/flate: %d bytes, err %v; ours: %d bytes, err %v", len(want), werr, len(got), gerr)
		}
		if gerr == nil && !bytes.Equal(got, want) || !bytes.HasPrefix(want, got) && !bytes.HasPrefix(got, want) {
			t.Fatalf("output differs: %d bytes vs compress/flate's %d", len(got), len(want))
		}
		if bit := int64(k % 8); bit != 0 && len(data) > 0 {
			// data starting at bit 'bit' of a byte equals the aligned read of
			// shiftBits(data, bit) until a stored block's padding is met; the
			// re-aligned copy has bit zero bits more at its end, so it may
			// get further.
			gotU, errU := read(bit, data)
			gotA, errA := read(0, shiftBits(data, uint(bit)))
			stored := errors.Is(errU, errCorrupt) || errors.Is(errA, errCorrupt) || hasStoredBlock(shiftBits(data, uint(bit)))
			if !stored && (!bytes.HasPrefix(gotA, gotU) || errU == nil && (errA != nil || !bytes.Equal(gotU, gotA))) {
				t.Fatalf("reading from bit %d: %d bytes, err %v; re-aligned: %d bytes, err %v", bit, len(gotU), errU, len(gotA), errA)
			}
		}
		// The same bits read as the inside of a stored or Huffman block,
		// and through the gzip member framing: errors, never panics.
		for _, c := range []Checkpoint{
			{In: 0, Kind: KindStored, Stored: int(k) * 7, Window: window},
			{In: int64(k % 8), Kind: KindHuffman, Window: window},
			{In: int64(k % 8), Kind: KindHuffman, NLit: 257, Lens: append(fixedLens()[:257], 5), Window: window},
		} {
			s, err := newResumeStream(&c, bytes.NewReader(data), true)
			if err == nil {
				io.Copy(io.Discard, io.LimitReader(s, 1<<20))
			}
		}
	})
}

// hasStoredBlock reports whether inflating data (from bit 0) meets a
// stored block header.
func hasStoredBlock(data []byte) bool {
	br := &bitReader{r: bytes.NewReader(data)}
	f := newInflater(br)
	for f.n < 1<<20 {
		if f.state == stHeader {
			br.refill()
			if br.nb >= 3 && br.b>>1&3 == 0 {
				return true
			}
		}
		f.slide(f.n)
		if err := f.step(outChunk); err != nil || f.state == stEnd {
			return false
		}
	}
	return false
}

// benchLayer is a 32 MiB layer of mixed content, compressed at gzip's
// default level: what the benchmarks of indexing and of plain
// decompression read.
func benchLayer(b *testing.B) (raw, comp []byte) {
	rng := rand.New(rand.NewPCG(25, 26))
	var files []member
	for i := 0; i < 32; i++ {
		files = append(files, member{string(rune('a'+i%26)) + string(rune('a'+i/26)), testData(rng, 1<<20)})
	}
	raw = buildTar(b, files)
	return raw, gzipGo(b, raw, gzip.DefaultCompression)
}

// BenchmarkBuild measures indexing (inflate, checkpoints, tar tree,
// digests) in uncompressed MB/s.
func BenchmarkBuild(b *testing.B) {
	raw, comp := benchLayer(b)
	b.SetBytes(int64(len(raw)))
	b.ResetTimer()
	for range b.N {
		if _, err := Build(context.Background(), bytes.NewReader(comp), Options{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInflateOnly measures our inflater alone, without tar or digests.
func BenchmarkInflateOnly(b *testing.B) {
	raw, comp := benchLayer(b)
	b.SetBytes(int64(len(raw)))
	b.ResetTimer()
	for range b.N {
		s, err := newIndexingStream(bufio.NewReaderSize(bytes.NewReader(comp), 64<<10), DefaultSpan, DefaultCheckpointBudget)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, s); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReadAt measures range reads as the content store makes them:
// each inflates a whole span from its checkpoint under a context that
// can be cancelled, in uncompressed MB/s.
func BenchmarkReadAt(b *testing.B) {
	_, comp := benchLayer(b)
	ix, err := Build(context.Background(), bytes.NewReader(comp), Options{})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := make([]byte, 4096)
	b.SetBytes(ix.Size)
	b.ResetTimer()
	for range b.N {
		for i := range ix.Checkpoints {
			end := ix.Size
			if i+1 < len(ix.Checkpoints) {
				end = ix.Checkpoints[i+1].Out
			}
			if _, err := ix.ReadAt(ctx, bytes.NewReader(comp), p, end-int64(len(p))); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkGzipReader is the baseline: compress/gzip decompressing the
// same layer.
func BenchmarkGzipReader(b *testing.B) {
	raw, comp := benchLayer(b)
	b.SetBytes(int64(len(raw)))
	b.ResetTimer()
	for range b.N {
		r, err := gzip.NewReader(bytes.NewReader(comp))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, r); err != nil {
			b.Fatal(err)
		}
	}
}
