package disklayout

import (
	"bytes"
	"encoding/binary"
	"math/rand"
	"reflect"
	"testing"
)

// TestRecordSizes pins every record's encoded size, and the sizes that
// are defined as parts of others.
func TestRecordSizes(t *testing.T) {
	for _, c := range []struct {
		name string
		v    any
		want int
	}{
		{"SuperBlock", SuperBlock{}, SuperBlockSize},
		{"GroupDesc", GroupDesc{}, GroupDescSize64},
		{"Inode", Inode{}, InodeCoreSize + InodeExtraSize},
		{"ExtentHeader", ExtentHeader{}, ExtentSize},
		{"Extent", Extent{}, ExtentSize},
		{"ExtentIdx", ExtentIdx{}, ExtentSize},
		{"ExtentTail", ExtentTail{}, 4},
		{"Dirent", Dirent{}, DirentHeaderSize},
		{"DirentTail", DirentTail{}, DirentTailSize},
		{"DxRootInfo", DxRootInfo{}, DxRootInfoSize},
		{"DxCountLimit", DxCountLimit{}, 4},
		{"DxEntry", DxEntry{}, DxEntrySize},
		{"DxTail", DxTail{}, DxTailSize},
		{"XattrHeader", XattrHeader{}, XattrHeaderSize},
		{"XattrEntry", XattrEntry{}, XattrEntrySize},
		{"XattrIbodyHeader", XattrIbodyHeader{}, XattrIbodySize},
		{"JournalSuperBlock", JournalSuperBlock{}, JournalSuperBlockSize},
		// The fields around them fix these, whatever the constants say.
		{"i_block", Inode{}.Block, InodeBlockSize},
		{"extent root in i_block", [1 + ExtentRootMax]Extent{}, InodeBlockSize},
		{"in-inode xattr area", [InodeXattrSpace]byte{}, InodeSize - binary.Size(Inode{})},
		{"htree root header", struct {
			Dot, DotDot Dirent
			_           [2 * (DotDirentSize - DirentHeaderSize)]byte
			Info        DxRootInfo
		}{}, DxRootCountOffset},
		{"htree node header", Dirent{}, DxNodeCountOffset},
	} {
		if got := binary.Size(c.v); got != c.want {
			t.Errorf("%s: size %d, want %d", c.name, got, c.want)
		}
	}
	if RecLen(1) != DotDirentSize || RecLen(2) != DotDirentSize {
		t.Errorf("\".\" and \"..\" take %d and %d bytes, DotDirentSize is %d", RecLen(1), RecLen(2), DotDirentSize)
	}
}

// fieldOffset encodes a zero record whose one field is set to a value with
// no zero byte and returns where the nonzero bytes start and how many
// there are: the field's place in the encoding, found from the bytes.
func fieldOffset(t *testing.T, rec any, field string, order binary.ByteOrder) (off, n int) {
	t.Helper()
	rv := reflect.New(reflect.TypeOf(rec)).Elem()
	f := rv.FieldByName(field)
	if !f.IsValid() {
		t.Fatalf("%T has no field %s", rec, field)
	}
	fill := func(v reflect.Value) {
		switch v.Kind() {
		case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			v.SetUint(0xA5A5A5A5A5A5A5A5)
		case reflect.Int32:
			v.SetInt(-0x5A5A5A5B)
		default:
			t.Fatalf("%T.%s: kind %v", rec, field, v.Kind())
		}
	}
	if f.Kind() == reflect.Array {
		for i := 0; i < f.Len(); i++ {
			fill(f.Index(i))
		}
	} else {
		fill(f)
	}
	b, err := binary.Append(nil, order, rv.Interface())
	if err != nil {
		t.Fatal(err)
	}
	first, last := -1, -1
	for i, c := range b {
		if c != 0 {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	return first, last - first + 1
}

// TestOffsetsMatchEncoding checks each named offset against the struct
// encoding of its record, and the struct encodings against the offsets of
// the kernel's on-disk format documentation, so neither can drift.
func TestOffsetsMatchEncoding(t *testing.T) {
	le, be := binary.ByteOrder(binary.LittleEndian), binary.ByteOrder(binary.BigEndian)
	for _, c := range []struct {
		rec   any
		field string
		off   int
		order binary.ByteOrder
	}{
		// Named offsets this package writes through.
		{Inode{}, "Block", inodeBlockOffset, le},
		{Inode{}, "ChecksumLo", inodeChecksumLoOffset, le},
		{Inode{}, "ChecksumHi", inodeChecksumHiOffset, le},
		{Inode{}, "ExtraIsize", InodeCoreSize, le},
		{SuperBlock{}, "Checksum", superChecksumOffset, le},
		{GroupDesc{}, "Checksum", groupDescChecksumOffset, le},
		{GroupDesc{}, "BlockBitmapHi", GroupDescSize32, le},
		{ExtentHeader{}, "Max", extentMaxOffset, le},
		{Dirent{}, "RecLen", direntRecLenOffset, le},
		{DirentTail{}, "Checksum", direntTailCsumOffset, le},
		{DxCountLimit{}, "Count", dxCountOffset, le},
		{DxEntry{}, "Block", dxEntryBlockOffset, le},
		{DxTail{}, "Checksum", dxTailChecksumOffset, le},
		{XattrHeader{}, "Refcount", xattrRefcountOffset, le},
		{XattrHeader{}, "Checksum", xattrChecksumOffset, le},

		// Offsets from Documentation/filesystems/ext4 and jbd2's header.
		{SuperBlock{}, "Magic", 0x38, le},
		{SuperBlock{}, "RevLevel", 0x4C, le},
		{SuperBlock{}, "FeatureCompat", 0x5C, le},
		{SuperBlock{}, "UUID", 0x68, le},
		{SuperBlock{}, "JournalInum", 0xE0, le},
		{SuperBlock{}, "HashSeed", 0xEC, le},
		{SuperBlock{}, "DescSize", 0xFE, le},
		{SuperBlock{}, "JnlBlocks", 0x10C, le},
		{SuperBlock{}, "BlocksCountHi", 0x150, le},
		{SuperBlock{}, "LogGroupsPerFlex", 0x174, le},
		{SuperBlock{}, "KbytesWritten", 0x178, le},
		{SuperBlock{}, "ChecksumSeed", 0x270, le},
		{SuperBlock{}, "WtimeHi", 0x274, le},
		{SuperBlock{}, "OrphanFileInum", 0x280, le},
		{GroupDesc{}, "Flags", 0x12, le},
		{GroupDesc{}, "ItableUnusedLo", 0x1C, le},
		{GroupDesc{}, "InodeBitmapCsumHi", 0x3A, le},
		{Inode{}, "Flags", 0x20, le},
		{Inode{}, "Generation", 0x64, le},
		{Inode{}, "FileACLLo", 0x68, le},
		{Inode{}, "SizeHi", 0x6C, le},
		{Inode{}, "BlocksHi", 0x74, le},
		{Inode{}, "Crtime", 0x90, le},
		{Inode{}, "ProjID", 0x9C, le},
		{Extent{}, "StartHi", 6, le},
		{Extent{}, "StartLo", 8, le},
		{ExtentIdx{}, "LeafLo", 4, le},
		{ExtentIdx{}, "LeafHi", 8, le},
		{DxRootInfo{}, "HashVersion", 4, le},
		{DxRootInfo{}, "IndirectLevels", 6, le},
		{XattrEntry{}, "ValueOffs", 2, le},
		{XattrEntry{}, "ValueSize", 8, le},
		{XattrEntry{}, "Hash", 12, le},
		{JournalSuperBlock{}, "BlockSize", 0x0C, be},
		{JournalSuperBlock{}, "UUID", 0x30, be},
		{JournalSuperBlock{}, "NrUsers", 0x40, be},
		{JournalSuperBlock{}, "ChecksumType", 0x50, be},
		{JournalSuperBlock{}, "NumFCBlocks", 0x54, be},
		{JournalSuperBlock{}, "Checksum", 0xFC, be},
		{JournalSuperBlock{}, "Users", 0x100, be},
	} {
		off, n := fieldOffset(t, c.rec, c.field, c.order)
		f, _ := reflect.TypeOf(c.rec).FieldByName(c.field)
		if want := int(f.Type.Size()); off != c.off || n != want {
			t.Errorf("%T.%s encodes at %#x (+%d), want %#x (+%d)", c.rec, c.field, off, n, c.off, want)
		}
	}
}

// randomFill sets every exported integer field (and array element) of the
// struct v points to.
func randomFill(rng *rand.Rand, v any) {
	rv := reflect.ValueOf(v).Elem()
	for i := 0; i < rv.NumField(); i++ {
		f := rv.Field(i)
		if !f.CanSet() {
			continue
		}
		switch f.Kind() {
		case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			f.SetUint(rng.Uint64())
		case reflect.Array:
			for k := 0; k < f.Len(); k++ {
				f.Index(k).SetUint(rng.Uint64())
			}
		}
	}
}

// encode is the struct encoding of v, the reference for hand-written
// encoders.
func encode(t *testing.T, v any) []byte {
	t.Helper()
	b, err := binary.Append(nil, binary.LittleEndian, v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// encoders lists every hand-written encoder with a fresh record it encodes.
var encoders = []struct {
	name    string
	rec     func() any // a pointer to a zero record
	marshal func(rec any, b []byte)
}{
	{"Inode.Marshal", func() any { return new(Inode) }, func(v any, b []byte) { v.(*Inode).Marshal(b) }},
	{"GroupDesc.Marshal", func() any { return new(GroupDesc) }, func(v any, b []byte) { v.(*GroupDesc).Marshal(b, 0x1234, 7) }},
	{"ExtentHeader.Marshal", func() any { return new(ExtentHeader) }, func(v any, b []byte) { v.(*ExtentHeader).Marshal(b) }},
	{"MarshalLeaf", func() any { return new(Extent) }, func(v any, b []byte) {
		e := v.(*Extent)
		MarshalLeaf(b, e.Block, e.Len, e.Start())
	}},
	{"MarshalIdx", func() any { return new(ExtentIdx) }, func(v any, b []byte) {
		x := v.(*ExtentIdx)
		MarshalIdx(b, x.Block, uint64(x.LeafHi)<<32|uint64(x.LeafLo))
	}},
	{"Dirent.Marshal", func() any { return new(Dirent) }, func(v any, b []byte) { v.(*Dirent).Marshal(b) }},
	{"DirentTail.Marshal", func() any { return new(DirentTail) }, func(v any, b []byte) { v.(*DirentTail).Marshal(b) }},
	{"DxRootInfo.Marshal", func() any { return new(DxRootInfo) }, func(v any, b []byte) { v.(*DxRootInfo).Marshal(b) }},
	{"XattrHeader.Marshal", func() any { return new(XattrHeader) }, func(v any, b []byte) { v.(*XattrHeader).Marshal(b) }},
	{"XattrEntry.Marshal", func() any { return new(XattrEntry) }, func(v any, b []byte) { v.(*XattrEntry).Marshal(b) }},
	{"XattrIbodyHeader.Marshal", func() any { return new(XattrIbodyHeader) }, func(v any, b []byte) { v.(*XattrIbodyHeader).Marshal(b) }},
}

// TestMarshalMatchesEncoding cross-checks the hand-written encoders against
// encoding/binary's layout of the same structs: every byte, padding
// included, over a buffer that starts dirty.
func TestMarshalMatchesEncoding(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	for _, c := range encoders {
		for i := 0; i < 100; i++ {
			v := c.rec()
			randomFill(rng, v)
			got := bytes.Repeat([]byte{0xff}, binary.Size(v))
			c.marshal(v, got) // GroupDesc.Marshal sets the checksum field, so encode after
			if want := encode(t, v); !bytes.Equal(got, want) {
				t.Fatalf("%s differs from the struct layout:\n got %x\nwant %x", c.name, got, want)
			}
		}
	}
}

// TestAccessorsMatchEncoding checks the accessors that decode a record or
// patch one field in place against the struct encoding.
func TestAccessorsMatchEncoding(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	for i := 0; i < 100; i++ {
		var in Inode
		randomFill(rng, &in)
		rec := encode(t, &in)
		var back Inode
		if err := back.Unmarshal(rec); err != nil || back != in {
			t.Fatalf("Inode.Unmarshal: %v, %+v", err, back)
		}
		jb := in.JournalBackup()
		for k := 0; k < InodeBlockSize/4; k++ {
			if w := binary.LittleEndian.Uint32(rec[inodeBlockOffset+4*k:]); jb[k] != w {
				t.Fatalf("JournalBackup word %d is %#x, i_block has %#x", k, jb[k], w)
			}
		}
		if jb[15] != in.SizeHi || jb[16] != in.SizeLo {
			t.Fatalf("JournalBackup ends %#x %#x, want i_size_high %#x, i_size %#x", jb[15], jb[16], in.SizeHi, in.SizeLo)
		}
		major, minor := uint32(rng.Intn(1<<12)), uint32(rng.Intn(1<<20))
		in.SetDevice(major, minor)
		w0, w1 := EncodeDev(major, minor)
		if binary.LittleEndian.Uint32(in.Block[:]) != w0 || binary.LittleEndian.Uint32(in.Block[4:]) != w1 {
			t.Fatalf("SetDevice(%d, %d): i_block %x", major, minor, in.Block[:8])
		}

		// A root node in i_block: header then ExtentRootMax leaves, each
		// reached through ExtentEntry.
		var root struct {
			H ExtentHeader
			E [ExtentRootMax]Extent
		}
		randomFill(rng, &root.H)
		for k := range root.E {
			randomFill(rng, &root.E[k])
		}
		got := make([]byte, InodeBlockSize)
		root.H.Marshal(got)
		for k, e := range root.E {
			MarshalLeaf(ExtentEntry(got, k), e.Block, e.Len, e.Start())
		}
		if want := encode(t, &root); !bytes.Equal(got, want) {
			t.Fatalf("extent root through ExtentEntry:\n got %x\nwant %x", got, want)
		}

		var d Dirent
		randomFill(rng, &d)
		got = encode(t, &d)
		d.RecLen = uint16(rng.Uint32())
		SetDirentRecLen(got, int(d.RecLen))
		if want := encode(t, &d); !bytes.Equal(got, want) {
			t.Fatalf("SetDirentRecLen: %x, want %x", got, want)
		}
		var xh XattrHeader
		randomFill(rng, &xh)
		got = encode(t, &xh)
		xh.Refcount = rng.Uint32()
		SetXattrRefcount(got, xh.Refcount)
		if want := encode(t, &xh); !bytes.Equal(got, want) {
			t.Fatalf("SetXattrRefcount: %x, want %x", got, want)
		}
	}
}

// TestDxEntriesMatchEncoding checks PutDxEntries against the struct
// encoding of a dx_countlimit overlaying the first dx_entry's hash,
// followed by the other entries.
func TestDxEntriesMatchEncoding(t *testing.T) {
	rng := rand.New(rand.NewSource(4))
	const limit = 6
	for n := 1; n <= limit; n++ {
		hashes, blocks := make([]uint32, n), make([]uint32, n)
		var want struct {
			CL    DxCountLimit
			Block uint32
			E     [limit - 1]DxEntry
		}
		want.CL = DxCountLimit{Limit: limit, Count: uint16(n)}
		for k := range hashes {
			hashes[k], blocks[k] = rng.Uint32(), rng.Uint32()
			if k == 0 {
				want.Block = blocks[0]
			} else {
				want.E[k-1] = DxEntry{Hash: hashes[k], Block: blocks[k]}
			}
		}
		got := make([]byte, DxNodeCountOffset+binary.Size(want))
		PutDxEntries(got, DxNodeCountOffset, limit, hashes, blocks)
		if w := encode(t, &want); !bytes.Equal(got[DxNodeCountOffset:], w) {
			t.Fatalf("%d entries:\n got %x\nwant %x", n, got[DxNodeCountOffset:], w)
		}
	}
}
