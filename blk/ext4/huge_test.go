package ext4

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// exportMeta writes only the metadata blocks of img: e2fsck never reads
// file data, so this checks terabyte images without a terabyte of reads.
func exportMeta(t testing.TB, img *Image, p string) {
	t.Helper()
	f, err := os.Create(p)
	must(t, err)
	defer f.Close()
	must(t, f.Truncate(int64(img.Map.Blocks())*int64(img.Map.BlockSize())))
	for i := 0; i < img.Map.Len(); i++ {
		if e := img.Map.At(i); e.Kind == blockmap.Meta {
			b := make([]byte, e.Bytes)
			_, err := img.Meta().ReadAt(b, e.Loc.Offset)
			must(t, err)
			_, err = f.WriteAt(b, int64(e.First)*int64(img.Map.BlockSize()))
			must(t, err)
		}
	}
}

// TestTerabyteFile maps a 1 TiB file: 8 000 groups, extents split around
// every backup superblock, a depth-2 extent tree, and bitmaps that must be
// stored once per distinct content to keep the metadata small.
func TestTerabyteFile(t *testing.T) {
	requireTool(t, "e2fsck")
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:00"}}, Entries: []index.Entry{
		{Path: ".", Type: index.TypeDir, Mode: 0o755},
		{Path: "huge", Type: index.TypeRegular, Mode: 0o644, Size: 1<<40 + 1},
		{Path: "small", Type: index.TypeRegular, Mode: 0o644, Size: 5, Data: index.Data{Offset: 1<<40 + 1}},
	}}
	img, err := Build(context.Background(), idx, Options{Time: time.Unix(testTime, 0)})
	must(t, err)
	if img.Manifest.Groups < 8192 || img.Manifest.MetaBytes > 16<<20 {
		t.Errorf("%d groups, %d metadata bytes; want >= 8192 groups in <= 16 MiB", img.Manifest.Groups, img.Manifest.MetaBytes)
	}
	if img.Manifest.DataBytes != 1<<40+6 {
		t.Errorf("data bytes %d, want %d", img.Manifest.DataBytes, int64(1<<40+6))
	}
	raw := filepath.Join(t.TempDir(), "disk.img")
	exportMeta(t, img, raw)
	fsck(t, raw)
	// The last byte of "huge" comes from blob offset 1 TiB.
	found := false
	for i := 0; i < img.Map.Len(); i++ {
		if x := img.Map.At(i); x.Kind == blockmap.Data && x.Loc.Offset+int64(x.Bytes) == 1<<40+1 {
			found = true
		}
	}
	if !found {
		t.Error("no data extent ends at blob offset 1 TiB + 1")
	}
}
