package indextest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"golang.org/x/sys/unix"
)

// LayerSpec describes one overlay layer directory in a compact text form,
// one entry per line:
//
//	d PATH MODE [opaque]      directory
//	f PATH MODE CONTENT       regular file ("-" for empty)
//	l PATH TARGET             symlink
//	h PATH TARGET             hard link to TARGET of the same layer
//	w PATH                    whiteout (character device 0:0)
//	c PATH MAJ MIN / b ... / p PATH / s PATH   devices, fifo, socket
//	x PATH NAME VALUE         xattr
type LayerSpec string

var testEpoch = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

// buildLayer creates a layer directory from spec with fixed times.
func buildLayer(t testing.TB, dir string, spec LayerSpec) {
	t.Helper()
	Must(t, os.MkdirAll(dir, 0o755))
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
			Must(t, os.MkdirAll(p, 0o755))
			Must(t, os.Chmod(p, os.FileMode(mode)|modeBits(mode)))
			if len(f) > 3 && f[3] == "opaque" {
				testenv.Root(t, "an opaque directory (trusted.overlay.opaque)")
				Must(t, unix.Lsetxattr(p, "trusted.overlay.opaque", []byte("y"), 0))
			}
		case "f":
			c := f[3]
			if c == "-" {
				c = ""
			}
			WriteFile(t, p, []byte(c), os.FileMode(mode)|modeBits(mode))
		case "l":
			Must(t, os.Symlink(f[2], p))
		case "h":
			Must(t, os.Link(filepath.Join(dir, f[2]), p))
		case "w":
			testenv.Root(t, "a whiteout (character device 0:0)")
			Must(t, unix.Mknod(p, unix.S_IFCHR, 0))
		case "c", "b":
			testenv.Root(t, "a device node")
			var maj, mnr uint32
			fmt.Sscanf(f[2]+" "+f[3], "%d %d", &maj, &mnr)
			k := uint32(unix.S_IFCHR)
			if f[0] == "b" {
				k = unix.S_IFBLK
			}
			Must(t, unix.Mknod(p, k|0o640, int(unix.Mkdev(maj, mnr))))
		case "p":
			Must(t, unix.Mkfifo(p, 0o644))
		case "s":
			Must(t, unix.Mknod(p, unix.S_IFSOCK|0o755, 0))
		case "x":
			if strings.HasPrefix(f[2], "trusted.") {
				testenv.Root(t, "a trusted.* xattr")
			}
			Must(t, unix.Lsetxattr(p, f[2], []byte(f[3]), 0))
			continue
		default:
			t.Fatalf("bad spec line %q", line)
		}
		paths = append(paths, p)
	}
	// Fixed times, deepest first so directory mtimes stick.
	for i := len(paths) - 1; i >= 0; i-- {
		tm := unix.NsecToTimespec(testEpoch.UnixNano() + int64(i)*1001)
		Must(t, unix.UtimesNanoAt(unix.AT_FDCWD, paths[i], []unix.Timespec{tm, tm}, unix.AT_SYMLINK_NOFOLLOW))
	}
	tm := unix.NsecToTimespec(testEpoch.UnixNano())
	Must(t, unix.UtimesNanoAt(unix.AT_FDCWD, dir, []unix.Timespec{tm, tm}, unix.AT_SYMLINK_NOFOLLOW))
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

// OverlayLayers is a three-layer stack exercising every overlay rule.
var OverlayLayers = []LayerSpec{`
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

// BuildLayers creates one layer directory per spec, each a snapshot's "fs"
// directory as containerd's overlayfs snapshotter lays them out, and
// returns their paths, lowest first.
func BuildLayers(t testing.TB, specs []LayerSpec) []string {
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

// Comparable projects an entry onto what must agree between two indexes of
// the same tree read from different places, such as our merge and the
// kernel's overlay mount: not where data lives, not the inode number, and
// not the atime, which reading moves.
func Comparable(e index.Entry) index.Entry {
	e.Atime = index.Timespec{}
	e.Data = index.Data{}
	e.Ino = 0
	if e.Xattrs == nil {
		e.Xattrs = []index.Xattr{}
	}
	return e
}
