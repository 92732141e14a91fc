package lazyindex

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/tarlayer"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

type member struct {
	name string
	data []byte
}

// buildTar writes a layer tar with the given files plus a directory, a
// symlink, a hard link, a whiteout and an xattr, like real layers carry.
func buildTar(t testing.TB, files []member) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(h *tar.Header, data []byte) {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	hdr(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}, nil)
	for _, f := range files {
		hdr(&tar.Header{Name: f.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.data)), Uid: 7, Gid: 8,
			PAXRecords: map[string]string{"SCHILY.xattr.user.k": "v"}}, f.data)
	}
	hdr(&tar.Header{Name: "d/link", Typeflag: tar.TypeSymlink, Linkname: "../" + files[0].name}, nil)
	hdr(&tar.Header{Name: "d/hard", Typeflag: tar.TypeLink, Linkname: files[0].name}, nil)
	hdr(&tar.Header{Name: "d/.wh.gone", Typeflag: tar.TypeReg}, nil)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipGo(t testing.TB, b []byte, level int) []byte {
	var buf bytes.Buffer
	w, err := gzip.NewWriterLevel(&buf, level)
	if err != nil {
		t.Fatal(err)
	}
	w.Name = "layer.tar" // FNAME
	w.Comment = "c"      // FCOMMENT
	w.Extra = []byte{1, 2, 3}
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipMultiMember(t testing.TB, b []byte) []byte {
	var out []byte
	for len(b) > 0 {
		k := min(len(b), 300000)
		out = append(out, gzipGo(t, b[:k], 6)...)
		b = b[k:]
	}
	return out
}

func gzipDebian(t testing.TB, b []byte, level string) []byte {
	p := testenv.Tool(t, "gzip", "gzip")
	cmd := exec.Command(p, "-c", "-n", level)
	cmd.Stdin = bytes.NewReader(b)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("gzip %s: %v", level, err)
	}
	return out
}

func smallLayer(t testing.TB, rng *rand.Rand) ([]byte, []member) {
	files := []member{
		{"empty", nil},
		{"zeros", make([]byte, 3<<20)},   // highly compressible, spans checkpoints
		{"random", testData(rng, 0)[:0]}, // replaced below
		{"mixed", testData(rng, 2<<20)},
	}
	rnd := make([]byte, 1<<20+17)
	for i := range rnd {
		rnd[i] = byte(rng.Uint32())
	}
	files[2].data = rnd // incompressible
	for i := 0; i < 300; i++ {
		files = append(files, member{fmt.Sprintf("d/small%03d", i), testData(rng, rng.IntN(3000))})
	}
	return buildTar(t, files), files
}

// checkLayer indexes comp and checks the tree against tarlayer's, the
// checkpoint spacing, and random reads inflated from checkpoints against
// the original tar.
func checkLayer(t *testing.T, rng *rand.Rand, raw, comp []byte, span int64) *Index {
	t.Helper()
	ix, err := Build(context.Background(), bytes.NewReader(comp), Options{Span: span, Layer: "test"})
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	if want := "sha256:" + hex.EncodeToString(sum[:]); ix.DiffID != want || ix.Size != int64(len(raw)) {
		t.Fatalf("diffID %s size %d, want %s %d", ix.DiffID, ix.Size, want, len(raw))
	}
	want, err := tarlayer.Read(context.Background(), bytes.NewReader(raw), index.Source{Kind: index.SourceBlob, ID: ix.DiffID}, 1<<20, "test")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(ix.Tree, want) {
		t.Fatalf("tree differs from tarlayer's")
	}
	if ix.Format == FormatGzip {
		prev := int64(0)
		for i, c := range ix.Checkpoints {
			if c.Out-prev > span {
				t.Fatalf("checkpoint %d at %d, %d after the previous, span %d", i, c.Out, c.Out-prev, span)
			}
			prev = c.Out
		}
		if ix.Size-prev > span {
			t.Fatalf("last checkpoint %d, size %d", prev, ix.Size)
		}
	}
	// Files: read each of a sample through its recorded offset, fetching
	// only the compressed range CompressedRange names.
	for _, e := range ix.Tree.Entries {
		if e.Type != index.TypeRegular || rng.IntN(4) != 0 && e.Size < 1<<20 {
			continue
		}
		off, n := e.Data.Offset, e.Size
		if n > 0 {
			o := rng.Int64N(n)
			off, n = off+o, min(n-o, 1+rng.Int64N(n))
		}
		readRange(t, ix, raw, comp, off, n)
	}
	for i := 0; i < 48; i++ {
		off := rng.Int64N(int64(len(raw)))
		readRange(t, ix, raw, comp, off, min(int64(len(raw))-off, 1+rng.Int64N(3*span)))
	}
	return ix
}

func readRange(t *testing.T, ix *Index, raw, comp []byte, off, n int64) {
	t.Helper()
	start, end, err := ix.CompressedRange(off, n)
	if err != nil {
		t.Fatal(err)
	}
	// Only [start, end) is readable, as after a Range request.
	fetched := make([]byte, len(comp))
	copy(fetched[start:end], comp[start:end])
	p := make([]byte, n)
	got, err := ix.ReadAt(context.Background(), io.NewSectionReader(bytes.NewReader(fetched[:end]), 0, end), p, off)
	if err != nil || int64(got) != n {
		t.Fatalf("ReadAt(%d, %d): %d, %v", off, n, got, err)
	}
	if !bytes.Equal(p, raw[off:off+n]) {
		t.Fatalf("ReadAt(%d, %d) returned other bytes than the layer's", off, n)
	}
}

func TestLayerGzipLevels(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	raw, _ := smallLayer(t, rng)
	for _, level := range []int{gzip.NoCompression, gzip.BestSpeed, gzip.DefaultCompression, gzip.BestCompression, gzip.HuffmanOnly} {
		t.Run(fmt.Sprint("go", level), func(t *testing.T) {
			checkLayer(t, rng, raw, gzipGo(t, raw, level), MinSpan)
		})
	}
	for _, level := range []string{"-1", "-6", "-9"} {
		t.Run("debian"+level, func(t *testing.T) {
			checkLayer(t, rng, raw, gzipDebian(t, raw, level), 256<<10)
		})
	}
	t.Run("fhcrc", func(t *testing.T) {
		// A header CRC-16 after FEXTRA, FNAME and FCOMMENT (10+2+3+10+2 bytes).
		c := gzipGo(t, raw, 6)
		c = append(append(bytes.Clone(c[:27]), 0xab, 0xcd), c[27:]...)
		c[3] |= 2
		checkLayer(t, rng, raw, c, MinSpan)
	})
	t.Run("multimember", func(t *testing.T) {
		checkLayer(t, rng, raw, gzipMultiMember(t, raw), MinSpan)
	})
	t.Run("plain", func(t *testing.T) {
		ix := checkLayer(t, rng, raw, raw, MinSpan)
		if ix.Format != FormatPlain || len(ix.Checkpoints) != 0 || ix.Digest != ix.DiffID {
			t.Fatalf("plain layer: format %s, %d checkpoints", ix.Format, len(ix.Checkpoints))
		}
	})
}

func TestLayerLarge(t *testing.T) {
	if testing.Short() {
		t.Skip("64 MiB layer")
	}
	rng := rand.New(rand.NewPCG(11, 12))
	var files []member
	for i := 0; i < 48; i++ {
		files = append(files, member{fmt.Sprintf("big%02d", i), testData(rng, 1<<20+rng.IntN(1<<20))})
	}
	raw := buildTar(t, files)
	if len(raw) < 64<<20 {
		t.Fatalf("layer of %d bytes, want 64 MiB or more", len(raw))
	}
	ix := checkLayer(t, rng, raw, gzipDebian(t, raw, "-6"), DefaultSpan)
	t.Logf("%d MiB layer, %d MiB compressed, %d checkpoints", ix.Size>>20, ix.CompressedSize>>20, len(ix.Checkpoints))
}

func TestLayerCorruptRefused(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	raw, _ := smallLayer(t, rng)
	comp := gzipGo(t, raw, 6)
	for name, c := range map[string][]byte{
		"crc":       append(bytes.Clone(comp[:len(comp)-8]), comp[len(comp)-8]^1, comp[len(comp)-7], comp[len(comp)-6], comp[len(comp)-5], 0, 0, 0, 0),
		"truncated": comp[:len(comp)/2],
		"trailing":  append(bytes.Clone(comp), 'x', 'y'),
		"method":    append([]byte{0x1f, 0x8b, 7}, comp[3:]...),
	} {
		if _, err := Build(context.Background(), bytes.NewReader(c), Options{Layer: name}); err == nil {
			t.Errorf("%s: corrupt layer indexed", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	if _, err := Build(context.Background(), bytes.NewReader(comp), Options{Span: MinSpan, CheckpointBudget: 1 << 20}); err == nil || !strings.Contains(err.Error(), "budget") {
		t.Errorf("checkpoints over a 1 MiB budget: %v", err)
	}
	hostile := buildTar(t, []member{{"../escape", []byte("x")}})
	if _, err := Build(context.Background(), bytes.NewReader(gzipGo(t, hostile, 6)), Options{Layer: "hostile"}); err == nil {
		t.Errorf("a tar entry ../escape was indexed")
	}
}

func TestEncodeRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	raw, _ := smallLayer(t, rng)
	for _, comp := range [][]byte{gzipGo(t, raw, 9), raw} {
		ix, err := Build(context.Background(), bytes.NewReader(comp), Options{Span: MinSpan})
		if err != nil {
			t.Fatal(err)
		}
		b, err := ix.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, ix) {
			t.Fatalf("decoded index differs")
		}
		t.Logf("%s layer of %d bytes: index of %d bytes, %d checkpoints, digest %s", ix.Format, ix.Size, len(b), len(ix.Checkpoints), fmt.Sprintf("sha256:%x", sha256.Sum256(b)))
		for i := 0; i < len(b); i += 1 + len(b)/200 {
			c := bytes.Clone(b)
			c[i] ^= 0x40
			if _, err := Decode(bytes.NewReader(c)); err == nil {
				t.Fatalf("flipped byte %d decoded", i)
			}
		}
		if _, err := Decode(bytes.NewReader(b[:len(b)-1])); err == nil {
			t.Fatal("truncated index decoded")
		}
	}
}

func TestChunkDigests(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	raw := buildTar(t, []member{{"a", testData(rng, 3<<20)}, {"b", testData(rng, 200<<10)}})
	for _, blob := range [][]byte{raw, gzipGo(t, raw, 6)} {
		ix, err := Build(context.Background(), bytes.NewReader(blob), Options{ChunkSize: MinChunkSize, Layer: "t"})
		if err != nil {
			t.Fatal(err)
		}
		if want := (int64(len(blob)) + MinChunkSize - 1) / MinChunkSize; ix.NumChunks() != want || int64(len(ix.Chunks)) != want {
			t.Fatalf("%d chunks (%d digests), want %d", ix.NumChunks(), len(ix.Chunks), want)
		}
		for i := int64(0); i < ix.NumChunks(); i++ {
			s, e := ix.ChunkRange(i)
			if err := ix.VerifyChunk(i, blob[s:e]); err != nil {
				t.Fatalf("chunk %d: %v", i, err)
			}
			bad := bytes.Clone(blob[s:e])
			bad[rng.IntN(len(bad))] ^= 1
			if err := ix.VerifyChunk(i, bad); !errors.Is(err, ErrChunkDigest) {
				t.Fatalf("altered chunk %d: %v, want ErrChunkDigest", i, err)
			}
			if err := ix.VerifyChunk(i, blob[s:e-1]); !errors.Is(err, ErrChunkDigest) {
				t.Fatalf("short chunk %d: %v, want ErrChunkDigest", i, err)
			}
		}
		enc, err := ix.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		back, err := Decode(bytes.NewReader(enc))
		if err != nil {
			t.Fatal(err)
		}
		if back.ChunkSize != ix.ChunkSize || !reflect.DeepEqual(back.Chunks, ix.Chunks) {
			t.Fatal("chunk digests changed in a round trip")
		}
	}
	if _, err := Build(context.Background(), bytes.NewReader(raw), Options{ChunkSize: 3 << 20}); err == nil || !strings.Contains(err.Error(), "chunk size") {
		t.Fatalf("chunk size 3 MiB: %v, want a chunk size error", err)
	}
}

// withSpan returns the encoded index enc with its span field set to span
// and the header's length and checksum made to match: what an index
// artifact written by someone else may carry.
func withSpan(t testing.TB, enc []byte, span uint64) []byte {
	t.Helper()
	p := enc[encHeaderSize:]
	at := 1       // format
	for range 2 { // digest, diffID
		n, k := binary.Uvarint(p[at:])
		at += k + int(n)
	}
	for range 2 { // compressed size, size
		_, k := binary.Uvarint(p[at:])
		at += k
	}
	_, k := binary.Uvarint(p[at:])
	np := append(binary.AppendUvarint(bytes.Clone(p[:at]), span), p[at+k:]...)
	h := bytes.Clone(enc[:encHeaderSize])
	binary.LittleEndian.PutUint64(h[16:], uint64(len(np)))
	binary.LittleEndian.PutUint32(h[24:], crc32.Checksum(np, castagnoli))
	return append(h, np...)
}

// TestDecodeRefusesLargeSpan: an index whose span is over MaxSpan is
// refused by Decode (and so as an artifact or a node cache entry), naming
// the span and the bound, even when its checkpoints are closer; one at
// the default span and at MaxSpan itself decodes.
func TestDecodeRefusesLargeSpan(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	raw, _ := smallLayer(t, rng)
	ix, err := Build(context.Background(), bytes.NewReader(gzipGo(t, raw, 6)), Options{})
	if err != nil {
		t.Fatal(err)
	}
	enc, err := ix.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for _, span := range []uint64{DefaultSpan, MaxSpan} {
		if got, err := Decode(bytes.NewReader(withSpan(t, enc, span))); err != nil || got.Span != int64(span) {
			t.Fatalf("span %d: %v", span, err)
		}
	}
	for _, span := range []uint64{MaxSpan + 1, 64 << 20, 1 << 30} {
		_, err := Decode(bytes.NewReader(withSpan(t, enc, span)))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("checkpoint span %d, at most %d", span, 16<<20)) {
			t.Errorf("span %d: %v, want ErrInvalid naming the span and the 16 MiB bound", span, err)
		}
	}
	big := *ix
	big.Span = 64 << 20
	if _, err := big.MarshalBinary(); err == nil {
		t.Error("an index of span 64 MiB encoded")
	}
	if _, err := Build(context.Background(), bytes.NewReader(gzipGo(t, raw, 6)), Options{Span: 64 << 20}); err == nil {
		t.Error("Build with span 64 MiB succeeded")
	}
}

// cancelAfter counts what is written to it and cancels a context once n
// bytes have arrived.
type cancelAfter struct {
	n, total int64
	cancel   context.CancelFunc
}

func (w *cancelAfter) Write(p []byte) (int, error) {
	w.total += int64(len(p))
	if w.total >= w.n {
		w.cancel()
	}
	return len(p), nil
}

// TestReaderStopsWhenContextDone: a range read whose context ends while it
// inflates a large span, with all the compressed bytes at hand, stops
// within a few hundred KiB of output with the context's error instead of
// inflating the rest of the span; ReadAt with a context already done
// inflates nothing.
func TestReaderStopsWhenContextDone(t *testing.T) {
	// 15 MiB of zeros deflate to a few KiB: the whole span is one chunk.
	raw := buildTar(t, []member{{"zeros", make([]byte, 15<<20)}})
	comp := gzipGo(t, raw, 9)
	ix, err := Build(context.Background(), bytes.NewReader(comp), Options{Span: MaxSpan})
	if err != nil {
		t.Fatal(err)
	}
	if len(ix.Checkpoints) != 1 {
		t.Fatalf("%d checkpoints, want one span", len(ix.Checkpoints))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cp := &ix.Checkpoints[0]
	r, err := ix.NewReader(ctx, cp, bytes.NewReader(comp[cp.CompressedStart():]))
	if err != nil {
		t.Fatal(err)
	}
	w := &cancelAfter{n: 1 << 20, cancel: cancel}
	_, err = io.Copy(w, r)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("read cancelled after 1 MiB: %v after %d bytes, want context.Canceled", err, w.total)
	}
	t.Logf("cancelled at %d bytes of output, stopped at %d", w.n, w.total)
	if w.total > 2<<20 {
		t.Fatalf("%d bytes inflated after cancelling at 1 MiB of a %d-byte span", w.total, ix.Size)
	}
	// The reader stays stopped.
	if n, err := r.Read(make([]byte, 10)); n != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("read after the stop: %d, %v", n, err)
	}

	done, cancel2 := context.WithCancel(context.Background())
	cancel2()
	p := make([]byte, 4096)
	if n, err := ix.ReadAt(done, bytes.NewReader(comp), p, ix.Size-8192); n != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("ReadAt with a done context: %d, %v", n, err)
	}
	if _, err := ix.ReadAt(context.Background(), bytes.NewReader(comp), p, ix.Size-8192); err != nil || !bytes.Equal(p, raw[ix.Size-8192:ix.Size-4096]) {
		t.Fatalf("ReadAt: %v", err)
	}
}
