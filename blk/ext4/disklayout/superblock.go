package disklayout

import (
	"encoding/binary"
	"fmt"
)

// SuperBlock is struct ext4_super_block (1024 bytes) with every field in its
// on-disk position; encoding/binary lays it out without gaps.
type SuperBlock struct {
	InodesCount          uint32 // s_inodes_count
	BlocksCountLo        uint32 // s_blocks_count_lo
	RBlocksCountLo       uint32 // s_r_blocks_count_lo
	FreeBlocksCountLo    uint32 // s_free_blocks_count_lo
	FreeInodesCount      uint32 // s_free_inodes_count
	FirstDataBlock       uint32 // s_first_data_block
	LogBlockSize         uint32 // s_log_block_size
	LogClusterSize       uint32 // s_log_cluster_size
	BlocksPerGroup       uint32 // s_blocks_per_group
	ClustersPerGroup     uint32 // s_clusters_per_group
	InodesPerGroup       uint32 // s_inodes_per_group
	Mtime                uint32 // s_mtime
	Wtime                uint32 // s_wtime
	MntCount             uint16 // s_mnt_count
	MaxMntCount          uint16 // s_max_mnt_count
	Magic                uint16 // s_magic
	State                uint16 // s_state
	Errors               uint16 // s_errors
	MinorRevLevel        uint16 // s_minor_rev_level
	LastCheck            uint32 // s_lastcheck
	CheckInterval        uint32 // s_checkinterval
	CreatorOS            uint32 // s_creator_os
	RevLevel             uint32 // s_rev_level
	DefResUID            uint16 // s_def_resuid
	DefResGID            uint16 // s_def_resgid
	FirstIno             uint32 // s_first_ino
	InodeSize            uint16 // s_inode_size
	BlockGroupNr         uint16 // s_block_group_nr
	FeatureCompat        uint32 // s_feature_compat
	FeatureIncompat      uint32 // s_feature_incompat
	FeatureROCompat      uint32 // s_feature_ro_compat
	UUID                 [16]byte
	VolumeName           [16]byte
	LastMounted          [64]byte
	AlgorithmUsageBitmap uint32
	PreallocBlocks       uint8
	PreallocDirBlocks    uint8
	ReservedGDTBlocks    uint16
	JournalUUID          [16]byte
	JournalInum          uint32
	JournalDev           uint32
	LastOrphan           uint32
	HashSeed             [4]uint32
	DefHashVersion       uint8
	JnlBackupType        uint8
	DescSize             uint16
	DefaultMountOpts     uint32
	FirstMetaBG          uint32
	MkfsTime             uint32
	JnlBlocks            [17]uint32
	BlocksCountHi        uint32
	RBlocksCountHi       uint32
	FreeBlocksCountHi    uint32
	MinExtraIsize        uint16
	WantExtraIsize       uint16
	Flags                uint32
	RaidStride           uint16
	MmpInterval          uint16
	MmpBlock             uint64
	RaidStripeWidth      uint32
	LogGroupsPerFlex     uint8
	ChecksumType         uint8
	EncryptionLevel      uint8
	_                    uint8
	KbytesWritten        uint64
	SnapshotInum         uint32
	SnapshotID           uint32
	SnapshotRBlocksCount uint64
	SnapshotList         uint32
	ErrorCount           uint32
	FirstErrorTime       uint32
	FirstErrorIno        uint32
	FirstErrorBlock      uint64
	FirstErrorFunc       [32]byte
	FirstErrorLine       uint32
	LastErrorTime        uint32
	LastErrorIno         uint32
	LastErrorLine        uint32
	LastErrorBlock       uint64
	LastErrorFunc        [32]byte
	MountOpts            [64]byte
	UsrQuotaInum         uint32
	GrpQuotaInum         uint32
	OverheadClusters     uint32
	BackupBGs            [2]uint32
	EncryptAlgos         [4]uint8
	EncryptPwSalt        [16]byte
	LpfIno               uint32
	PrjQuotaInum         uint32
	ChecksumSeed         uint32
	WtimeHi              uint8
	MtimeHi              uint8
	MkfsTimeHi           uint8
	LastCheckHi          uint8
	FirstErrorTimeHi     uint8
	LastErrorTimeHi      uint8
	FirstErrorErrcode    uint8
	LastErrorErrcode     uint8
	Encoding             uint16
	EncodingFlags        uint16
	OrphanFileInum       uint32
	_                    [94]uint32
	Checksum             uint32 // s_checksum: crc32c(~0, bytes [0, 1020))
}

// superChecksumOffset is where s_checksum lives.
const superChecksumOffset = SuperBlockSize - 4

// Marshal encodes sb into b (at least SuperBlockSize bytes), computing
// s_checksum when metadata_csum is on.
func (sb *SuperBlock) Marshal(b []byte) error {
	if len(b) < SuperBlockSize {
		return fmt.Errorf("superblock buffer is %d bytes, need %d", len(b), SuperBlockSize)
	}
	if _, err := binary.Encode(b[:SuperBlockSize], binary.LittleEndian, sb); err != nil {
		return fmt.Errorf("encode superblock: %w", err)
	}
	if sb.FeatureROCompat&ROCompatMetadataCsum != 0 {
		binary.LittleEndian.PutUint32(b[superChecksumOffset:], CRC32C(^uint32(0), b[:superChecksumOffset]))
	}
	return nil
}

// Unmarshal decodes a superblock from b without judging it.
func (sb *SuperBlock) Unmarshal(b []byte) error {
	if len(b) < SuperBlockSize {
		return fmt.Errorf("superblock is %d bytes, need %d", len(b), SuperBlockSize)
	}
	if _, err := binary.Decode(b[:SuperBlockSize], binary.LittleEndian, sb); err != nil {
		return fmt.Errorf("decode superblock: %w", err)
	}
	return nil
}

// HashSeedWords is s_hash_seed holding a 16-byte seed (a UUID, as mkfs
// makes it) in its on-disk word order.
func HashSeedWords(seed [16]byte) [4]uint32 {
	var w [4]uint32
	for i := range w {
		w[i] = binary.LittleEndian.Uint32(seed[4*i:])
	}
	return w
}

// GroupDesc is struct ext4_group_desc in its 64-byte (64bit feature) form.
type GroupDesc struct {
	BlockBitmapLo     uint32 // bg_block_bitmap_lo
	InodeBitmapLo     uint32 // bg_inode_bitmap_lo
	InodeTableLo      uint32 // bg_inode_table_lo
	FreeBlocksCountLo uint16 // bg_free_blocks_count_lo
	FreeInodesCountLo uint16 // bg_free_inodes_count_lo
	UsedDirsCountLo   uint16 // bg_used_dirs_count_lo
	Flags             uint16 // bg_flags
	ExcludeBitmapLo   uint32 // bg_exclude_bitmap_lo
	BlockBitmapCsumLo uint16 // bg_block_bitmap_csum_lo
	InodeBitmapCsumLo uint16 // bg_inode_bitmap_csum_lo
	ItableUnusedLo    uint16 // bg_itable_unused_lo
	Checksum          uint16 // bg_checksum
	BlockBitmapHi     uint32 // bg_block_bitmap_hi
	InodeBitmapHi     uint32 // bg_inode_bitmap_hi
	InodeTableHi      uint32 // bg_inode_table_hi
	FreeBlocksCountHi uint16 // bg_free_blocks_count_hi
	FreeInodesCountHi uint16 // bg_free_inodes_count_hi
	UsedDirsCountHi   uint16 // bg_used_dirs_count_hi
	ItableUnusedHi    uint16 // bg_itable_unused_hi
	ExcludeBitmapHi   uint32 // bg_exclude_bitmap_hi
	BlockBitmapCsumHi uint16 // bg_block_bitmap_csum_hi
	InodeBitmapCsumHi uint16 // bg_inode_bitmap_csum_hi
	_                 uint32 // bg_reserved
}

// groupDescChecksumOffset is where bg_checksum lives.
const groupDescChecksumOffset = 0x1E

// Marshal encodes gd for group number group into b (GroupDescSize64
// bytes) and sets bg_checksum: crc32c(fs seed, group, desc without the
// checksum field) truncated to 16 bits.
func (gd *GroupDesc) Marshal(b []byte, fsSeed uint32, group uint32) {
	_ = b[GroupDescSize64-1]
	le := binary.LittleEndian
	le.PutUint32(b[0x00:], gd.BlockBitmapLo)
	le.PutUint32(b[0x04:], gd.InodeBitmapLo)
	le.PutUint32(b[0x08:], gd.InodeTableLo)
	le.PutUint16(b[0x0C:], gd.FreeBlocksCountLo)
	le.PutUint16(b[0x0E:], gd.FreeInodesCountLo)
	le.PutUint16(b[0x10:], gd.UsedDirsCountLo)
	le.PutUint16(b[0x12:], gd.Flags)
	le.PutUint32(b[0x14:], gd.ExcludeBitmapLo)
	le.PutUint16(b[0x18:], gd.BlockBitmapCsumLo)
	le.PutUint16(b[0x1A:], gd.InodeBitmapCsumLo)
	le.PutUint16(b[0x1C:], gd.ItableUnusedLo)
	le.PutUint16(b[0x1E:], 0)
	le.PutUint32(b[0x20:], gd.BlockBitmapHi)
	le.PutUint32(b[0x24:], gd.InodeBitmapHi)
	le.PutUint32(b[0x28:], gd.InodeTableHi)
	le.PutUint16(b[0x2C:], gd.FreeBlocksCountHi)
	le.PutUint16(b[0x2E:], gd.FreeInodesCountHi)
	le.PutUint16(b[0x30:], gd.UsedDirsCountHi)
	le.PutUint16(b[0x32:], gd.ItableUnusedHi)
	le.PutUint32(b[0x34:], gd.ExcludeBitmapHi)
	le.PutUint16(b[0x38:], gd.BlockBitmapCsumHi)
	le.PutUint16(b[0x3A:], gd.InodeBitmapCsumHi)
	le.PutUint32(b[0x3C:], 0)
	c := CRC32CUint32(fsSeed, group)
	c = CRC32C(c, b[:groupDescChecksumOffset])
	c = CRC32C(c, []byte{0, 0})
	c = CRC32C(c, b[groupDescChecksumOffset+2:GroupDescSize64])
	gd.Checksum = uint16(c)
	le.PutUint16(b[groupDescChecksumOffset:], gd.Checksum)
}

// BitmapChecksum is the checksum of a block or inode bitmap: crc32c(fs seed,
// the first n bytes), split by the caller into the descriptor's lo/hi halves.
func BitmapChecksum(fsSeed uint32, bitmap []byte) uint32 {
	return CRC32C(fsSeed, bitmap)
}

// HasSuper reports whether group g carries a superblock backup under
// sparse_super: groups 0, 1 and powers of 3, 5 and 7.
func HasSuper(g uint64) bool {
	if g <= 1 {
		return true
	}
	if g&1 == 0 {
		return false
	}
	for _, base := range [...]uint64{3, 5, 7} {
		p := base
		for p < g {
			p *= base
		}
		if p == g {
			return true
		}
	}
	return false
}
