package disklayout

import "encoding/binary"

// ExtentHeader is struct ext4_extent_header.
type ExtentHeader struct {
	Magic      uint16 // eh_magic
	Entries    uint16 // eh_entries
	Max        uint16 // eh_max
	Depth      uint16 // eh_depth
	Generation uint32 // eh_generation
}

// Extent is struct ext4_extent, a leaf entry.
type Extent struct {
	Block   uint32 // ee_block: first logical block
	Len     uint16 // ee_len
	StartHi uint16 // ee_start_hi
	StartLo uint32 // ee_start_lo
}

// ExtentIdx is struct ext4_extent_idx, an interior entry.
type ExtentIdx struct {
	Block  uint32 // ei_block
	LeafLo uint32 // ei_leaf_lo
	LeafHi uint16 // ei_leaf_hi
	_      uint16 // ei_unused
}

// ExtentTail is struct ext4_extent_tail, after eh_max entries of a tree block.
type ExtentTail struct {
	Checksum uint32 // et_checksum
}

// ExtentRootMax is eh_max of the tree root kept in an inode's i_block.
const ExtentRootMax = (InodeBlockSize - ExtentSize) / ExtentSize

// extentMaxOffset is where eh_max lives in the extent header.
const extentMaxOffset = 4

// ExtentEntry returns the k-th entry (leaf or index) of the tree node that
// starts at node: entries follow the header.
func ExtentEntry(node []byte, k int) []byte {
	return node[ExtentSize*(1+k):][:ExtentSize]
}

// Marshal encodes h into b.
func (h *ExtentHeader) Marshal(b []byte) {
	_ = b[ExtentSize-1]
	le := binary.LittleEndian
	le.PutUint16(b[0:], h.Magic)
	le.PutUint16(b[2:], h.Entries)
	le.PutUint16(b[extentMaxOffset:], h.Max)
	le.PutUint16(b[6:], h.Depth)
	le.PutUint32(b[8:], h.Generation)
}

// Start is the first physical block of e.
func (e *Extent) Start() uint64 { return uint64(e.StartHi)<<32 | uint64(e.StartLo) }

// MarshalLeaf encodes a leaf entry mapping logical block lblk to physical
// block pblk for n blocks.
func MarshalLeaf(b []byte, lblk uint32, n uint16, pblk uint64) {
	_ = b[ExtentSize-1]
	le := binary.LittleEndian
	le.PutUint32(b[0:], lblk)
	le.PutUint16(b[4:], n)
	le.PutUint16(b[6:], uint16(pblk>>32))
	le.PutUint32(b[8:], uint32(pblk))
}

// MarshalIdx encodes an index entry whose child at physical block pblk
// covers logical blocks from lblk on.
func MarshalIdx(b []byte, lblk uint32, pblk uint64) {
	_ = b[ExtentSize-1]
	le := binary.LittleEndian
	le.PutUint32(b[0:], lblk)
	le.PutUint32(b[4:], uint32(pblk))
	le.PutUint16(b[8:], uint16(pblk>>32))
	le.PutUint16(b[10:], 0)
}

// ExtentsPerBlock is eh_max of a tree block of the given size: the header
// and the 4-byte tail leave room for this many entries.
func ExtentsPerBlock(blockSize int) int {
	return (blockSize - ExtentSize) / ExtentSize
}

// SetExtentBlockChecksum stores the checksum of a tree block whose header
// says eh_max entries: crc32c(inode seed, header and eh_max entries).
func SetExtentBlockChecksum(blk []byte, inodeSeed uint32) {
	max := int(binary.LittleEndian.Uint16(blk[extentMaxOffset:]))
	end := ExtentSize * (1 + max)
	binary.LittleEndian.PutUint32(blk[end:], CRC32C(inodeSeed, blk[:end]))
}
