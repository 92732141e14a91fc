package blk

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/imagestore"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// Two containers of one image, each with its own fresh upper directory,
// serve one entry of the node's image store: the metadata exists once,
// each disk directory holds only its overlay and socket, both disks read
// the same e2fsck-clean filesystem, and a guest write reaches its own
// overlay, never the shared metadata.
func TestDisksShareTheImageStore(t *testing.T) {
	ctx := context.Background()
	lower := t.TempDir()
	for i := 0; i < 50; i++ {
		d := filepath.Join(lower, fmt.Sprintf("dir%d", i%5))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("file%d", i)), bytes.Repeat([]byte{byte(i)}, 3000*i+7), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cache, pods := t.TempDir(), t.TempDir()
	opts := Options{CacheDir: cache, WritableSize: 16 << 20, BlockSize: 4096, Journal: true, JournalSize: 4 << 20}
	var disks []*Disk
	for i := 0; i < 2; i++ {
		upper := t.TempDir() // a container's own, created at its own time
		o := opts
		o.LayerKeys = []string{"committed", ""}
		o.Socket = filepath.Join(pods, fmt.Sprintf("%d.sock", i))
		d, err := Create(ctx, []string{lower, upper}, filepath.Join(pods, fmt.Sprint(i)), o)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Remove()
		disks = append(disks, d)
	}
	if disks[0].Build.Shared || !disks[1].Build.Shared {
		t.Fatalf("build info %+v, %+v: want the first built, the second shared", disks[0].Build, disks[1].Build)
	}
	if disks[0].Build.Index <= 0 || disks[0].Build.Synthesis <= 0 || disks[1].Build.Synthesis != 0 {
		t.Errorf("build times %+v, %+v", disks[0].Build, disks[1].Build)
	}
	store := ImageStoreDir(cache)
	var entries []string
	ents, err := os.ReadDir(store)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			entries = append(entries, e.Name())
		}
	}
	if len(entries) != 1 || !imagestore.ValidKey(entries[0]) {
		t.Fatalf("image store holds %q, want one entry", entries)
	}
	for _, d := range disks {
		names, err := os.ReadDir(d.Dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range names {
			if !strings.HasPrefix(n.Name(), overlayFile) {
				t.Errorf("disk directory %s holds %s: want only its overlay", d.Dir, n.Name())
			}
		}
	}
	meta := filepath.Join(store, entries[0], ext4.MetaFile)
	metaSum := fileSum(t, meta)

	raw0, raw1 := readAll(t, disks[0]), readAll(t, disks[1])
	if !bytes.Equal(raw0, raw1) {
		t.Fatal("two disks of one image read different bytes")
	}
	fsckRaw(t, raw1)
	testenv.Tool(t, "debugfs", "e2fsprogs")
	img := filepath.Join(t.TempDir(), "raw")
	if err := os.WriteFile(img, raw1, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("debugfs", "-R", "cat /dir3/file13", img).Output()
	if err != nil {
		t.Fatalf("debugfs: %v", err)
	}
	if want := bytes.Repeat([]byte{13}, 3000*13+7); !bytes.Equal(out, want) {
		t.Fatalf("/dir3/file13 reads %d bytes, want %d of 13", len(out), len(want))
	}

	// A write to the first disk's superblock: the second disk and the
	// shared metadata file do not see it.
	junk := bytes.Repeat([]byte{0xee}, 4096)
	if _, err := disks[0].Overlay().WriteAt(junk, 0); err != nil {
		t.Fatal(err)
	}
	if err := disks[0].Overlay().Flush(); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, disks[1]); !bytes.Equal(got, raw1) {
		t.Fatal("a write to one disk reached the other")
	}
	if got := readAll(t, disks[0]); !bytes.Equal(got[:4096], junk) {
		t.Fatal("the write did not reach its own disk")
	}
	if fileSum(t, meta) != metaSum {
		t.Fatal("a guest write reached the shared metadata file")
	}

	// Held while served; free once both disks are gone.
	c := imagestore.NodeCache(store)
	list, err := c.Entries(ctx)
	if err != nil || len(list) != 1 || !list[0].InUse {
		t.Fatalf("entries while served: %+v, %v", list, err)
	}
	for _, d := range disks {
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
	}
	if list, err = c.Entries(ctx); err != nil || len(list) != 1 || list[0].InUse {
		t.Fatalf("entries after the disks: %+v, %v", list, err)
	}
	if err := c.Remove(ctx, list[0].Key); err != nil {
		t.Fatal(err)
	}
}

// A fresh upper directory is left out of the index; one with a file, or
// an immutable top layer, is not.
func TestDropEmptyUpper(t *testing.T) {
	lower, upper := t.TempDir(), t.TempDir()
	layers, keys := []string{lower, upper}, []string{"k", ""}
	if l, k := dropEmptyUpper(layers, keys); !slices.Equal(l, []string{lower}) || !slices.Equal(k, []string{"k"}) {
		t.Fatalf("empty upper kept: %q %q", l, k)
	}
	if l, _ := dropEmptyUpper(layers, []string{"k", "k2"}); len(l) != 2 {
		t.Fatal("an immutable top layer was dropped")
	}
	if l, _ := dropEmptyUpper([]string{upper}, []string{""}); len(l) != 1 {
		t.Fatal("the only layer was dropped")
	}
	if err := os.WriteFile(filepath.Join(upper, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if l, _ := dropEmptyUpper(layers, keys); len(l) != 2 {
		t.Fatal("an upper directory with a file was dropped")
	}
}

func readAll(t *testing.T, d *Disk) []byte {
	t.Helper()
	b := make([]byte, d.Overlay().Size())
	if _, err := d.Overlay().ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func fileSum(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// fsckRaw runs e2fsck -fn on a raw filesystem and fails on any complaint.
func fsckRaw(t *testing.T, raw []byte) {
	t.Helper()
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	p := filepath.Join(t.TempDir(), "fs.raw")
	if err := os.WriteFile(p, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("e2fsck", "-fn", p).CombinedOutput()
	if err != nil {
		t.Fatalf("e2fsck -fn: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if l != "" && !strings.HasPrefix(l, "e2fsck ") && !strings.HasPrefix(l, "Pass ") && !strings.Contains(l, " files (") {
			t.Fatalf("e2fsck reported: %q\n%s", l, out)
		}
	}
}
