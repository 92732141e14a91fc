package ext4

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestFromDirIndex runs the whole pipeline with the index package's own
// directory indexer and host opener instead of this package's test walker.
func TestFromDirIndex(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	src := t.TempDir()
	makeTree(t, src, false)
	idx, err := hostfs.FromDir(context.Background(), src, index.Options{})
	if err != nil {
		t.Fatalf("hostfs.FromDir: %v", err)
	}
	img, err := Build(context.Background(), idx, Options{Time: time.Unix(testTime, 0)})
	must(t, err)
	defer img.Close()
	raw := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(raw)
	must(t, err)
	must(t, Export(context.Background(), img, hostfs.Opener{}, f))
	must(t, f.Close())
	fsck(t, raw)
	compareTree(t, idx, src, mountRO(t, raw), 4096)
}
