package ext4

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"flag"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// fuzzIndex turns bytes into a small index: a handful of names over a tiny
// alphabet so that duplicates, missing parents, links to directories and
// odd segment lists all come up.
func fuzzIndex(b []byte) *index.Index {
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceDir, ID: "/src"}, {Kind: index.SourceBlob, ID: "sha256:0"}}}
	idx.Entries = append(idx.Entries, index.Entry{Path: ".", Type: index.TypeDir, Mode: 0o755})
	names := []string{"a", "b", "a/b", "a/c", "b/a", "lost+found", "a/b/c", "..", "a//b", "c"}
	next := func(n int) []byte {
		if len(b) < n {
			b = append(b, make([]byte, n-len(b))...)
		}
		v := b[:n]
		b = b[n:]
		return v
	}
	for k := 0; k < 12 && len(b) > 0; k++ {
		h := next(16)
		e := index.Entry{
			Path: names[int(h[0])%len(names)],
			Type: index.Type(h[1] % 10),
			Mode: uint32(binary.LittleEndian.Uint16(h[2:])),
			UID:  uint32(h[4]) << (h[5] % 32),
			Size: int64(binary.LittleEndian.Uint16(h[6:])) << (h[10] % 26),
			Ino:  uint32(h[11]) * uint32(h[12]%3),
		}
		e.Linkname = names[int(h[13])%len(names)]
		e.Data = index.Data{Source: uint32(h[14] % 3), Path: e.Path}
		if h[15]&1 == 1 {
			s := next(8)
			e.Data.Segments = []index.Range{
				{Off: int64(s[0]) << (s[1] % 34), Len: int64(s[2]) << (s[3] % 30)},
				{Off: int64(s[4]) << (s[5] % 34), Len: int64(s[6]) << (s[7] % 30)},
			}
		}
		if h[15]&2 == 2 {
			x := next(3)
			e.Xattrs = []index.Xattr{{Name: []string{"user.x", "security.capability", "trusted.t", "bogus.x", "system.posix_acl_access"}[x[0]%5],
				Value: make([]byte, int(x[1])<<(x[2]%5))}}
		}
		idx.Entries = append(idx.Entries, e)
	}
	return idx
}

// fsckOneIn is the share of the images FuzzBuild builds while fuzzing
// that it also checks with e2fsck: a fork and a filesystem check cost as
// much as hundreds of builds.
const fsckOneIn = 32

// FuzzBuild feeds odd indexes to Build: it must return an error or an
// image, never panic, and the images it returns must be ones e2fsck finds
// clean. A plain test run checks every seed that builds; fuzzing checks the
// inputs whose hash selects them, so a failing input fails again alone.
func FuzzBuild(f *testing.F) {
	fuzzing := flag.Lookup("test.fuzz").Value.String() != ""
	f.Add([]byte{})
	f.Add([]byte{0, 2, 0xed, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{2, 1, 0xa4, 1, 0, 0, 0, 16, 0, 0, 3, 0, 0, 0, 0, 1, 1, 12, 1, 1, 9, 1, 1, 1})
	f.Add([]byte{1, 4, 0xa4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0xed, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	// A directory with an xattr block, a sparse blob file, a symlink,
	// a device, a hard link and lost+found with an explicit inode number.
	f.Add([]byte{
		0, 2, 0xed, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 200, 2,
		2, 1, 0xa4, 1, 0, 0, 0x10, 0x27, 0, 0, 3, 0, 0, 0, 1, 1, 1, 12, 1, 13, 3, 14, 1, 12,
		1, 3, 0xff, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0,
		9, 5, 0xb6, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
		3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0,
		5, 2, 0xc0, 1, 0, 0, 0, 0, 0, 0, 0, 20, 1, 0, 0, 0,
	})
	f.Fuzz(func(t *testing.T, b []byte) {
		idx := fuzzIndex(b)
		img, err := Build(context.Background(), idx, Options{WritableSize: -1})
		if err != nil {
			return
		}
		defer img.Close()
		if img.Map.Blocks() == 0 || img.MetaSize() == 0 {
			t.Fatalf("empty image without an error")
		}
		if sum := sha256.Sum256(b); fuzzing && binary.LittleEndian.Uint32(sum[:])%fsckOneIn != 0 {
			return
		}
		testenv.Tool(t, "e2fsck", "e2fsprogs")
		raw := filepath.Join(t.TempDir(), "disk.img")
		exportMeta(t, img, raw)
		fsck(t, raw)
		t.Logf("e2fsck -fn: clean (%d entries, %d blocks)", len(idx.Entries), img.Map.Blocks())
	})
}
