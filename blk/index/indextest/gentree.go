package indextest

import (
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"golang.org/x/sys/unix"
)

// GenOptions sizes a generated tree.
type GenOptions struct {
	HugeDir  int  // entries of the one huge directory
	Random   int  // randomly placed extra entries
	Deep     int  // depth of the deep chain
	Specials bool // devices, fifos, sockets and xattrs (needs root)
}

// GenResult is what the generator knows independently of the indexer.
type GenResult struct {
	Sparse map[string][]index.Range // expected data segments of sparse files
	Caps   []string                 // files given security.capability
}

// VfsCapV2 is a valid VFS_CAP_REVISION_2 security.capability value
// (cap_net_bind_service, effective).
var VfsCapV2 = []byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x04, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

// GenTree builds a tree under root from a fixed seed with every kind of
// entry hostfs.FromDir must handle.
func GenTree(t testing.TB, root string, seed uint64, o GenOptions) GenResult {
	t.Helper()
	if o.Specials || o.Random > 0 {
		testenv.Root(t, "a generated tree with device nodes or files owned by other users")
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	res := GenResult{Sparse: map[string][]index.Range{}}
	dirs := []string{root}
	mkdir := func(p string, mode os.FileMode) {
		Must(t, os.Mkdir(p, mode))
		Must(t, os.Chmod(p, mode))
		dirs = append(dirs, p)
	}
	// Names that sort differently from plain string order of full paths,
	// non-ASCII and invalid UTF-8, and 255-byte names.
	mkdir(filepath.Join(root, "a"), 0o755)
	WriteFile(t, filepath.Join(root, "a", "x"), []byte("ax"), 0o644)
	WriteFile(t, filepath.Join(root, "a-b"), []byte("a-b"), 0o644)
	WriteFile(t, filepath.Join(root, "a!b"), nil, 0o600)
	WriteFile(t, filepath.Join(root, "a\x01"), []byte{1}, 0o600)
	WriteFile(t, filepath.Join(root, "héllo wörld"), []byte("ü"), 0o644)
	WriteFile(t, filepath.Join(root, "日本語のファイル"), []byte("日本"), 0o644)
	WriteFile(t, filepath.Join(root, "bad\xff\xfeutf8"), []byte("x"), 0o644)
	long := strings.Repeat("L", 255)
	WriteFile(t, filepath.Join(root, long), []byte("long"), 0o644)
	longU := strings.Repeat("é", 127) + "x" // 255 bytes
	mkdir(filepath.Join(root, longU), 0o750)
	WriteFile(t, filepath.Join(root, longU, long), nil, 0o644)
	// Empty and 1-byte files, modes with setuid, setgid and sticky.
	WriteFile(t, filepath.Join(root, "empty"), nil, 0o644)
	WriteFile(t, filepath.Join(root, "one"), []byte{'1'}, 0o644)
	WriteFile(t, filepath.Join(root, "suid"), []byte("#!/bin/sh\n"), 0o4755)
	WriteFile(t, filepath.Join(root, "sgid"), []byte("#!/bin/sh\n"), 0o2711)
	mkdir(filepath.Join(root, "tmp"), 0o1777)
	mkdir(filepath.Join(root, "sgiddir"), 0o2775)
	// Deep nesting.
	// (Only one level of the chain takes random entries: path lookups of
	// a thousand components make every later operation slow.)
	p := root
	for i := range o.Deep {
		p = filepath.Join(p, fmt.Sprintf("d%d", i%10))
		Must(t, os.Mkdir(p, 0o755))
		if i == o.Deep/2 {
			dirs = append(dirs, p)
		}
	}
	WriteFile(t, filepath.Join(p, "bottom"), []byte("deep"), 0o644)
	// Sparse files: data written at known places; ext4 allocates whole
	// 4 KiB blocks, so those are the expected segments.
	sparse := func(name string, size int64, writes ...index.Range) {
		fp := filepath.Join(root, name)
		f, err := os.Create(fp)
		Must(t, err)
		Must(t, f.Truncate(size))
		var segs []index.Range
		for _, w := range writes {
			_, err := f.WriteAt(make([]byte, w.Len), w.Off)
			Must(t, err)
			b := make([]byte, w.Len)
			for i := range b {
				b[i] = byte(rng.IntN(255) + 1)
			}
			_, err = f.WriteAt(b, w.Off)
			Must(t, err)
			s := index.Range{Off: w.Off &^ 4095, Len: 0}
			end := min((w.Off+w.Len+4095)&^4095, size)
			s.Len = end - s.Off
			if n := len(segs); n > 0 && segs[n-1].Off+segs[n-1].Len >= s.Off {
				segs[n-1].Len = end - segs[n-1].Off
			} else {
				segs = append(segs, s)
			}
		}
		Must(t, f.Close())
		if segs == nil {
			segs = []index.Range{}
		}
		res.Sparse[name] = segs
	}
	sparse("sparse-holes", 10<<20, index.Range{Off: 1 << 20, Len: 100}, index.Range{Off: 5<<20 + 7, Len: 9000})
	sparse("sparse-tail", 3<<20, index.Range{Off: 0, Len: 4096})
	sparse("sparse-empty", 64<<20)
	// Hard links, several groups, across directories.
	mkdir(filepath.Join(root, "links"), 0o755)
	mkdir(filepath.Join(root, "links", "other"), 0o755)
	for g := range 40 {
		first := filepath.Join(root, "links", fmt.Sprintf("g%02d-0", g))
		WriteFile(t, first, []byte(fmt.Sprintf("group %d", g)), 0o644)
		for k := 1; k <= 1+rng.IntN(4); k++ {
			dir := "links"
			if rng.IntN(2) == 0 {
				dir = "links/other"
			}
			Must(t, os.Link(first, filepath.Join(root, dir, fmt.Sprintf("g%02d-%d", g, k))))
		}
	}
	// Symlinks, never followed: absolute, dangling, to a directory, loops.
	Must(t, os.Symlink("/etc/passwd", filepath.Join(root, "abs-link")))
	Must(t, os.Symlink("does/not/exist", filepath.Join(root, "dangling")))
	Must(t, os.Symlink("a", filepath.Join(root, "dirlink")))
	Must(t, os.Symlink("loop", filepath.Join(root, "loop")))
	Must(t, os.Symlink(strings.Repeat("t/", 2000)+"x", filepath.Join(root, "longlink")))
	if o.Specials {
		mkdir(filepath.Join(root, "dev"), 0o755)
		Must(t, unix.Mknod(filepath.Join(root, "dev", "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
		Must(t, unix.Mknod(filepath.Join(root, "dev", "loop0"), unix.S_IFBLK|0o660, int(unix.Mkdev(7, 0))))
		Must(t, unix.Mknod(filepath.Join(root, "dev", "big"), unix.S_IFCHR|0o600, int(unix.Mkdev(4095, 1<<20-1))))
		Must(t, unix.Mknod(filepath.Join(root, "dev", "wh"), unix.S_IFCHR, 0))
		Must(t, unix.Mkfifo(filepath.Join(root, "dev", "fifo"), 0o640))
		Must(t, unix.Mknod(filepath.Join(root, "dev", "sock"), unix.S_IFSOCK|0o755, 0))
		// xattrs: user.*, trusted.* and security.capability.
		Must(t, unix.Lsetxattr(filepath.Join(root, "one"), "user.b", []byte("2"), 0))
		Must(t, unix.Lsetxattr(filepath.Join(root, "one"), "user.a", []byte("1"), 0))
		Must(t, unix.Lsetxattr(filepath.Join(root, "one"), "user.empty", nil, 0))
		Must(t, unix.Lsetxattr(filepath.Join(root, "a"), "user.dir", []byte("d"), 0))
		Must(t, unix.Lsetxattr(filepath.Join(root, "a"), "user.big", make([]byte, 3000), 0))
		if err := unix.Lsetxattr(filepath.Join(root, "sgid"), "trusted.k", []byte("t"), 0); err != nil {
			t.Logf("trusted xattr not settable here: %v", err)
		}
		if err := unix.Lsetxattr(filepath.Join(root, "suid"), "security.capability", VfsCapV2, 0); err != nil {
			t.Logf("security.capability not settable here: %v", err)
		} else {
			res.Caps = append(res.Caps, "suid")
		}
		Must(t, unix.Chmod(filepath.Join(root, "suid"), 0o4755)) // setxattr of caps may clear suid
	}
	// The huge directory.
	if o.HugeDir > 0 {
		h := filepath.Join(root, "huge")
		mkdir(h, 0o755)
		for i := range o.HugeDir {
			f, err := os.OpenFile(filepath.Join(h, fmt.Sprintf("f%06d", i)), os.O_CREATE|os.O_WRONLY, 0o644)
			Must(t, err)
			if i%7 == 0 {
				_, err = f.Write([]byte{byte(i)})
				Must(t, err)
			}
			Must(t, f.Close())
		}
	}
	// Random entries in random existing directories.
	for i := range o.Random {
		d := dirs[rng.IntN(len(dirs))]
		if len(d)-len(root) > 3000 {
			d = root
		}
		name := fmt.Sprintf("r%d-%c", i, 'a'+rng.IntN(26))
		fp := filepath.Join(d, name)
		switch rng.IntN(6) {
		case 0:
			mkdir(fp, os.FileMode(0o700+rng.IntN(0o100)))
		case 1:
			Must(t, os.Symlink(name+"-target", fp))
		default:
			b := make([]byte, rng.IntN(3)*rng.IntN(5000))
			WriteFile(t, fp, b, os.FileMode(0o600+rng.IntN(0o200)))
		}
		if rng.IntN(5) == 0 {
			_ = unix.Lsetxattr(fp, "user.r", []byte(name), 0) // not on symlinks
		}
		Must(t, os.Lchown(fp, rng.IntN(70000), rng.IntN(70000)))
	}
	// Nanosecond times, children before parents so a parent's times stay.
	var all []string
	Must(t, filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
		all = append(all, p)
		return err
	}))
	slices.Reverse(all)
	for _, p := range all {
		ts := []unix.Timespec{
			{Sec: rng.Int64N(2e9), Nsec: rng.Int64N(1e9)},
			{Sec: rng.Int64N(2e9), Nsec: rng.Int64N(1e9)},
		}
		Must(t, unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW))
	}
	return res
}

// GenFlat writes n entries: 1 in 50 a directory, the rest small files,
// some with an xattr, in directories of 50.
func GenFlat(b testing.TB, root string, n int) {
	b.Helper()
	dir := root
	for i := 0; i < n; i++ {
		if i%50 == 0 {
			dir = filepath.Join(root, fmt.Sprintf("d%04d", i/50))
			Must(b, os.Mkdir(dir, 0o755))
			continue
		}
		p := filepath.Join(dir, fmt.Sprintf("file-%06d.txt", i))
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o644)
		Must(b, err)
		if i%3 == 0 {
			_, err = f.Write([]byte("data"))
			Must(b, err)
		}
		Must(b, f.Close())
		if i%10 == 0 {
			Must(b, unix.Setxattr(p, "user.k", []byte("v"), 0))
		}
	}
}
