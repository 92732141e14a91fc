package disklayout

import "encoding/binary"

// Dirent is struct ext4_dir_entry_2 without its name.
type Dirent struct {
	Inode    uint32 // inode
	RecLen   uint16 // rec_len
	NameLen  uint8  // name_len
	FileType uint8  // file_type
}

// DirentTail is struct ext4_dir_entry_tail, the last 12 bytes of a leaf
// directory block under metadata_csum.
type DirentTail struct {
	ReservedZero1 uint32 // det_reserved_zero1
	RecLen        uint16 // det_rec_len (12)
	ReservedZero2 uint8  // det_reserved_zero2
	ReservedFt    uint8  // det_reserved_ft (0xDE)
	Checksum      uint32 // det_checksum
}

// DxRootInfo is struct dx_root_info, after the "." and ".." entries of an
// htree root block.
type DxRootInfo struct {
	ReservedZero   uint32 // reserved_zero
	HashVersion    uint8  // hash_version
	InfoLength     uint8  // info_length (8)
	IndirectLevels uint8  // indirect_levels
	UnusedFlags    uint8  // unused_flags
}

// DxCountLimit is struct dx_countlimit, overlaying the first dx_entry's hash.
type DxCountLimit struct {
	Limit uint16 // limit
	Count uint16 // count
}

// DxEntry is struct dx_entry.
type DxEntry struct {
	Hash  uint32 // hash
	Block uint32 // block: logical block of the child
}

// DxTail is struct dx_tail, after limit entries of an htree node.
type DxTail struct {
	Reserved uint32 // dt_reserved
	Checksum uint32 // dt_checksum
}

// Byte offsets of the count/limit header in htree blocks.
const (
	DxRootCountOffset = 12 + 12 + DxRootInfoSize // after ".", ".." and dx_root_info
	DxNodeCountOffset = DirentHeaderSize         // after the empty fake dirent
)

// DxRootLimit is the number of dx_entry slots of a root block with the
// dx_tail reserved.
func DxRootLimit(blockSize int) int {
	return (blockSize-DxRootCountOffset)/DxEntrySize - 1
}

// DxNodeLimit is the number of dx_entry slots of an interior node block with
// the dx_tail reserved.
func DxNodeLimit(blockSize int) int {
	return (blockSize-DxNodeCountOffset)/DxEntrySize - 1
}

// PutDirent encodes a directory entry with its name at b and returns the
// bytes it occupies (recLen).
func PutDirent(b []byte, ino uint32, recLen int, ft uint8, name string) int {
	le := binary.LittleEndian
	le.PutUint32(b[0:], ino)
	le.PutUint16(b[4:], uint16(recLen))
	b[6] = uint8(len(name))
	b[7] = ft
	copy(b[8:], name)
	return recLen
}

// SetDirentTail writes the checksum tail at the end of a leaf block:
// crc32c(inode seed, block without the tail).
func SetDirentTail(blk []byte, inodeSeed uint32) {
	t := blk[len(blk)-DirentTailSize:]
	le := binary.LittleEndian
	le.PutUint32(t[0:], 0)
	le.PutUint16(t[4:], DirentTailSize)
	t[6] = 0
	t[7] = DirentTailType
	le.PutUint32(t[8:], CRC32C(inodeSeed, blk[:len(blk)-DirentTailSize]))
}

// SetDxChecksum writes the dx_tail of an htree block whose count/limit
// header is at countOffset: crc32c over the header and count entries, then
// over dt_reserved and a zero checksum.
func SetDxChecksum(blk []byte, countOffset int, inodeSeed uint32) {
	le := binary.LittleEndian
	limit := int(le.Uint16(blk[countOffset:]))
	count := int(le.Uint16(blk[countOffset+2:]))
	t := countOffset + limit*DxEntrySize
	c := CRC32C(inodeSeed, blk[:countOffset+count*DxEntrySize])
	c = CRC32C(c, blk[t:t+4])
	c = CRC32C(c, []byte{0, 0, 0, 0})
	le.PutUint32(blk[t+4:], c)
}
