package ext4

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// goldenIndex is a deterministic in-memory index exercising every
// structure Build writes: linear and htree directories (one and two index
// levels when hugeDir), every file type, fast and slow symlinks, hard
// links, sparse files with many extents (a deep extent tree), data that
// crosses backup groups, in-inode, block and shared xattrs, ACLs, explicit
// inode numbers and timestamps outside 1970..2038.
func goldenIndex(seed int64, hugeDir int) *index.Index {
	rng := rand.New(rand.NewSource(seed))
	idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:golden"}, {Kind: index.SourceDir, ID: "/golden"}}}
	add := func(e index.Entry) { idx.Entries = append(idx.Entries, e) }
	ts := func() index.Timespec {
		return index.Timespec{Sec: rng.Int63n(3<<31) - 1<<31, Nsec: uint32(rng.Intn(1e9))}
	}
	var off int64
	reg := func(p string, size int64, segs []index.Range) index.Entry {
		e := index.Entry{Path: p, Type: index.TypeRegular, Mode: 0o644, UID: uint32(rng.Intn(70000)), GID: uint32(rng.Intn(70000)),
			Size: size, Atime: ts(), Mtime: ts(), Ctime: ts(), Data: index.Data{Source: 0, Offset: off, Segments: segs}}
		off += size + int64(rng.Intn(4096))
		return e
	}
	dir := func(p string) { add(index.Entry{Path: p, Type: index.TypeDir, Mode: 0o755, Mtime: ts()}) }
	dir(".")
	dir("small")
	for i := 0; i < 40; i++ {
		add(reg(fmt.Sprintf("small/f%02d", i), int64(rng.Intn(20000)), nil))
	}
	for _, n := range []int64{0, 1, 4095, 4096, 4097, 8192, 1 << 20} {
		add(reg(fmt.Sprintf("small/size-%d", n), n, nil))
	}
	dir("wide")
	for i := 0; i < 3000; i++ {
		add(reg(fmt.Sprintf("wide/entry-%05d-%s", i, strings.Repeat("é", i%7)), int64(rng.Intn(300)), nil))
	}
	if hugeDir > 0 {
		dir("huge")
		for i := 0; i < hugeDir; i++ {
			add(index.Entry{Path: fmt.Sprintf("huge/a-longish-file-name-%06d", i), Type: index.TypeFifo, Mode: 0o600})
		}
	}
	dir("sparse")
	var segs []index.Range
	for i := 0; i < 2000; i++ {
		segs = append(segs, index.Range{Off: int64(i) * 65536, Len: 4096 + int64(rng.Intn(5000))})
	}
	add(reg("sparse/ext2000", 2000*65536, segs))
	add(reg("sparse/holes", 6<<30, []index.Range{{Off: 0, Len: 5000}, {Off: 1<<30 + 100, Len: 5000}, {Off: 6<<30 - 10, Len: 10}}))
	add(reg("sparse/all-hole", 1<<20, []index.Range{}))
	add(reg("big", 300<<20, nil))
	dir("dev")
	add(index.Entry{Path: "dev/null", Type: index.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3})
	add(index.Entry{Path: "dev/bigchr", Type: index.TypeChar, Mode: 0o600, Devmajor: 300, Devminor: 70000})
	add(index.Entry{Path: "dev/blk", Type: index.TypeBlock, Mode: 0o660, Devmajor: 8, Devminor: 1})
	add(index.Entry{Path: "dev/fifo", Type: index.TypeFifo, Mode: 0o644, Ino: 5000})
	add(index.Entry{Path: "dev/sock", Type: index.TypeSocket, Mode: 0o755, Ino: 12})
	dir("sym")
	for _, n := range []int{1, 59, 60, 1000} {
		add(index.Entry{Path: fmt.Sprintf("sym/l%d", n), Type: index.TypeSymlink, Mode: 0o777, Linkname: strings.Repeat("x", n), Mtime: ts()})
	}
	dir("links")
	add(reg("links/orig", 14, nil))
	for i := 0; i < 30; i++ {
		add(index.Entry{Path: fmt.Sprintf("links/l%d", i), Type: index.TypeHardlink, Linkname: "links/orig"})
	}
	dir("xattr")
	x := reg("xattr/small", 1, nil)
	x.Xattrs = []index.Xattr{{Name: "user.k", Value: []byte("v")}, {Name: "trusted.t", Value: []byte("trusted value")}, {Name: "security.capability", Value: make([]byte, 20)}}
	add(x)
	big := []byte(strings.Repeat("0123456789abcdef", 60))
	for i := 0; i < 3; i++ {
		x := reg(fmt.Sprintf("xattr/big%d", i), 1, nil)
		x.Xattrs = []index.Xattr{{Name: "user.big", Value: big}, {Name: "user.small", Value: []byte("x")}}
		if i == 2 {
			x.Xattrs = append(x.Xattrs, index.Xattr{Name: "user.more", Value: make([]byte, 300)})
		}
		add(x)
	}
	acl := []byte{2, 0, 0, 0, 1, 0, 6, 0, 0xff, 0xff, 0xff, 0xff, 2, 0, 4, 0, 0xe8, 3, 0, 0, 4, 0, 4, 0, 0xff, 0xff, 0xff, 0xff,
		0x10, 0, 4, 0, 0xff, 0xff, 0xff, 0xff, 0x20, 0, 4, 0, 0xff, 0xff, 0xff, 0xff}
	add(index.Entry{Path: "xattr/acl", Type: index.TypeDir, Mode: 0o750, Xattrs: []index.Xattr{{Name: "system.posix_acl_access", Value: acl}, {Name: "system.posix_acl_default", Value: acl}}})
	dir("deep")
	p := "deep"
	for i := 0; i < 30; i++ {
		p += fmt.Sprintf("/d%02d", i)
		dir(p)
	}
	add(index.Entry{Path: p + "/leaf", Type: index.TypeRegular, Mode: 0o600, Size: 3, Data: index.Data{Source: 1, Path: "leaf"}})
	return idx
}

// imageDigest hashes everything Build produces: the metadata bytes, the
// encoded block map and the manifest.
func imageDigest(t testing.TB, img *Image) string {
	t.Helper()
	h := sha256.New()
	_, err := io.Copy(h, io.NewSectionReader(img.Meta(), 0, img.MetaSize()))
	must(t, err)
	enc, err := img.Map.MarshalBinary()
	must(t, err)
	h.Write(enc)
	js, err := json.Marshal(img.Manifest)
	must(t, err)
	h.Write(js)
	return hex.EncodeToString(h.Sum(nil))[:32]
}

// TestGoldenImages pins the exact bytes Build writes for fixed inputs, so
// a restructuring of the builder that changes a single byte shows. A
// deliberate format change updates the digests (the failure prints them).
func TestGoldenImages(t *testing.T) {
	tm := time.Unix(testTime, 123)
	for _, c := range []struct {
		name    string
		seed    int64
		hugeDir int
		opts    Options
		want    string
	}{
		{"default", 1, 0, Options{Time: tm}, "5d88b9cade04c23c9d61d7d8577622dd"},
		{"no-journal", 2, 0, Options{NoJournal: true, WritableSize: -1}, "244981eadcd74a2f042d3a183a4da3ba"},
		{"options", 3, 0, Options{Time: tm, JournalSize: 64 << 20, WritableSize: 3 << 30, VolumeName: "golden", FreeInodes: 5000}, "680d55f9f9e51d2bc9feddd19c3275d2"},
		{"bs2048-two-level-htree", 4, 15000, Options{Time: tm, BlockSize: 2048}, "e148c0cc8a20e4a857d38c269950def1"},
		{"two-level-htree", 5, 60000, Options{Time: tm, WritableSize: -1}, "3bce3764cc55185f3e6970697937f5a9"},
	} {
		t.Run(c.name, func(t *testing.T) {
			img, err := Build(context.Background(), goldenIndex(c.seed, c.hugeDir), c.opts)
			must(t, err)
			defer img.Close()
			if got := imageDigest(t, img); got != c.want {
				t.Errorf("digest %s, want %s", got, c.want)
			}
			raw := filepath.Join(t.TempDir(), "disk.img")
			exportMeta(t, img, raw)
			fsck(t, raw)
		})
	}
	t.Run("terabyte", func(t *testing.T) {
		idx := &index.Index{Sources: []index.Source{{Kind: index.SourceBlob, ID: "sha256:00"}}, Entries: []index.Entry{
			{Path: ".", Type: index.TypeDir, Mode: 0o755},
			{Path: "huge", Type: index.TypeRegular, Mode: 0o644, Size: 1<<40 + 1},
		}}
		img, err := Build(context.Background(), idx, Options{Time: tm})
		must(t, err)
		defer img.Close()
		if got, want := imageDigest(t, img), "587a631ebaab7ba35273dca804c9c387"; got != want {
			t.Errorf("digest %s, want %s", got, want)
		}
	})
}
