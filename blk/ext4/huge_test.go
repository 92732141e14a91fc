package ext4

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestTerabyteFile maps a 1 TiB file: 8 000 groups, extents split around
// every backup superblock, a depth-2 extent tree, and bitmaps that must be
// stored once per distinct content to keep the metadata small.
func TestTerabyteFile(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:00"}}, Entries: []index.Entry{
		{Path: ".", Type: index.TypeDir, Mode: 0o755},
		{Path: "huge", Type: index.TypeRegular, Mode: 0o644, Size: 1<<40 + 1},
		{Path: "small", Type: index.TypeRegular, Mode: 0o644, Size: 5, Data: index.Data{Offset: 1<<40 + 1}},
	}}
	img, err := Build(context.Background(), idx, Options{Time: time.Unix(testTime, 0)})
	must(t, err)
	defer img.Close()
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
