package disklayout

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// mkfsImage makes a small filesystem with the real mkfs.ext4 and returns
// its bytes; the records this package encodes are checked against it.
func mkfsImage(t *testing.T) []byte {
	t.Helper()
	testenv.Tool(t, "mkfs.ext4", "e2fsprogs")
	p := filepath.Join(t.TempDir(), "ref.img")
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", "-O", "^resize_inode", "-E", "lazy_itable_init=0",
		"-U", "0b2c4d6e-1111-4222-8333-123456789abc", p, "300M").CombinedOutput()
	if err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAgainstMkfs(t *testing.T) {
	img := mkfsImage(t)
	raw := img[SuperBlockOffset : SuperBlockOffset+SuperBlockSize]
	var sb SuperBlock
	if err := sb.Unmarshal(raw); err != nil {
		t.Fatal(err)
	}
	if sb.Magic != SuperMagic || sb.InodeSize != InodeSize || sb.DescSize != GroupDescSize64 {
		t.Fatalf("decoded superblock fields wrong: magic %#x inode size %d desc size %d", sb.Magic, sb.InodeSize, sb.DescSize)
	}
	got := make([]byte, SuperBlockSize)
	if err := sb.Marshal(got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, raw) {
		t.Fatalf("re-encoded superblock (with checksum) differs from mkfs's")
	}
	seed := FSChecksumSeed(sb.UUID)

	// Group descriptors and their checksums.
	bs := 1024 << sb.LogBlockSize
	ngroups := (uint64(sb.BlocksCountLo) + uint64(sb.BlocksPerGroup) - 1) / uint64(sb.BlocksPerGroup)
	var itable0 uint64
	for g := uint64(0); g < ngroups; g++ {
		rawGD := img[bs+int(g)*GroupDescSize64:][:GroupDescSize64]
		var gd GroupDesc
		if _, err := binary.Decode(rawGD, binary.LittleEndian, &gd); err != nil {
			t.Fatal(err)
		}
		enc := make([]byte, GroupDescSize64)
		gd.Marshal(enc, seed, uint32(g))
		if !bytes.Equal(enc, rawGD) {
			t.Errorf("group %d: re-encoded descriptor differs:\n got %x\nwant %x", g, enc, rawGD)
		}
		if g == 0 {
			itable0 = uint64(gd.InodeTableLo)
			// Bitmap checksums of group 0 (initialised by mkfs).
			bb := img[uint64(gd.BlockBitmapLo)*uint64(bs):][:sb.BlocksPerGroup/8]
			if c := BitmapChecksum(seed, bb); uint16(c) != gd.BlockBitmapCsumLo || uint16(c>>16) != gd.BlockBitmapCsumHi {
				t.Errorf("block bitmap checksum %#x, mkfs wrote %#x/%#x", c, gd.BlockBitmapCsumLo, gd.BlockBitmapCsumHi)
			}
			ib := img[uint64(gd.InodeBitmapLo)*uint64(bs):][:sb.InodesPerGroup/8]
			if c := BitmapChecksum(seed, ib); uint16(c) != gd.InodeBitmapCsumLo || uint16(c>>16) != gd.InodeBitmapCsumHi {
				t.Errorf("inode bitmap checksum %#x, mkfs wrote %#x/%#x", c, gd.InodeBitmapCsumLo, gd.InodeBitmapCsumHi)
			}
			// Root inode: decode, re-encode, checksum.
			rec := img[uint64(gd.InodeTableLo)*uint64(bs)+InodeSize:][:InodeSize]
			var in Inode
			if _, err := binary.Decode(rec, binary.LittleEndian, &in); err != nil {
				t.Fatal(err)
			}
			if in.Mode&0xF000 != ModeDir || in.ExtraIsize != InodeExtraSize {
				t.Fatalf("root inode mode %#o extra %d", in.Mode, in.ExtraIsize)
			}
			enc := bytes.Clone(rec)
			in.Marshal(enc)
			SetInodeChecksum(enc, seed, RootIno, in.Generation)
			if !bytes.Equal(enc, rec) {
				t.Errorf("re-encoded root inode differs:\n got %x\nwant %x", enc, rec)
			}
			// Root directory block: its dirent tail checksum.
			root := img[firstExtent(t, &in)*uint64(bs):][:bs]
			blk := bytes.Clone(root)
			SetDirentTail(blk, InodeChecksumSeed(seed, RootIno, in.Generation))
			if !bytes.Equal(blk, root) {
				t.Errorf("dirent tail differs: got %x want %x", blk[bs-12:], root[bs-12:])
			}
		}
	}
	// The journal superblock mkfs wrote decodes and re-encodes identically.
	var jin Inode
	jrec := img[itable0*uint64(bs)+(JournalIno-1)*InodeSize:][:InodeSize]
	if err := jin.Unmarshal(jrec); err != nil {
		t.Fatal(err)
	}
	jblk := img[firstExtent(t, &jin)*uint64(bs):][:JournalSuperBlockSize]
	var js JournalSuperBlock
	if _, err := binary.Decode(jblk, binary.BigEndian, &js); err != nil {
		t.Fatal(err)
	}
	if js.HeaderMagic != JournalMagic || js.HeaderBlocktype != Jbd2SuperblockV2 || js.UUID != sb.UUID {
		t.Fatalf("journal superblock: %+v", js)
	}
	enc := make([]byte, JournalSuperBlockSize)
	if err := js.Marshal(enc); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(enc, jblk) {
		t.Errorf("re-encoded journal superblock differs")
	}
}

// firstExtent is the first physical block of the extent tree rooted in
// in's i_block, which must be a leaf.
func firstExtent(t *testing.T, in *Inode) uint64 {
	t.Helper()
	var h ExtentHeader
	var e Extent
	if _, err := binary.Decode(in.Block[:], binary.LittleEndian, &h); err != nil || h.Magic != ExtentMagic || h.Depth != 0 || h.Entries == 0 {
		t.Fatalf("i_block holds no extent leaf: %+v %v", h, err)
	}
	if _, err := binary.Decode(ExtentEntry(in.Block[:], 0), binary.LittleEndian, &e); err != nil {
		t.Fatal(err)
	}
	return e.Start()
}

var hashRE = regexp.MustCompile(`Hash of .* is 0x([0-9a-f]+)`)

func TestDirHashMatchesDebugfs(t *testing.T) {
	testenv.Tool(t, "debugfs", "e2fsprogs")
	img := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	seedStr := "54fd1554-63da-461e-91c6-65674ac885c1"
	seedBytes := []byte{0x54, 0xfd, 0x15, 0x54, 0x63, 0xda, 0x46, 0x1e, 0x91, 0xc6, 0x65, 0x67, 0x4a, 0xc8, 0x85, 0xc1}
	var seed [4]uint32
	for i := range seed {
		seed[i] = binary.LittleEndian.Uint32(seedBytes[4*i:])
	}
	names := []string{"a", "hello", "lost+found", "héllo", "日本語のファイル", "0123456789012345678901234567890", "01234567890123456789012345678901",
		"012345678901234567890123456789012", string(bytes.Repeat([]byte("long"), 60))}
	for _, n := range names {
		for _, s := range []string{seedStr, "00000000-0000-0000-0000-000000000000"} {
			out, err := exec.Command("debugfs", "-R", fmt.Sprintf("dx_hash -h half_md4 -s %s %s", s, n)).CombinedOutput()
			if err != nil {
				t.Fatalf("debugfs: %v: %s", err, out)
			}
			m := hashRE.FindSubmatch(out)
			if m == nil {
				t.Fatalf("debugfs output: %s", out)
			}
			want, _ := strconv.ParseUint(string(m[1]), 16, 32)
			sd := seed
			if s != seedStr {
				sd = [4]uint32{}
			}
			if got := DirHashHalfMD4([]byte(n), sd, false); got != uint32(want) {
				t.Errorf("hash(%q, seed %s) = %#x, debugfs says %#x", n, s, got, want)
			}
		}
	}
	// Signedness only matters for bytes >= 0x80.
	if DirHashHalfMD4([]byte("ascii"), seed, true) != DirHashHalfMD4([]byte("ascii"), seed, false) {
		t.Error("signed and unsigned hashes differ on ASCII")
	}
	if DirHashHalfMD4([]byte("héllo"), seed, true) == DirHashHalfMD4([]byte("héllo"), seed, false) {
		t.Error("signed and unsigned hashes agree on non-ASCII")
	}
}

func TestTimeEncoding(t *testing.T) {
	for _, sec := range []int64{0, 1, -1, 1<<31 - 1, -1 << 31, 1 << 31, 1 << 32, 1<<33 + 12345, 3<<32 + 1<<31 - 1} {
		lo, extra := EncodeTime(sec, 999999999)
		s, ns := DecodeTime(lo, extra)
		if s != sec || ns != 999999999 {
			t.Errorf("EncodeTime(%d) round-trips to %d.%d", sec, s, ns)
		}
	}
}

func TestEncodeDev(t *testing.T) {
	for _, c := range []struct{ maj, min, w0, w1 uint32 }{
		{1, 3, 0x0103, 0},
		{255, 255, 0xffff, 0},
		{8, 256, 0, 0x100800},
		{300, 70000, 0, 70000&0xff | 300<<8 | (70000&^0xff)<<12},
	} {
		if w0, w1 := EncodeDev(c.maj, c.min); w0 != c.w0 || w1 != c.w1 {
			t.Errorf("EncodeDev(%d,%d) = %#x,%#x want %#x,%#x", c.maj, c.min, w0, w1, c.w0, c.w1)
		}
	}
}

func TestHasSuper(t *testing.T) {
	var got []uint64
	for g := uint64(0); g < 300; g++ {
		if HasSuper(g) {
			got = append(got, g)
		}
	}
	want := []uint64{0, 1, 3, 5, 7, 9, 25, 27, 49, 81, 125, 243}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("backup groups %v, want %v", got, want)
	}
}

func TestACLRoundTrip(t *testing.T) {
	vfs := []byte{2, 0, 0, 0, 1, 0, 6, 0, 0xff, 0xff, 0xff, 0xff, 2, 0, 4, 0, 0xe8, 3, 0, 0, 4, 0, 4, 0, 0xff, 0xff, 0xff, 0xff,
		0x10, 0, 4, 0, 0xff, 0xff, 0xff, 0xff, 0x20, 0, 4, 0, 0xff, 0xff, 0xff, 0xff}
	disk, ok := ACLToDisk(vfs)
	if !ok || len(disk) != 4+4+8+4+4+4 {
		t.Fatalf("ACLToDisk: ok %v len %d", ok, len(disk))
	}
	back, ok := ACLFromDisk(disk)
	if !ok || !bytes.Equal(back, vfs) {
		t.Fatalf("round trip: %x, want %x", back, vfs)
	}
	for _, bad := range [][]byte{nil, {2, 0, 0}, {1, 0, 0, 0}, {2, 0, 0, 0, 0x40, 0, 0, 0, 0, 0, 0, 0}} {
		if _, ok := ACLToDisk(bad); ok {
			t.Errorf("ACLToDisk(%x) accepted", bad)
		}
	}
}

func TestXattrSplitName(t *testing.T) {
	for _, c := range []struct {
		name   string
		idx    uint8
		suffix string
		ok     bool
	}{
		{"user.foo", XattrIndexUser, "foo", true},
		{"security.capability", XattrIndexSecurity, "capability", true},
		{"trusted.overlay.opaque", XattrIndexTrusted, "overlay.opaque", true},
		{"system.posix_acl_access", XattrIndexACLAccess, "", true},
		{"system.posix_acl_default", XattrIndexACLDefault, "", true},
		{"system.data", XattrIndexSystem, "data", true},
		{"user.", 0, "", false},
		{"other.x", 0, "", false},
	} {
		idx, suffix, ok := XattrSplitName(c.name)
		if idx != c.idx || suffix != c.suffix || ok != c.ok {
			t.Errorf("XattrSplitName(%q) = %d %q %v", c.name, idx, suffix, ok)
		}
	}
}

func TestTimeClamp(t *testing.T) {
	for _, c := range []struct{ in, want int64 }{{MinTime - 5, MinTime}, {MaxTime + 1, MaxTime}, {1 << 40, MaxTime}} {
		if s, ns := DecodeTime(EncodeTime(c.in, 2e9)); s != c.want || ns != 999999999 {
			t.Errorf("EncodeTime(%d) decodes to %d.%d, want %d.999999999", c.in, s, ns, c.want)
		}
	}
}
