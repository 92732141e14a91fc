package disklayout

import (
	"encoding/binary"
	"fmt"
)

// Inode is struct ext4_inode up to and including the 32 bytes of extra
// fields this package writes (i_extra_isize 32). Its in-inode xattr area
// follows in the InodeSize-byte record and is encoded separately.
type Inode struct {
	Mode        uint16               // i_mode
	UIDLo       uint16               // i_uid
	SizeLo      uint32               // i_size_lo
	Atime       uint32               // i_atime
	Ctime       uint32               // i_ctime
	Mtime       uint32               // i_mtime
	Dtime       uint32               // i_dtime
	GIDLo       uint16               // i_gid
	LinksCount  uint16               // i_links_count
	BlocksLo    uint32               // i_blocks_lo, in 512-byte sectors
	Flags       uint32               // i_flags
	Version     uint32               // osd1.linux1.l_i_version
	Block       [InodeBlockSize]byte // i_block: extent tree root, fast symlink or device number
	Generation  uint32               // i_generation
	FileACLLo   uint32               // i_file_acl_lo: xattr block
	SizeHi      uint32               // i_size_high
	ObsoFaddr   uint32               // i_obso_faddr
	BlocksHi    uint16               // osd2.linux2.l_i_blocks_high
	FileACLHi   uint16               // osd2.linux2.l_i_file_acl_high
	UIDHi       uint16               // osd2.linux2.l_i_uid_high
	GIDHi       uint16               // osd2.linux2.l_i_gid_high
	ChecksumLo  uint16               // osd2.linux2.l_i_checksum_lo
	_           uint16               // osd2.linux2.l_i_reserved
	ExtraIsize  uint16               // i_extra_isize
	ChecksumHi  uint16               // i_checksum_hi
	CtimeExtra  uint32               // i_ctime_extra: epoch bits and nanoseconds
	MtimeExtra  uint32               // i_mtime_extra
	AtimeExtra  uint32               // i_atime_extra
	Crtime      uint32               // i_crtime
	CrtimeExtra uint32               // i_crtime_extra
	VersionHi   uint32               // i_version_hi
	ProjID      uint32               // i_projid
}

// Sizes and offsets inside an inode record.
const (
	InodeBlockSize = 60 // i_block
	// InodeXattrOffset is where the in-inode xattr area (its ibody header
	// first) starts: after the core and i_extra_isize bytes of extra fields.
	InodeXattrOffset = InodeCoreSize + InodeExtraSize
	// InodeXattrSpace is the size of the in-inode xattr area.
	InodeXattrSpace = InodeSize - InodeXattrOffset

	inodeBlockOffset      = 0x28 // i_block
	inodeChecksumLoOffset = 0x7C // osd2.linux2.l_i_checksum_lo
	inodeChecksumHiOffset = 0x82 // i_checksum_hi
)

// Marshal encodes in into b (at least InodeCoreSize+InodeExtraSize bytes).
// The checksum fields are written as given; see SetInodeChecksum.
func (in *Inode) Marshal(b []byte) {
	_ = b[InodeCoreSize+InodeExtraSize-1]
	le := binary.LittleEndian
	le.PutUint16(b[0x00:], in.Mode)
	le.PutUint16(b[0x02:], in.UIDLo)
	le.PutUint32(b[0x04:], in.SizeLo)
	le.PutUint32(b[0x08:], in.Atime)
	le.PutUint32(b[0x0C:], in.Ctime)
	le.PutUint32(b[0x10:], in.Mtime)
	le.PutUint32(b[0x14:], in.Dtime)
	le.PutUint16(b[0x18:], in.GIDLo)
	le.PutUint16(b[0x1A:], in.LinksCount)
	le.PutUint32(b[0x1C:], in.BlocksLo)
	le.PutUint32(b[0x20:], in.Flags)
	le.PutUint32(b[0x24:], in.Version)
	copy(b[inodeBlockOffset:inodeBlockOffset+InodeBlockSize], in.Block[:])
	le.PutUint32(b[0x64:], in.Generation)
	le.PutUint32(b[0x68:], in.FileACLLo)
	le.PutUint32(b[0x6C:], in.SizeHi)
	le.PutUint32(b[0x70:], in.ObsoFaddr)
	le.PutUint16(b[0x74:], in.BlocksHi)
	le.PutUint16(b[0x76:], in.FileACLHi)
	le.PutUint16(b[0x78:], in.UIDHi)
	le.PutUint16(b[0x7A:], in.GIDHi)
	le.PutUint16(b[inodeChecksumLoOffset:], in.ChecksumLo)
	le.PutUint16(b[0x7E:], 0)
	le.PutUint16(b[0x80:], in.ExtraIsize)
	le.PutUint16(b[inodeChecksumHiOffset:], in.ChecksumHi)
	le.PutUint32(b[0x84:], in.CtimeExtra)
	le.PutUint32(b[0x88:], in.MtimeExtra)
	le.PutUint32(b[0x8C:], in.AtimeExtra)
	le.PutUint32(b[0x90:], in.Crtime)
	le.PutUint32(b[0x94:], in.CrtimeExtra)
	le.PutUint32(b[0x98:], in.VersionHi)
	le.PutUint32(b[0x9C:], in.ProjID)
}

// Unmarshal decodes an inode from b without judging it.
func (in *Inode) Unmarshal(b []byte) error {
	if len(b) < InodeCoreSize+InodeExtraSize {
		return fmt.Errorf("inode is %d bytes, need %d", len(b), InodeCoreSize+InodeExtraSize)
	}
	if _, err := binary.Decode(b, binary.LittleEndian, in); err != nil {
		return fmt.Errorf("decode inode: %w", err)
	}
	return nil
}

// SetDevice stores a device number in i_block as EncodeDev lays it out.
func (in *Inode) SetDevice(major, minor uint32) {
	w0, w1 := EncodeDev(major, minor)
	binary.LittleEndian.PutUint32(in.Block[0:], w0)
	binary.LittleEndian.PutUint32(in.Block[4:], w1)
}

// JournalBackup is the superblock's s_jnl_blocks copy of the journal
// inode in: its i_block words, then i_size_high and i_size.
func (in *Inode) JournalBackup() [17]uint32 {
	var b [17]uint32
	for k := 0; k < InodeBlockSize/4; k++ {
		b[k] = binary.LittleEndian.Uint32(in.Block[4*k:])
	}
	b[15], b[16] = in.SizeHi, in.SizeLo
	return b
}

// SetInodeChecksum computes the checksum of the whole inode record rec
// (InodeSize bytes, checksum fields ignored) and stores it in place.
func SetInodeChecksum(rec []byte, fsSeed, ino, generation uint32) {
	le := binary.LittleEndian
	le.PutUint16(rec[inodeChecksumLoOffset:], 0)
	le.PutUint16(rec[inodeChecksumHiOffset:], 0)
	c := CRC32C(InodeChecksumSeed(fsSeed, ino, generation), rec)
	le.PutUint16(rec[inodeChecksumLoOffset:], uint16(c))
	le.PutUint16(rec[inodeChecksumHiOffset:], uint16(c>>16))
}

// Range of timestamps the 32-bit seconds field plus 2 epoch bits hold.
const (
	MinTime = -1 << 31
	MaxTime = 1<<31 - 1 + 3<<32
)

// EncodeTime splits a timestamp into the 32-bit seconds field and the
// extra field (2 epoch bits plus nanoseconds << 2) as the kernel does,
// clamping out-of-range values to the representable range as it does.
func EncodeTime(sec int64, nsec uint32) (lo, extra uint32) {
	sec = min(max(sec, MinTime), MaxTime)
	nsec = min(nsec, 999999999)
	lo = uint32(int32(sec))
	epoch := uint32((sec-int64(int32(sec)))>>32) & 3
	return lo, epoch | nsec<<2
}

// DecodeTime is the inverse of EncodeTime.
func DecodeTime(lo, extra uint32) (sec int64, nsec uint32) {
	sec = int64(int32(lo)) + int64(extra&3)<<32
	return sec, extra >> 2
}

// EncodeDev returns the first two i_block words of a device inode: the old
// 16-bit encoding when major and minor both fit a byte, else the new one.
func EncodeDev(major, minor uint32) (block0, block1 uint32) {
	if major < 256 && minor < 256 {
		return major<<8 | minor, 0
	}
	return 0, minor&0xff | major<<8 | (minor&^0xff)<<12
}
