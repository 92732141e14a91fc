package disklayout

import "encoding/binary"

// JournalSuperBlock is the part of jbd2's journal_superblock_t this package
// writes; the record occupies the whole first journal block and, unlike
// the rest of ext4, is big-endian.
type JournalSuperBlock struct {
	HeaderMagic     uint32   // s_header.h_magic
	HeaderBlocktype uint32   // s_header.h_blocktype: 4 = superblock v2
	HeaderSequence  uint32   // s_header.h_sequence
	BlockSize       uint32   // s_blocksize
	MaxLen          uint32   // s_maxlen: journal length in blocks
	First           uint32   // s_first: first log block
	Sequence        uint32   // s_sequence: first expected commit id
	Start           uint32   // s_start: 0 means the journal is clean
	Errno           int32    // s_errno
	FeatureCompat   uint32   // s_feature_compat
	FeatureIncompat uint32   // s_feature_incompat
	FeatureROCompat uint32   // s_feature_ro_compat
	UUID            [16]byte // s_uuid
	NrUsers         uint32   // s_nr_users
	DynSuper        uint32   // s_dynsuper
	MaxTransaction  uint32   // s_max_transaction
	MaxTransData    uint32   // s_max_trans_data
	ChecksumType    uint8    // s_checksum_type
	_               [3]uint8 // s_padding2
	NumFCBlocks     uint32   // s_num_fc_blks
	_               [41]uint32
	Checksum        uint32    // s_checksum
	Users           [768]byte // s_users: 16-byte ids of filesystems sharing the journal
}

// JournalSuperBlockSize is the encoded size of JournalSuperBlock.
const JournalSuperBlockSize = 0x400

// Jbd2SuperblockV2 is the h_blocktype of a version 2 journal superblock.
const Jbd2SuperblockV2 = 4

// Marshal encodes j big-endian into b.
func (j *JournalSuperBlock) Marshal(b []byte) error {
	_, err := binary.Encode(b[:JournalSuperBlockSize], binary.BigEndian, j)
	return err
}
