package disklayout

import (
	"encoding/binary"
	"strings"
)

// XattrHeader is struct ext4_xattr_header, at the start of an xattr block.
type XattrHeader struct {
	Magic    uint32    // h_magic
	Refcount uint32    // h_refcount
	Blocks   uint32    // h_blocks (1)
	Hash     uint32    // h_hash
	Checksum uint32    // h_checksum
	_        [3]uint32 // h_reserved
}

// XattrEntry is struct ext4_xattr_entry without its name.
type XattrEntry struct {
	NameLen   uint8  // e_name_len
	NameIndex uint8  // e_name_index
	ValueOffs uint16 // e_value_offs
	ValueInum uint32 // e_value_inum
	ValueSize uint32 // e_value_size
	Hash      uint32 // e_hash
}

// XattrIbodyHeader is struct ext4_xattr_ibody_header, at the start of the
// in-inode xattr area.
type XattrIbodyHeader struct {
	Magic uint32 // h_magic
}

// Offsets of the xattr block header fields patched in place.
const (
	xattrRefcountOffset = 0x04 // h_refcount
	xattrChecksumOffset = 0x10 // h_checksum
)

// SetXattrRefcount stores h_refcount, the number of inodes sharing the
// xattr block blk.
func SetXattrRefcount(blk []byte, refs uint32) {
	binary.LittleEndian.PutUint32(blk[xattrRefcountOffset:], refs)
}

// Marshal encodes h into b (at least XattrHeaderSize bytes).
func (h *XattrHeader) Marshal(b []byte) {
	_ = b[XattrHeaderSize-1]
	le := binary.LittleEndian
	le.PutUint32(b[0x00:], h.Magic)
	le.PutUint32(b[xattrRefcountOffset:], h.Refcount)
	le.PutUint32(b[0x08:], h.Blocks)
	le.PutUint32(b[0x0C:], h.Hash)
	le.PutUint32(b[xattrChecksumOffset:], h.Checksum)
	clear(b[0x14:XattrHeaderSize])
}

// Marshal encodes e into b (at least XattrEntrySize bytes); the name
// follows it.
func (e *XattrEntry) Marshal(b []byte) {
	_ = b[XattrEntrySize-1]
	le := binary.LittleEndian
	b[0] = e.NameLen
	b[1] = e.NameIndex
	le.PutUint16(b[2:], e.ValueOffs)
	le.PutUint32(b[4:], e.ValueInum)
	le.PutUint32(b[8:], e.ValueSize)
	le.PutUint32(b[12:], e.Hash)
}

// Marshal encodes h into b (at least XattrIbodySize bytes).
func (h *XattrIbodyHeader) Marshal(b []byte) {
	binary.LittleEndian.PutUint32(b[:XattrIbodySize], h.Magic)
}

// xattrPrefixes maps name prefixes to name indexes; full-name entries
// (posix ACLs) come first so they win over "system.".
var xattrPrefixes = [...]struct {
	prefix string
	index  uint8
	exact  bool
}{
	{"system.posix_acl_access", XattrIndexACLAccess, true},
	{"system.posix_acl_default", XattrIndexACLDefault, true},
	{"system.richacl", XattrIndexRichACL, true},
	{"user.", XattrIndexUser, false},
	{"trusted.", XattrIndexTrusted, false},
	{"security.", XattrIndexSecurity, false},
	{"system.", XattrIndexSystem, false},
}

// XattrSplitName returns the name index and the stored suffix of a full
// xattr name, or ok=false for a namespace ext4 cannot store.
func XattrSplitName(name string) (index uint8, suffix string, ok bool) {
	for _, p := range xattrPrefixes {
		if p.exact {
			if name == p.prefix {
				return p.index, "", true
			}
			continue
		}
		if s, found := strings.CutPrefix(name, p.prefix); found && s != "" {
			return p.index, s, true
		}
	}
	return 0, "", false
}

// XattrEntryLen is the padded size of an entry with an n-byte name.
func XattrEntryLen(n int) int {
	return (XattrEntrySize + n + 3) &^ 3
}

// XattrValueLen is the padded size of an n-byte value.
func XattrValueLen(n int) int {
	return (n + 3) &^ 3
}

// XattrEntryHash is ext4_xattr_hash_entry over the stored name suffix and
// the value padded with zeros to 4 bytes.
func XattrEntryHash(name string, value []byte) uint32 {
	var h uint32
	for i := 0; i < len(name); i++ {
		h = h<<5 ^ h>>27 ^ uint32(name[i])
	}
	for i := 0; i < len(value); i += 4 {
		var w [4]byte
		copy(w[:], value[i:])
		h = h<<16 ^ h>>16 ^ binary.LittleEndian.Uint32(w[:])
	}
	return h
}

// XattrBlockHash is ext4_xattr_rehash: the block hash over its entry hashes.
func XattrBlockHash(entryHashes []uint32) uint32 {
	var h uint32
	for _, e := range entryHashes {
		if e == 0 {
			return 0
		}
		h = h<<16 ^ h>>16 ^ e
	}
	return h
}

// SetXattrBlockChecksum stores h_checksum of the xattr block at physical
// block pblk: crc32c(fs seed, le64 pblk, block with a zero checksum).
func SetXattrBlockChecksum(blk []byte, fsSeed uint32, pblk uint64) {
	var nb [8]byte
	binary.LittleEndian.PutUint64(nb[:], pblk)
	binary.LittleEndian.PutUint32(blk[xattrChecksumOffset:], 0)
	c := CRC32C(fsSeed, nb[:])
	c = CRC32C(c, blk)
	binary.LittleEndian.PutUint32(blk[xattrChecksumOffset:], c)
}

// ACL entry tags shared by the VFS xattr form and ext4's disk form.
const (
	aclUserObj  = 0x01
	aclUser     = 0x02
	aclGroupObj = 0x04
	aclGroup    = 0x08
	aclMask     = 0x10
	aclOther    = 0x20
)

// ACLToDisk converts a POSIX ACL from the VFS xattr form (version 2, 8-byte
// entries) to ext4's disk form (version 1, 4-byte entries without an id for
// the *_OBJ, MASK and OTHER tags). ok is false for malformed input.
func ACLToDisk(v []byte) (out []byte, ok bool) {
	le := binary.LittleEndian
	if len(v) < 4 || (len(v)-4)%8 != 0 || le.Uint32(v) != 2 {
		return nil, false
	}
	out = le.AppendUint32(make([]byte, 0, len(v)), 1)
	for p := v[4:]; len(p) >= 8; p = p[8:] {
		tag, perm, id := le.Uint16(p), le.Uint16(p[2:]), le.Uint32(p[4:])
		switch tag {
		case aclUserObj, aclGroupObj, aclMask, aclOther:
			out = le.AppendUint16(le.AppendUint16(out, tag), perm)
		case aclUser, aclGroup:
			out = le.AppendUint32(le.AppendUint16(le.AppendUint16(out, tag), perm), id)
		default:
			return nil, false
		}
	}
	return out, true
}

// ACLFromDisk is the inverse of ACLToDisk, for readers and tests.
func ACLFromDisk(v []byte) (out []byte, ok bool) {
	le := binary.LittleEndian
	if len(v) < 4 || le.Uint32(v) != 1 {
		return nil, false
	}
	out = le.AppendUint32(nil, 2)
	for p := v[4:]; len(p) > 0; {
		if len(p) < 4 {
			return nil, false
		}
		tag, perm := le.Uint16(p), le.Uint16(p[2:])
		switch tag {
		case aclUserObj, aclGroupObj, aclMask, aclOther:
			out = le.AppendUint32(le.AppendUint16(le.AppendUint16(out, tag), perm), ^uint32(0))
			p = p[4:]
		case aclUser, aclGroup:
			if len(p) < 8 {
				return nil, false
			}
			out = le.AppendUint32(le.AppendUint16(le.AppendUint16(out, tag), perm), le.Uint32(p[4:]))
			p = p[8:]
		default:
			return nil, false
		}
	}
	return out, true
}
