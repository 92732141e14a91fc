package overlayfs

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"golang.org/x/sys/unix"
)

// mountOverlay mounts layers read-only with the kernel's overlayfs and
// returns the mount point. Without root that is a missing prerequisite; as
// root a failure is the test's.
func mountOverlay(t *testing.T, layers []string) string {
	t.Helper()
	testenv.Root(t, "mounting overlayfs to compare the merge with the kernel")
	mnt := t.TempDir()
	var lower []string
	for i := len(layers) - 1; i >= 0; i-- {
		lower = append(lower, layers[i])
	}
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(lower, ":")); err != nil {
		t.Fatalf("mount overlayfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	return mnt
}

func TestFromLayersMatchesKernelOverlay(t *testing.T) {
	layers := indextest.BuildLayers(t, indextest.OverlayLayers)
	ix, err := FromLayers(context.Background(), layers, index.Options{})
	indextest.Must(t, err)
	indextest.Must(t, ix.Validate())
	mnt := mountOverlay(t, layers)
	kix, err := hostfs.FromDir(context.Background(), mnt, index.Options{})
	indextest.Must(t, err)
	got := map[string]index.Entry{}
	for _, e := range ix.Entries {
		got[e.Path] = indextest.Comparable(e)
	}
	for _, ke := range kix.Entries {
		e, ok := got[ke.Path]
		if !ok {
			t.Errorf("%q in kernel overlay, missing from merge", ke.Path)
			continue
		}
		delete(got, ke.Path)
		ke = indextest.Comparable(ke)
		if ke.Type == index.TypeDir {
			// The kernel reports a merged directory's ctime from its upper
			// layer just as we do, but ctime of the mount root is the mount's.
			if ke.Path == "." {
				ke.Ctime = e.Ctime
			}
		}
		if !reflect.DeepEqual(e, ke) {
			t.Errorf("%q:\nmerge  %+v\nkernel %+v", e.Path, e, ke)
		}
	}
	for p := range got {
		t.Errorf("%q in merge, missing from kernel overlay", p)
	}
	if len(ix.Entries) != len(kix.Entries) {
		t.Errorf("%d entries merged, %d in the kernel overlay", len(ix.Entries), len(kix.Entries))
	}
	// File bytes come from the right layer.
	indextest.CheckContents(t, ix, hostfs.Opener{}, func(p string) ([]byte, error) { return os.ReadFile(filepath.Join(mnt, p)) })
	for _, e := range ix.Entries {
		for _, x := range e.Xattrs {
			if strings.HasPrefix(x.Name, "trusted.overlay.") {
				t.Errorf("%q keeps overlay xattr %s", e.Path, x.Name)
			}
		}
	}
}

// TestFromLayersSemantics pins the overlay rules independently of the kernel.
func TestFromLayersSemantics(t *testing.T) {
	layers := indextest.BuildLayers(t, indextest.OverlayLayers)
	ix, err := FromLayers(context.Background(), layers, index.Options{})
	indextest.Must(t, err)
	want := map[string]index.Type{
		"a": index.TypeDir, "a/new": index.TypeRegular, "a/y": index.TypeRegular, "a/sub": index.TypeDir, "b": index.TypeSymlink,
		"e/deep2": index.TypeRegular, "hl1": index.TypeRegular, "a/hl3": index.TypeRegular, "n1": index.TypeRegular,
		"n2": index.TypeHardlink, "wipe": index.TypeDir, "wipe/in": index.TypeRegular, "h/i/j": index.TypeRegular,
		"dev/null": index.TypeChar, "dev/blk": index.TypeBlock, "dev/fifo": index.TypeFifo, "dev/sock": index.TypeSocket,
		"g/old": index.TypeRegular, "g/added": index.TypeRegular, "a-b": index.TypeRegular,
	}
	for p, ty := range want {
		i := ix.Lookup(p)
		if i < 0 {
			t.Errorf("%q missing", p)
			continue
		}
		if ix.Entries[i].Type != ty {
			t.Errorf("%q is %s, want %s", p, ix.Entries[i].Type, ty)
		}
	}
	for _, p := range []string{"a/x", "a/sub/z", "b/inside", "c", "c/1", "e/keep", "e/deep", "e/new", "f", "hl2", "lowest-whiteout"} {
		if ix.Lookup(p) >= 0 {
			t.Errorf("%q should be hidden", p)
		}
	}
	// hl1 was replaced in layer 3 and hl2 whited out, so a/hl3 (the first
	// name of that inode in layer 0) alone keeps the old inode.
	if e := ix.Entries[ix.Lookup("a/hl3")]; e.Data.Source != 0 || e.Data.Path != "a/hl3" {
		t.Errorf("a/hl3 data %+v, want layer 0 a/hl3", e.Data)
	}
	if e := ix.Entries[ix.Lookup("hl1")]; e.Data.Source != 2 {
		t.Errorf("hl1 data %+v, want layer 2", e.Data)
	}
	if e := ix.Entries[ix.Lookup("n2")]; e.Linkname != "n1" {
		t.Errorf("n2 links to %q", e.Linkname)
	}
	if e := ix.Entries[ix.Lookup("a")]; e.Mode != 0o755 || len(e.Xattrs) != 0 {
		t.Errorf("a: mode %o xattrs %v: upper directory metadata must win", e.Mode, e.Xattrs)
	}
	if e := ix.Entries[ix.Lookup("g")]; e.Mode != 0o1777 {
		t.Errorf("g mode %o", e.Mode)
	}
}

func TestFromLayersCache(t *testing.T) {
	layers := indextest.BuildLayers(t, indextest.OverlayLayers)
	cache := t.TempDir()
	keys := []string{"k1", "k2", "k3"}
	var st1, st2 index.Stats
	ix1, err := FromLayers(context.Background(), layers, index.Options{CacheDir: cache, LayerKeys: keys, Stats: &st1})
	indextest.Must(t, err)
	ix2, err := FromLayers(context.Background(), layers, index.Options{CacheDir: cache, LayerKeys: keys, Stats: &st2})
	indextest.Must(t, err)
	if st1.LayersIndexed != 3 || st1.LayersCached != 0 || st2.LayersIndexed != 0 || st2.LayersCached != 3 {
		t.Fatalf("first %+v, second %+v: the second call must not walk", st1, st2)
	}
	if !reflect.DeepEqual(indextest.Normalize(ix1), indextest.Normalize(ix2)) {
		t.Fatal("cached merge differs from the walked one")
	}
	// A keyed layer whose directory was replaced (new ctime) is a miss.
	indextest.WriteFile(t, filepath.Join(layers[2], "later"), []byte("x"), 0o644)
	var st3 index.Stats
	ix3, err := FromLayers(context.Background(), layers, index.Options{CacheDir: cache, LayerKeys: keys, Stats: &st3})
	indextest.Must(t, err)
	if st3.LayersIndexed != 1 || st3.LayersCached != 2 || ix3.Lookup("later") < 0 {
		t.Fatalf("after change: %+v", st3)
	}
	// Layers without a key (the upper one here) are walked every time.
	var st4, st5 index.Stats
	part := []string{"k1", "k2", ""}
	_, err = FromLayers(context.Background(), layers, index.Options{CacheDir: cache, LayerKeys: part, Stats: &st4})
	indextest.Must(t, err)
	_, err = FromLayers(context.Background(), layers, index.Options{CacheDir: cache, Stats: &st5})
	indextest.Must(t, err)
	if st4.LayersIndexed != 1 || st4.LayersCached != 2 || st5.LayersIndexed != 3 || st5.LayersCached != 0 {
		t.Fatalf("unkeyed: %+v then %+v", st4, st5)
	}
	// Damaged cache files are misses, never errors or wrong results.
	files, err := filepath.Glob(filepath.Join(cache, "index", "*.idx"))
	indextest.Must(t, err)
	if len(files) == 0 {
		t.Fatal("no cache files written")
	}
	for i, f := range files {
		b, err := os.ReadFile(f)
		indextest.Must(t, err)
		switch i % 3 {
		case 0:
			b[len(b)/2] ^= 0x40
		case 1:
			b = b[:len(b)/2]
		default:
			b = []byte("garbage")
		}
		indextest.Must(t, os.WriteFile(f, b, 0o600))
	}
	var st6 index.Stats
	ix6, err := FromLayers(context.Background(), layers, index.Options{CacheDir: cache, LayerKeys: keys, Stats: &st6})
	indextest.Must(t, err)
	if st6.LayersIndexed != 3 || !reflect.DeepEqual(indextest.Normalize(ix3), indextest.Normalize(ix6)) {
		t.Fatalf("after damage: %+v", st6)
	}
}

func TestFromLayersBindRootfs(t *testing.T) {
	root := t.TempDir()
	indextest.GenTree(t, root, 7, indextest.GenOptions{Random: 300, Deep: 20})
	ix, err := FromLayers(context.Background(), []string{root}, index.Options{})
	indextest.Must(t, err)
	dix, err := hostfs.FromDir(context.Background(), root, index.Options{})
	indextest.Must(t, err)
	for i := range dix.Entries {
		if dix.Entries[i].Type == index.TypeSymlink {
			dix.Entries[i].Atime = ix.Entries[i].Atime
		}
	}
	if !reflect.DeepEqual(indextest.Normalize(ix), indextest.Normalize(dix)) {
		t.Fatal("a single layer must index like the plain directory")
	}
}

func TestFromDirRejectsEntryLimitInLayers(t *testing.T) {
	d := t.TempDir()
	for i := range 20 {
		indextest.WriteFile(t, filepath.Join(d, fmt.Sprint(i)), nil, 0o644)
	}
	if _, err := FromLayers(context.Background(), []string{d}, index.Options{MaxEntries: 10}); err == nil {
		t.Fatal("limit ignored")
	}
	if _, err := FromLayers(context.Background(), []string{d, d}, index.Options{LayerKeys: []string{"x"}}); err == nil {
		t.Fatal("key count mismatch accepted")
	}
	if _, err := FromLayers(context.Background(), []string{filepath.Join(d, "nope")}, index.Options{}); !os.IsNotExist(unwrapAll(err)) {
		t.Fatalf("missing layer: %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok || u.Unwrap() == nil {
			return err
		}
		err = u.Unwrap()
	}
}

// TestFromLayersCacheSeesNestedEdits reproduces the stale layer-index
// cache: a layer directory without a caller key (an upperdir, a bind
// rootfs) was cached under its top directory's path, inode and ctime, so
// a nested file rewritten from "v1" to "longer-content" read back as
// "lon" and a new nested file was missing. Such a layer is mutable and
// must be walked again every time.
func TestFromLayersCacheSeesNestedEdits(t *testing.T) {
	root := t.TempDir()
	f := filepath.Join(root, "etc", "app", "conf")
	indextest.Must(t, os.MkdirAll(filepath.Dir(f), 0o755))
	indextest.WriteFile(t, f, []byte("v1"), 0o644)
	cache := t.TempDir()
	op := hostfs.Opener{CacheDir: cache}
	ix, err := FromLayers(context.Background(), []string{root}, index.Options{CacheDir: cache})
	indextest.Must(t, err)
	if got := string(indextest.ReadEntry(t, ix, op, indextest.Lookup(t, ix, "etc/app/conf"))); got != "v1" {
		t.Fatalf("first build reads %q", got)
	}
	indextest.WriteFile(t, f, []byte("longer-content"), 0o644)
	indextest.WriteFile(t, filepath.Join(root, "etc", "app", "new"), []byte("n"), 0o644)
	var st index.Stats
	ix, err = FromLayers(context.Background(), []string{root}, index.Options{CacheDir: cache, Stats: &st})
	indextest.Must(t, err)
	if got := string(indextest.ReadEntry(t, ix, op, indextest.Lookup(t, ix, "etc/app/conf"))); got != "longer-content" {
		t.Errorf("rebuild after a nested edit reads %q, want %q (stats %+v)", got, "longer-content", st)
	}
	if ix.Lookup("etc/app/new") < 0 {
		t.Errorf("rebuild misses a nested file created since the first build (stats %+v)", st)
	}
	if st.LayersCached != 0 {
		t.Errorf("an unkeyed (mutable) layer was served from the cache: %+v", st)
	}
}
