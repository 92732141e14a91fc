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

func FuzzLayerTar(f *testing.F) {
	for _, b := range indextest.FuzzSeedTars(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
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
