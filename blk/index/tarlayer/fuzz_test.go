package tarlayer

import (
	"bytes"
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
)

// FuzzLayerTar reads hostile layer tars. The input is the tar with every
// run of zero bytes written as a 0x00 byte and the run's length minus one
// (see expandZeros): a tar is mostly zeros (512-byte headers, padding, a
// 1 KiB trailer), and fed raw, the fuzzing engine spent its whole time
// minimizing multi-kilobyte inputs, which costs it quadratic time in their
// size, and made about one execution per second. An
// execution takes microseconds; nothing a layer drives here was slow. Every
// tar can still be written this way, so no input is out of reach.
func FuzzLayerTar(f *testing.F) {
	for _, b := range indextest.FuzzSeedTars(f) {
		f.Add(squeezeZeros(b))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		data := expandZeros(in)
		fuzzTarOne(t, data)
		// Header checksums reject nearly every mutation; also try the input
		// with the checksum of each ustar-looking block repaired.
		fixed := bytes.Clone(data)
		changed := false
		for off := 0; off+512 <= len(fixed); off += 512 {
			blk := fixed[off : off+512]
			if string(blk[257:262]) != "ustar" {
				continue
			}
			before := string(blk[148:156])
			copy(blk[148:156], "        ")
			sum := 0
			for _, c := range blk {
				sum += int(c)
			}
			copy(blk[148:156], fmt.Sprintf("%06o\x00 ", sum))
			changed = changed || before != string(blk[148:156])
		}
		if changed {
			fuzzTarOne(t, fixed)
		}
	})
}

// expandZeros undoes squeezeZeros: 0x00 followed by n stands for n+1 zero
// bytes (a 0x00 at the very end for one).
func expandZeros(in []byte) []byte {
	out := make([]byte, 0, 4*len(in))
	for i := 0; i < len(in); i++ {
		if in[i] != 0 {
			out = append(out, in[i])
			continue
		}
		n := 1
		if i+1 < len(in) {
			i++
			n += int(in[i])
		}
		out = append(out, make([]byte, n)...)
	}
	return out
}

// squeezeZeros writes b's runs of zero bytes as 0x00 and the run's length
// minus one, at most 256 at a time.
func squeezeZeros(b []byte) []byte {
	var out []byte
	for i := 0; i < len(b); {
		if b[i] != 0 {
			out = append(out, b[i])
			i++
			continue
		}
		n := 0
		for i+n < len(b) && b[i+n] == 0 && n < 256 {
			n++
		}
		out = append(out, 0, byte(n-1))
		i += n
	}
	return out
}

func fuzzTarOne(t *testing.T, data []byte) {
	src := index.Source{Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("0", 64)}
	{
		ix, err := Read(context.Background(), bytes.NewReader(data), src, 5000, "fuzz")
		if err != nil {
			return
		}
		if err := ix.ValidateLayer(); err != nil {
			t.Fatalf("accepted layer yields an invalid index: %v", err)
		}
		for _, e := range ix.Entries {
			if e.Type == index.TypeRegular && (e.Data.Offset < 0 || e.Data.Offset+e.Size > int64(len(data))) {
				t.Fatalf("%q: data [%d,+%d) outside the %d-byte tar", e.Path, e.Data.Offset, e.Size, len(data))
			}
		}
		var buf bytes.Buffer
		indextest.Must(t, index.EncodeLayer(&buf, ix))
		dec, err := index.DecodeLayer(&buf)
		if err != nil {
			t.Fatalf("layer index does not decode: %v", err)
		}
		if !reflect.DeepEqual(indextest.Normalize(dec), indextest.Normalize(ix)) {
			t.Fatal("layer index round trip differs")
		}
		m, err := overlayfs.Merge(context.Background(), []*index.Index{ix}, []string{"fuzz"}, 5000)
		if err == nil {
			if err := m.Validate(); err != nil {
				t.Fatalf("merged index invalid: %v", err)
			}
		}
	}
}

// TestSqueezeZerosRoundTrip checks that every seed tar survives the fuzz
// input encoding unchanged and shrinks.
func TestSqueezeZerosRoundTrip(t *testing.T) {
	for i, b := range indextest.FuzzSeedTars(t) {
		s := squeezeZeros(b)
		if !bytes.Equal(expandZeros(s), b) {
			t.Fatalf("seed %d does not round-trip", i)
		}
		if len(b) > 0 && len(s)*4 > len(b) {
			t.Errorf("seed %d: %d bytes squeezed to %d", i, len(b), len(s))
		}
	}
	if got := expandZeros([]byte{'a', 0, 2, 'b', 0}); !bytes.Equal(got, []byte{'a', 0, 0, 0, 'b', 0}) {
		t.Errorf("expandZeros: %q", got)
	}
}
