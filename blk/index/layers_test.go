package index

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// layerSpec describes one overlay layer directory in a compact text form,
// one entry per line:
//
//	d PATH MODE [opaque]      directory
//	f PATH MODE CONTENT       regular file ("-" for empty)
//	l PATH TARGET             symlink
//	h PATH TARGET             hard link to TARGET of the same layer
//	w PATH                    whiteout (character device 0:0)
//	c PATH MAJ MIN / b ... / p PATH / s PATH   devices, fifo, socket
//	x PATH NAME VALUE         xattr
type layerSpec string

var testEpoch = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

// buildLayer creates a layer directory from spec with fixed times.
func buildLayer(t testing.TB, dir string, spec layerSpec) {
	t.Helper()
	must(t, os.MkdirAll(dir, 0o755))
	var paths []string
	for _, line := range strings.Split(strings.TrimSpace(string(spec)), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		p := filepath.Join(dir, f[1])
		var mode uint64
		if len(f) > 2 {
			fmt.Sscanf(f[2], "%o", &mode)
		}
		switch f[0] {
		case "d":
			must(t, os.MkdirAll(p, 0o755))
			must(t, os.Chmod(p, os.FileMode(mode)|modeBits(mode)))
			if len(f) > 3 && f[3] == "opaque" {
				must(t, unix.Lsetxattr(p, "trusted.overlay.opaque", []byte("y"), 0))
			}
		case "f":
			c := f[3]
			if c == "-" {
				c = ""
			}
			writeFile(t, p, []byte(c), os.FileMode(mode)|modeBits(mode))
		case "l":
			must(t, os.Symlink(f[2], p))
		case "h":
			must(t, os.Link(filepath.Join(dir, f[2]), p))
		case "w":
			must(t, unix.Mknod(p, unix.S_IFCHR, 0))
		case "c", "b":
			var maj, mnr uint32
			fmt.Sscanf(f[2]+" "+f[3], "%d %d", &maj, &mnr)
			k := uint32(unix.S_IFCHR)
			if f[0] == "b" {
				k = unix.S_IFBLK
			}
			must(t, unix.Mknod(p, k|0o640, int(unix.Mkdev(maj, mnr))))
		case "p":
			must(t, unix.Mkfifo(p, 0o644))
		case "s":
			must(t, unix.Mknod(p, unix.S_IFSOCK|0o755, 0))
		case "x":
			must(t, unix.Lsetxattr(p, f[2], []byte(f[3]), 0))
			continue
		default:
			t.Fatalf("bad spec line %q", line)
		}
		paths = append(paths, p)
	}
	// Fixed times, deepest first so directory mtimes stick.
	for i := len(paths) - 1; i >= 0; i-- {
		tm := unix.NsecToTimespec(testEpoch.UnixNano() + int64(i)*1001)
		must(t, unix.UtimesNanoAt(unix.AT_FDCWD, paths[i], []unix.Timespec{tm, tm}, unix.AT_SYMLINK_NOFOLLOW))
	}
	tm := unix.NsecToTimespec(testEpoch.UnixNano())
	must(t, unix.UtimesNanoAt(unix.AT_FDCWD, dir, []unix.Timespec{tm, tm}, unix.AT_SYMLINK_NOFOLLOW))
}

// modeBits turns the setuid/setgid/sticky octal bits into os.FileMode bits.
func modeBits(m uint64) os.FileMode {
	var o os.FileMode
	if m&0o4000 != 0 {
		o |= os.ModeSetuid
	}
	if m&0o2000 != 0 {
		o |= os.ModeSetgid
	}
	if m&0o1000 != 0 {
		o |= os.ModeSticky
	}
	return o
}

// overlayLayers is a three-layer stack exercising every overlay rule.
var overlayLayers = []layerSpec{`
d a 755
f a/x 644 ax
f a/y 644 ay
d a/sub 700
f a/sub/z 600 z
f a-b 644 dash
f b 644 b-file
d c 755
f c/1 644 c1
l d a/x
d e 755
f e/keep 644 keep
d e/deep 755
f e/deep/q 644 q
f hl1 644 linked
h hl2 hl1
h a/hl3 hl1
f f 4755 suid
d g 1777
f g/old 644 old
f wipe 644 wipe
w lowest-whiteout
d dev 755
c dev/null 1 3
b dev/blk 7 0
p dev/fifo
s dev/sock
x a user.one 1
x a/x user.k v1
`, `
d a 750
w a/x
f a/new 644 anew
d b 755
f b/inside 644 inside
f c 600 c-file
d e 711 opaque
f e/new 644 enew
d g 1777
f g/added 644 added
w f
h hl2 f
f n1 644 n
h n2 n1
d wipe 700 opaque
f wipe/in 644 in
x a/new user.k v2
`, `
w c
d a 755
d a/sub 755 opaque
l b a
d e 711
f e/deep2 644 deep2
w e/new
f hl1 644 replaced
d h 755
d h/i 755
f h/i/j 644 j
`}

func buildLayers(t testing.TB, specs []layerSpec) []string {
	t.Helper()
	base := t.TempDir()
	var dirs []string
	for i, s := range specs {
		d := filepath.Join(base, fmt.Sprintf("snap%d", i+1), "fs")
		buildLayer(t, d, s)
		dirs = append(dirs, d)
	}
	return dirs
}

// mountOverlay mounts layers read-only with the kernel's overlayfs and
// returns the mount point, or skips the test when that is not possible.
func mountOverlay(t *testing.T, layers []string) string {
	t.Helper()
	mnt := t.TempDir()
	var lower []string
	for i := len(layers) - 1; i >= 0; i-- {
		lower = append(lower, layers[i])
	}
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(lower, ":")); err != nil {
		t.Skipf("cannot mount overlayfs here (%v); the merge is not compared with the kernel", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	return mnt
}

// comparable projects an entry onto what must agree between our merge and
// an index of the kernel's overlay mount (the mount has its own source,
// and reading it moves atimes).
func comparable(e Entry) Entry {
	e.Atime = Timespec{}
	e.Data = Data{}
	e.Ino = 0
	if e.Xattrs == nil {
		e.Xattrs = []Xattr{}
	}
	return e
}

func TestFromLayersMatchesKernelOverlay(t *testing.T) {
	layers := buildLayers(t, overlayLayers)
	ix, err := FromLayers(context.Background(), layers, Options{})
	must(t, err)
	must(t, ix.Validate())
	mnt := mountOverlay(t, layers)
	kix, err := FromDir(context.Background(), mnt, Options{})
	must(t, err)
	got := map[string]Entry{}
	for _, e := range ix.Entries {
		got[e.Path] = comparable(e)
	}
	for _, ke := range kix.Entries {
		e, ok := got[ke.Path]
		if !ok {
			t.Errorf("%q in kernel overlay, missing from merge", ke.Path)
			continue
		}
		delete(got, ke.Path)
		ke = comparable(ke)
		if ke.Type == TypeDir {
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
	checkContents(t, ix, HostOpener{}, func(p string) ([]byte, error) { return os.ReadFile(filepath.Join(mnt, p)) })
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
	layers := buildLayers(t, overlayLayers)
	ix, err := FromLayers(context.Background(), layers, Options{})
	must(t, err)
	want := map[string]Type{
		"a": TypeDir, "a/new": TypeRegular, "a/y": TypeRegular, "a/sub": TypeDir, "b": TypeSymlink,
		"e/deep2": TypeRegular, "hl1": TypeRegular, "a/hl3": TypeRegular, "n1": TypeRegular,
		"n2": TypeHardlink, "wipe": TypeDir, "wipe/in": TypeRegular, "h/i/j": TypeRegular,
		"dev/null": TypeChar, "dev/blk": TypeBlock, "dev/fifo": TypeFifo, "dev/sock": TypeSocket,
		"g/old": TypeRegular, "g/added": TypeRegular, "a-b": TypeRegular,
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
	layers := buildLayers(t, overlayLayers)
	cache := t.TempDir()
	var st1, st2 Stats
	ix1, err := FromLayers(context.Background(), layers, Options{CacheDir: cache, Stats: &st1})
	must(t, err)
	ix2, err := FromLayers(context.Background(), layers, Options{CacheDir: cache, Stats: &st2})
	must(t, err)
	if st1.LayersIndexed != 3 || st1.LayersCached != 0 || st2.LayersIndexed != 0 || st2.LayersCached != 3 {
		t.Fatalf("first %+v, second %+v: the second call must not walk", st1, st2)
	}
	if !reflect.DeepEqual(normalize(ix1), normalize(ix2)) {
		t.Fatal("cached merge differs from the walked one")
	}
	// A changed top-level directory (new ctime) invalidates its entry.
	writeFile(t, filepath.Join(layers[2], "later"), []byte("x"), 0o644)
	var st3 Stats
	ix3, err := FromLayers(context.Background(), layers, Options{CacheDir: cache, Stats: &st3})
	must(t, err)
	if st3.LayersIndexed != 1 || st3.LayersCached != 2 || ix3.Lookup("later") < 0 {
		t.Fatalf("after change: %+v", st3)
	}
	// Caller keys take precedence over the stat stamp.
	keys := []string{"k1", "k2", "k3"}
	var st4, st5 Stats
	_, err = FromLayers(context.Background(), layers, Options{CacheDir: cache, LayerKeys: keys, Stats: &st4})
	must(t, err)
	_, err = FromLayers(context.Background(), layers, Options{CacheDir: cache, LayerKeys: keys, Stats: &st5})
	must(t, err)
	if st4.LayersIndexed != 3 || st5.LayersCached != 3 {
		t.Fatalf("keyed: %+v then %+v", st4, st5)
	}
	// Damaged cache files are misses, never errors or wrong results.
	files, err := filepath.Glob(filepath.Join(cache, "index", "*.idx"))
	must(t, err)
	if len(files) == 0 {
		t.Fatal("no cache files written")
	}
	for i, f := range files {
		b, err := os.ReadFile(f)
		must(t, err)
		switch i % 3 {
		case 0:
			b[len(b)/2] ^= 0x40
		case 1:
			b = b[:len(b)/2]
		default:
			b = []byte("garbage")
		}
		must(t, os.WriteFile(f, b, 0o600))
	}
	var st6 Stats
	ix6, err := FromLayers(context.Background(), layers, Options{CacheDir: cache, Stats: &st6})
	must(t, err)
	if st6.LayersIndexed != 3 || !reflect.DeepEqual(normalize(ix3), normalize(ix6)) {
		t.Fatalf("after damage: %+v", st6)
	}
}

func TestFromLayersBindRootfs(t *testing.T) {
	root := t.TempDir()
	genTree(t, root, 7, genOptions{random: 300, deep: 20})
	ix, err := FromLayers(context.Background(), []string{root}, Options{})
	must(t, err)
	dix, err := FromDir(context.Background(), root, Options{})
	must(t, err)
	for i := range dix.Entries {
		if dix.Entries[i].Type == TypeSymlink {
			dix.Entries[i].Atime = ix.Entries[i].Atime
		}
	}
	if !reflect.DeepEqual(normalize(ix), normalize(dix)) {
		t.Fatal("a single layer must index like the plain directory")
	}
}

// entriesEqualIgnoringSource compares two indexes entry by entry, ignoring
// where data lives and atimes.
func entriesEqualIgnoringSource(t *testing.T, a, b *Index, ignoreCtime bool) {
	t.Helper()
	if len(a.Entries) != len(b.Entries) {
		var pa, pb []string
		for _, e := range a.Entries {
			pa = append(pa, e.Path)
		}
		for _, e := range b.Entries {
			pb = append(pb, e.Path)
		}
		t.Fatalf("%d vs %d entries:\n%q\n%q", len(a.Entries), len(b.Entries), pa, pb)
	}
	for i := range a.Entries {
		x, y := comparable(a.Entries[i]), comparable(b.Entries[i])
		if ignoreCtime {
			x.Ctime, y.Ctime = Timespec{}, Timespec{}
		}
		if !reflect.DeepEqual(x, y) {
			t.Errorf("entry %d:\n%+v\n%+v", i, x, y)
		}
	}
}
