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

// Byte offsets inside directory blocks and records.
const (
	// DotDirentSize is the rec_len of the "." entry, and of ".." when
	// entries follow it: RecLen of a 1- or 2-byte name.
	DotDirentSize = 12
	// DxRootInfoOffset is where dx_root_info starts in an htree root,
	// after the "." and ".." entries.
	DxRootInfoOffset = 2 * DotDirentSize
	// DxRootCountOffset is where dx_countlimit starts in an htree root.
	DxRootCountOffset = DxRootInfoOffset + DxRootInfoSize
	// DxNodeCountOffset is where dx_countlimit starts in an interior htree
	// block, after the empty dirent that spans the block.
	DxNodeCountOffset = DirentHeaderSize

	direntRecLenOffset   = 4 // ext4_dir_entry_2.rec_len
	direntTailCsumOffset = 8 // ext4_dir_entry_tail.det_checksum
	dxCountOffset        = 2 // dx_countlimit.count
	dxEntryBlockOffset   = 4 // dx_entry.block
	dxTailChecksumOffset = 4 // dx_tail.dt_checksum
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

// Marshal encodes d into b (at least DirentHeaderSize bytes).
func (d *Dirent) Marshal(b []byte) {
	_ = b[DirentHeaderSize-1]
	le := binary.LittleEndian
	le.PutUint32(b[0:], d.Inode)
	le.PutUint16(b[direntRecLenOffset:], d.RecLen)
	b[6] = d.NameLen
	b[7] = d.FileType
}

// PutDirent encodes a directory entry with its name at b and returns the
// bytes it occupies (recLen).
func PutDirent(b []byte, ino uint32, recLen int, ft uint8, name string) int {
	d := Dirent{Inode: ino, RecLen: uint16(recLen), NameLen: uint8(len(name)), FileType: ft}
	d.Marshal(b)
	copy(b[DirentHeaderSize:], name)
	return recLen
}

// SetDirentRecLen changes the rec_len of the entry at b, as the last entry
// of a block is stretched to the block's end.
func SetDirentRecLen(b []byte, recLen int) {
	binary.LittleEndian.PutUint16(b[direntRecLenOffset:], uint16(recLen))
}

// Marshal encodes t into b (at least DirentTailSize bytes).
func (t *DirentTail) Marshal(b []byte) {
	_ = b[DirentTailSize-1]
	le := binary.LittleEndian
	le.PutUint32(b[0:], t.ReservedZero1)
	le.PutUint16(b[4:], t.RecLen)
	b[6] = t.ReservedZero2
	b[7] = t.ReservedFt
	le.PutUint32(b[direntTailCsumOffset:], t.Checksum)
}

// SetDirentTail writes the checksum tail at the end of a leaf block:
// crc32c(inode seed, block without the tail).
func SetDirentTail(blk []byte, inodeSeed uint32) {
	body := len(blk) - DirentTailSize
	t := DirentTail{RecLen: DirentTailSize, ReservedFt: DirentTailType, Checksum: CRC32C(inodeSeed, blk[:body])}
	t.Marshal(blk[body:])
}

// Marshal encodes r into b (at least DxRootInfoSize bytes).
func (r *DxRootInfo) Marshal(b []byte) {
	_ = b[DxRootInfoSize-1]
	binary.LittleEndian.PutUint32(b[0:], r.ReservedZero)
	b[4] = r.HashVersion
	b[5] = r.InfoLength
	b[6] = r.IndirectLevels
	b[7] = r.UnusedFlags
}

// PutDxEntries writes the dx_countlimit at countOffset of an htree block
// and the entries mapping hashes[k] to blocks[k]. The first entry's hash
// slot holds the count and limit, so hashes[0] is implied (0) and unused.
func PutDxEntries(blk []byte, countOffset, limit int, hashes, blocks []uint32) {
	le := binary.LittleEndian
	b := blk[countOffset:]
	le.PutUint16(b, uint16(limit))
	le.PutUint16(b[dxCountOffset:], uint16(len(hashes)))
	le.PutUint32(b[dxEntryBlockOffset:], blocks[0])
	for k := 1; k < len(hashes); k++ {
		e := b[k*DxEntrySize:]
		le.PutUint32(e, hashes[k])
		le.PutUint32(e[dxEntryBlockOffset:], blocks[k])
	}
}

// SetDxChecksum writes the dx_tail of an htree block whose count/limit
// header is at countOffset: crc32c over the header and count entries, then
// over dt_reserved and a zero checksum.
func SetDxChecksum(blk []byte, countOffset int, inodeSeed uint32) {
	le := binary.LittleEndian
	limit := int(le.Uint16(blk[countOffset:]))
	count := int(le.Uint16(blk[countOffset+dxCountOffset:]))
	t := countOffset + limit*DxEntrySize
	c := CRC32C(inodeSeed, blk[:countOffset+count*DxEntrySize])
	c = CRC32C(c, blk[t:t+dxTailChecksumOffset])
	c = CRC32C(c, []byte{0, 0, 0, 0})
	le.PutUint32(blk[t+dxTailChecksumOffset:], c)
}
