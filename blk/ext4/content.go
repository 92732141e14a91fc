package ext4

import (
	"context"
	"math"
	"sort"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// contents is every piece of metadata whose bytes do not depend on where
// it lands: what planContent produces. Checksums are left to emit, which
// knows the blocks' final places.
type contents struct {
	nodes   []content // parallel to tree.nodes
	xblocks []xblock
}

// content is one node's planned metadata. A directory's or slow symlink's
// blocks are not kept: planContent sizes them and emit makes them again
// (nodeData) as it writes them, so the memory a build holds grows with the
// largest directory, not with the sum of all of them.
type content struct {
	// size is the byte length of the node's blocks: a directory's, htree
	// index blocks first, or a slow symlink's one block.
	size     uint64
	dxBlocks int    // leading htree index blocks of the node's blocks
	flags    uint32 // i_flags the layout of data needs
	xattrIn  []byte // InodeXattrSpace bytes of in-inode xattrs, or nil
	xattrBlk int32  // index into contents.xblocks, or -1
}

// xblock is one external xattr block, shared by inodes with identical
// blocks.
type xblock struct {
	data []byte // h_refcount and h_checksum not yet set
	refs uint32
}

// maxXattrRefs bounds the inodes sharing one xattr block, as the kernel
// (EXT4_XATTR_REFCOUNT_MAX) does.
const maxXattrRefs = 1024

// planContent sizes directory and symlink blocks and builds xattrs,
// charging what it keeps to b.
func planContent(ctx context.Context, t *tree, bs uint64, hashSeed [4]uint32, b *budget) (*contents, error) {
	c := &contents{nodes: make([]content, len(t.nodes))}
	xdedup := make(map[string]int32)
	var meta uint64 // stored bytes planned so far: a lower bound of the metadata
	for i := range t.nodes {
		if err := cancelled(ctx, i); err != nil {
			return nil, err
		}
		n, nc := &t.nodes[i], &c.nodes[i]
		nc.xattrBlk = -1
		data, err := nodeData(t, int32(i), nc, bs, hashSeed)
		if err != nil {
			return nil, err
		}
		nc.size = uint64(len(data))
		if err := b.transient(nc.size); err != nil {
			return nil, err
		}
		meta += nc.size
		if err := b.metadata(meta); err != nil {
			return nil, err
		}
		if n.ent != nil && len(n.ent.Xattrs) > 0 {
			nx := len(c.xblocks)
			if err := c.planXattrs(n, nc, bs, xdedup); err != nil {
				return nil, err
			}
			kept := uint64(len(nc.xattrIn))
			if len(c.xblocks) > nx {
				kept += bs
				meta += bs
			}
			if err := b.hold(kept); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

// nodeData makes node i's directory or slow symlink blocks (nil for other
// nodes) and sets nc's dxBlocks and flags. It is deterministic: emit calls
// it again to write what planContent sized.
func nodeData(t *tree, i int32, nc *content, bs uint64, hashSeed [4]uint32) ([]byte, error) {
	n := &t.nodes[i]
	switch {
	case n.typ == index.TypeDir && i == t.lpf:
		return lostFound(n, bs), nil
	case n.typ == index.TypeDir:
		return buildDir(t, n, nc, bs, hashSeed)
	case n.typ == index.TypeSymlink && len(n.ent.Linkname) > disklayout.FastSymlinkMax:
		data := make([]byte, bs)
		copy(data, n.ent.Linkname)
		return data, nil
	}
	return nil, nil
}

// lostFound lays out lost+found as mkfs does: "." and ".." in the first of
// four blocks, the others empty.
func lostFound(n *node, bs uint64) []byte {
	b := int(bs)
	lpfBlocks := lpfBytes / b
	data := make([]byte, lpfBlocks*b)
	for k := 0; k < lpfBlocks; k++ {
		blk := data[k*b : (k+1)*b]
		if k == 0 {
			off := disklayout.PutDirent(blk, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
			disklayout.PutDirent(blk[off:], disklayout.RootIno, b-off-disklayout.DirentTailSize, disklayout.FtDir, "..")
		} else {
			disklayout.PutDirent(blk, 0, b-disklayout.DirentTailSize, 0, "")
		}
	}
	return data
}

// dirEnt is a directory entry ready to be placed.
type dirEnt struct {
	name string
	ino  uint32
	ft   uint8
	hash uint32
}

// buildDir lays out a directory: one linear block when everything fits,
// else an htree (one or two index levels) over hash-ordered leaf blocks.
func buildDir(t *tree, n *node, nc *content, bs uint64, hashSeed [4]uint32) ([]byte, error) {
	b := int(bs)
	leafCap := b - disklayout.DirentTailSize
	ents := make([]dirEnt, len(n.kids))
	size := 2 * disklayout.DotDirentSize
	for k, c := range n.kids {
		kid := &t.nodes[c.node]
		ents[k] = dirEnt{name: c.name, ino: kid.ino, ft: ftype(kid.typ)}
		size += disklayout.RecLen(len(c.name))
	}
	parentIno := uint32(disklayout.RootIno)
	if n.parent >= 0 {
		parentIno = t.nodes[n.parent].ino
	}
	if size <= leafCap {
		blk := make([]byte, b)
		off := disklayout.PutDirent(blk, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
		last := off
		off += disklayout.PutDirent(blk[off:], parentIno, disklayout.DotDirentSize, disklayout.FtDir, "..")
		for _, e := range ents {
			last = off
			off += disklayout.PutDirent(blk[off:], e.ino, disklayout.RecLen(len(e.name)), e.ft, e.name)
		}
		disklayout.SetDirentRecLen(blk[last:], leafCap-last)
		return blk, nil
	}

	unsigned := false // s_flags says signed, as mkfs on x86
	for k := range ents {
		ents[k].hash = disklayout.DirHashHalfMD4([]byte(ents[k].name), hashSeed, unsigned)
	}
	sort.SliceStable(ents, func(i, j int) bool {
		if ents[i].hash != ents[j].hash {
			return ents[i].hash < ents[j].hash
		}
		return ents[i].name < ents[j].name
	})
	// Pack leaves.
	type leaf struct {
		first, end int    // range of ents
		key        uint32 // dx_entry hash
	}
	var leaves []leaf
	used := 0
	for k := range ents {
		r := disklayout.RecLen(len(ents[k].name))
		if len(leaves) == 0 || used+r > leafCap {
			key := ents[k].hash
			if len(leaves) > 0 && ents[k-1].hash == key {
				key |= 1 // the hash run continues from the previous leaf
			}
			leaves = append(leaves, leaf{first: k, end: k, key: key})
			used = 0
		}
		leaves[len(leaves)-1].end = k + 1
		used += r
	}
	rootLimit, nodeLimit := disklayout.DxRootLimit(b), disklayout.DxNodeLimit(b)
	nnodes := 0
	if len(leaves) > rootLimit {
		nnodes = (len(leaves) + nodeLimit - 1) / nodeLimit
		if nnodes > rootLimit {
			return nil, pathErr(n.path, "%d entries need more than two htree levels (large_dir)", len(ents))
		}
	}
	nblocks := 1 + nnodes + len(leaves)
	if uint64(nblocks)*bs > math.MaxUint32 {
		return nil, pathErr(n.path, "directory too large")
	}
	data := make([]byte, nblocks*b)
	firstLeaf := 1 + nnodes
	for li, l := range leaves {
		blk := data[(firstLeaf+li)*b : (firstLeaf+li+1)*b]
		off, last := 0, 0
		for _, e := range ents[l.first:l.end] {
			last = off
			off += disklayout.PutDirent(blk[off:], e.ino, disklayout.RecLen(len(e.name)), e.ft, e.name)
		}
		disklayout.SetDirentRecLen(blk[last:], leafCap-last)
	}
	root := data[:b]
	off := disklayout.PutDirent(root, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
	disklayout.PutDirent(root[off:], parentIno, b-off, disklayout.FtDir, "..")
	info := disklayout.DxRootInfo{HashVersion: disklayout.HashHalfMD4, InfoLength: disklayout.DxRootInfoSize}
	keys := make([]uint32, len(leaves))
	blocks := make([]uint32, len(leaves))
	for li, l := range leaves {
		keys[li], blocks[li] = l.key, uint32(firstLeaf+li)
	}
	if nnodes == 0 {
		info.Marshal(root[disklayout.DxRootInfoOffset:])
		disklayout.PutDxEntries(root, disklayout.DxRootCountOffset, rootLimit, keys, blocks)
	} else {
		info.IndirectLevels = 1
		info.Marshal(root[disklayout.DxRootInfoOffset:])
		var rkeys, rblocks []uint32
		for j := 0; j < nnodes; j++ {
			lo, hi := j*nodeLimit, min((j+1)*nodeLimit, len(leaves))
			blk := data[(1+j)*b : (2+j)*b]
			disklayout.PutDirent(blk, 0, b, 0, "")
			disklayout.PutDxEntries(blk, disklayout.DxNodeCountOffset, nodeLimit, keys[lo:hi], blocks[lo:hi])
			rkeys = append(rkeys, keys[lo])
			rblocks = append(rblocks, uint32(1+j))
		}
		disklayout.PutDxEntries(root, disklayout.DxRootCountOffset, rootLimit, rkeys, rblocks)
	}
	nc.dxBlocks = 1 + nnodes
	nc.flags |= disklayout.InodeIndexFl
	return data, nil
}

// xattr is one attribute in stored form.
type xattr struct {
	index uint8
	name  string
	value []byte
}

// planXattrs places an inode's xattrs in the inode while they fit and the
// rest in an external block shared by inodes with identical blocks.
func (c *contents) planXattrs(n *node, nc *content, bs uint64, dedup map[string]int32) error {
	xs := make([]xattr, 0, len(n.ent.Xattrs))
	for _, x := range n.ent.Xattrs {
		idx, suffix, ok := disklayout.XattrSplitName(x.Name)
		if !ok || len(suffix) > disklayout.MaxNameLen || strings.IndexByte(x.Name, 0) >= 0 {
			return pathErr(n.path, "xattr %q: namespace not storable in ext4", x.Name)
		}
		v := x.Value
		if idx == disklayout.XattrIndexACLAccess || idx == disklayout.XattrIndexACLDefault {
			if v, ok = disklayout.ACLToDisk(x.Value); !ok {
				return pathErr(n.path, "xattr %q: malformed POSIX ACL", x.Name)
			}
		}
		xs = append(xs, xattr{idx, suffix, v})
	}
	sort.Slice(xs, func(i, j int) bool {
		a, c := xs[i], xs[j]
		if a.index != c.index {
			return a.index < c.index
		}
		if len(a.name) != len(c.name) {
			return len(a.name) < len(c.name)
		}
		return a.name < c.name
	})
	for k := 1; k < len(xs); k++ {
		if xs[k].index == xs[k-1].index && xs[k].name == xs[k-1].name {
			return pathErr(n.path, "duplicate xattr %q in namespace %d", xs[k].name, xs[k].index)
		}
	}
	in := make([]byte, disklayout.InodeXattrSpace)
	ih := disklayout.XattrIbodyHeader{Magic: disklayout.XattrMagic}
	ih.Marshal(in)
	// The in-inode region's offsets count from the first entry.
	inReg := in[disklayout.XattrIbodySize:]
	inEnt, inVal := 0, len(inReg)
	blk := make([]byte, bs)
	bEnt, bVal := disklayout.XattrHeaderSize, len(blk)
	var bHashes []uint32
	nIn := 0
	for _, x := range xs {
		esz, vsz := disklayout.XattrEntryLen(len(x.name)), disklayout.XattrValueLen(len(x.value))
		if inEnt+esz+4 <= inVal-vsz {
			inVal -= vsz
			putXattr(inReg, inEnt, inVal, x)
			inEnt += esz
			nIn++
			continue
		}
		if bEnt+esz+4 > bVal-vsz {
			return pathErr(n.path, "xattrs do not fit the inode and one %d-byte block", bs)
		}
		bVal -= vsz
		bHashes = append(bHashes, putXattr(blk, bEnt, bVal, x))
		bEnt += esz
	}
	if nIn > 0 {
		nc.xattrIn = in
	}
	if len(bHashes) == 0 {
		return nil
	}
	h := disklayout.XattrHeader{Magic: disklayout.XattrMagic, Blocks: 1, Hash: disklayout.XattrBlockHash(bHashes)}
	h.Marshal(blk)
	key := string(blk)
	if xi, ok := dedup[key]; ok && c.xblocks[xi].refs < maxXattrRefs {
		c.xblocks[xi].refs++
		nc.xattrBlk = xi
		return nil
	}
	nc.xattrBlk = int32(len(c.xblocks))
	dedup[key] = nc.xattrBlk
	c.xblocks = append(c.xblocks, xblock{data: blk, refs: 1})
	return nil
}

// putXattr writes entry x at entOff with its value at valOff (both
// relative to reg, where e_value_offs counts from) and returns its hash.
func putXattr(reg []byte, entOff, valOff int, x xattr) uint32 {
	e := disklayout.XattrEntry{NameLen: uint8(len(x.name)), NameIndex: x.index,
		ValueSize: uint32(len(x.value)), Hash: disklayout.XattrEntryHash(x.name, x.value)}
	if len(x.value) > 0 {
		e.ValueOffs = uint16(valOff)
		copy(reg[valOff:], x.value)
	}
	e.Marshal(reg[entOff:])
	copy(reg[entOff+disklayout.XattrEntrySize:], x.name)
	return e.Hash
}
