// Package disklayout holds ext4's on-disk records, constants and checksums,
// and nothing else: no planning, no I/O.
//
// Conventions, stated once: every multi-byte field is little-endian except
// inside the jbd2 journal superblock (big-endian, as jbd2 defines it); a
// field whose value is split in two carries the kernel's Lo/Hi suffixes;
// padding is named _. Struct comments name the kernel struct; the layout is
// documented in the kernel tree at Documentation/filesystems/ext4/.
package disklayout

import (
	"encoding/binary"
	"hash/crc32"
)

// Fixed sizes of ext4 records, in bytes.
const (
	SuperBlockOffset = 1024 // the primary superblock's byte offset in the device
	SuperBlockSize   = 1024 // sizeof(struct ext4_super_block)
	GroupDescSize32  = 32   // group descriptor without the 64bit feature
	GroupDescSize64  = 64   // group descriptor with the 64bit feature
	InodeCoreSize    = 128  // EXT2_GOOD_OLD_INODE_SIZE
	InodeExtraSize   = 32   // i_extra_isize this package writes
	InodeSize        = 256  // s_inode_size this package writes
	ExtentSize       = 12   // extent header, leaf and index entries alike
	DirentHeaderSize = 8    // struct ext4_dir_entry_2 without its name
	DirentTailSize   = 12   // struct ext4_dir_entry_tail
	DxTailSize       = 8    // struct dx_tail
	DxEntrySize      = 8    // struct dx_entry
	DxRootInfoSize   = 8    // struct dx_root_info
	XattrHeaderSize  = 32   // struct ext4_xattr_header
	XattrEntrySize   = 16   // struct ext4_xattr_entry without its name
	XattrIbodySize   = 4    // struct ext4_xattr_ibody_header
	MaxNameLen       = 255  // EXT4_NAME_LEN
	FastSymlinkMax   = 59   // longest target kept inline in i_block (60 bytes incl. NUL)
	MaxInitExtentLen = 32768
	MaxExtentDepth   = 5
	LinkMax          = 65000 // EXT4_LINK_MAX
)

// Magic numbers.
const (
	SuperMagic     = 0xEF53
	ExtentMagic    = 0xF30A
	XattrMagic     = 0xEA020000
	JournalMagic   = 0xC03B3998
	DirentTailType = 0xDE // file_type of the checksum tail entry
)

// Reserved inode numbers.
const (
	BadBlocksIno  = 1
	RootIno       = 2
	JournalIno    = 8
	FirstIno      = 11 // first non-reserved inode: lost+found as mkfs makes it
	FirstFreeIno  = 12
	GoodOldRevNum = 1
)

// Feature flags (s_feature_compat, s_feature_incompat, s_feature_ro_compat).
const (
	CompatHasJournal = 0x4
	CompatExtAttr    = 0x8
	CompatDirIndex   = 0x20

	IncompatFiletype = 0x2
	IncompatExtents  = 0x40
	Incompat64Bit    = 0x80
	IncompatFlexBG   = 0x200

	ROCompatSparseSuper  = 0x1
	ROCompatLargeFile    = 0x2
	ROCompatHugeFile     = 0x8
	ROCompatDirNlink     = 0x20
	ROCompatExtraIsize   = 0x40
	ROCompatMetadataCsum = 0x400
)

// Superblock s_flags and related values.
const (
	FlagsSignedHash   = 0x1
	FlagsUnsignedHash = 0x2
	HashHalfMD4       = 1
	HashTea           = 2
	StateClean        = 1
	ErrorsContinue    = 1
	ChecksumCRC32C    = 1
	JnlBackupBlocks   = 1
	MountOptXattrUser = 0x4
	MountOptACL       = 0x8
)

// Group descriptor bg_flags.
const (
	BGInodeUninit  = 0x1
	BGBlockUninit  = 0x2
	BGItableZeroed = 0x4
)

// Inode i_flags.
const (
	InodeIndexFl   = 0x1000  // EXT4_INDEX_FL: hashed directory
	InodeHugeFile  = 0x40000 // EXT4_HUGE_FILE_FL
	InodeExtentsFl = 0x80000 // EXT4_EXTENTS_FL
)

// File mode type bits (i_mode).
const (
	ModeFifo    = 0x1000
	ModeChar    = 0x2000
	ModeDir     = 0x4000
	ModeBlock   = 0x6000
	ModeRegular = 0x8000
	ModeSymlink = 0xA000
	ModeSocket  = 0xC000
)

// Directory entry file types (ext4_dir_entry_2.file_type).
const (
	FtUnknown = 0
	FtRegular = 1
	FtDir     = 2
	FtChar    = 3
	FtBlock   = 4
	FtFifo    = 5
	FtSocket  = 6
	FtSymlink = 7
)

// Extended attribute name indexes (ext4_xattr_entry.e_name_index).
const (
	XattrIndexUser       = 1
	XattrIndexACLAccess  = 2
	XattrIndexACLDefault = 3
	XattrIndexTrusted    = 4
	XattrIndexSecurity   = 6
	XattrIndexSystem     = 7
	XattrIndexRichACL    = 8
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32C continues the kernel's raw crc32c (no pre- or post-inversion) from
// seed over b; ext4 chains checksums through this form.
func CRC32C(seed uint32, b []byte) uint32 {
	return ^crc32.Update(^seed, castagnoli, b)
}

// CRC32CUint32 continues CRC32C over v encoded little-endian.
func CRC32CUint32(seed, v uint32) uint32 {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	return CRC32C(seed, b[:])
}

// FSChecksumSeed is the seed of every metadata checksum when the
// metadata_csum_seed feature is off: crc32c(~0, uuid).
func FSChecksumSeed(uuid [16]byte) uint32 {
	return CRC32C(^uint32(0), uuid[:])
}

// InodeChecksumSeed is the per-inode seed: crc32c(fs seed, ino, generation).
func InodeChecksumSeed(fsSeed, ino, generation uint32) uint32 {
	return CRC32CUint32(CRC32CUint32(fsSeed, ino), generation)
}

// RecLen is the minimal rec_len of a directory entry with a name of n bytes.
func RecLen(n int) int {
	return (DirentHeaderSize + n + 3) &^ 3
}
