package ext4

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sort"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// ErrInvalidIndex reports an index Build cannot turn into a filesystem;
// the wrapping error names the offending path.
var ErrInvalidIndex = errors.New("ext4: invalid index")

// Limits of what Build accepts.
const (
	maxIno        = 1 << 28 // explicit inode numbers above this are refused
	maxSymlinkLen = 4095
	maxFileBlocks = 1 << 32 // logical blocks addressable by an extent
	maxGroups     = 1 << 20
	lpfBytes      = 16384 // lost+found size, as mkfs makes it
	cancelEvery   = 4096
	// maxJournalBlocks is mkfs's upper limit on a journal's length.
	maxJournalBlocks = 10240000
)

// fext is one extent of an inode: logical block, physical block, length.
type fext struct {
	lblk uint32
	n    uint32
	pblk uint64
}

// child is one name in a directory.
type child struct {
	name string
	node int32
}

// node is one inode being planned.
type node struct {
	ent     *index.Entry // nil for inodes Build creates itself
	path    string
	ino     uint32
	typ     index.Type
	nlink   uint32
	parent  int32
	kids    []child
	subdirs uint32

	// planned
	dirData  []byte // directory blocks with checksums, or a slow symlink's block
	dxBlocks int    // leading htree blocks of dirData
	metaRuns []brange
	exts     []fext
	treeBlks []uint64
	xattrIn  []byte // InodeSize-160 bytes of in-inode xattrs, or nil
	xattrBlk int32  // index into builder.xblocks, or -1
	dataBlks uint64 // data blocks mapped by extents
	flags    uint32
}

// xblock is one shared external xattr block.
type xblock struct {
	data []byte // checksum not yet set
	refs uint32
	pblk uint64
}

type builder struct {
	ctx      context.Context
	idx      *index.Index
	opts     Options
	bs       uint64
	fsSeed   uint32
	uuid     [16]byte
	hashSeed [4]uint32

	nodes   []node
	byPath  map[string]int32
	xblocks []xblock
	lpf     int32 // lost+found node, or -1 if the index brings its own
	journal int32 // journal node, or -1
	counts  map[string]int

	// layout
	ngroups    uint64
	ipg        uint64
	gdtBlocks  uint64
	blocks     uint64
	bbitmap    []uint64
	ibitmap    []uint64
	itable     []uint64
	maxInoUsed uint32
	alloc      *allocator
	stored     []brange
	zero       []brange
	metaOff    []uint64 // byte offset of stored[i] in the metadata file
	shared     []sharedRange
	sharedData [][]byte
	sharedIDs  map[string]int
	sharedOff  []uint64 // byte offset of sharedData[i] in the metadata file
	freeBlocks uint64
	freeInodes uint64
	meta       []byte
	dataExts   []blockmap.Extent
}

func (b *builder) pathErr(p string, format string, args ...any) error {
	return fmt.Errorf("%w: %q: %s", ErrInvalidIndex, p, fmt.Sprintf(format, args...))
}

// Build plans and emits the metadata of an ext4 filesystem holding idx.
func Build(ctx context.Context, idx *index.Index, opts Options) (*Image, error) {
	if idx == nil {
		return nil, fmt.Errorf("%w: nil index", ErrInvalidIndex)
	}
	if opts.BlockSize == 0 {
		opts.BlockSize = DefaultBlockSize
	}
	if opts.BlockSize != 2048 && opts.BlockSize != 4096 {
		// 1024 would need s_first_data_block = 1 and shifted groups.
		return nil, fmt.Errorf("ext4: block size %d not supported (2048 or 4096)", opts.BlockSize)
	}
	if opts.WritableSize == 0 {
		opts.WritableSize = DefaultWritableSize
	}
	if opts.WritableSize < 0 {
		opts.WritableSize = 0
	}
	if opts.JournalSize < 0 || opts.JournalSize > 0 && (opts.JournalSize/int64(opts.BlockSize) < 1024 || opts.JournalSize/int64(opts.BlockSize) > maxJournalBlocks) {
		return nil, fmt.Errorf("ext4: journal size %d outside %d..%d blocks", opts.JournalSize, 1024, maxJournalBlocks)
	}
	if len(opts.VolumeName) > 16 {
		return nil, fmt.Errorf("ext4: volume name %q longer than 16 bytes", opts.VolumeName)
	}
	b := &builder{ctx: ctx, idx: idx, opts: opts, bs: uint64(opts.BlockSize), lpf: -1, journal: -1,
		counts: make(map[string]int)}
	id := identity(idx)
	b.uuid = opts.UUID
	if b.uuid == ([16]byte{}) {
		copy(b.uuid[:], id[:16])
		b.uuid[6] = b.uuid[6]&0x0f | 0x40 // version 4 layout, as uuid_generate
		b.uuid[8] = b.uuid[8]&0x3f | 0x80
	}
	hs := opts.HashSeed
	if hs == ([16]byte{}) {
		copy(hs[:], id[16:])
	}
	b.hashSeed = disklayout.HashSeedWords(hs)
	b.fsSeed = disklayout.FSChecksumSeed(b.uuid)

	steps := []func() error{b.scan, b.assignInodes, b.planContent, b.layout, b.emit}
	for _, step := range steps {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("ext4: build: %w", err)
		}
		if err := step(); err != nil {
			return nil, err
		}
	}
	return b.image()
}

func (b *builder) cancelled(i int) error {
	if i%cancelEvery == 0 {
		if err := b.ctx.Err(); err != nil {
			return fmt.Errorf("ext4: build: %w", err)
		}
	}
	return nil
}

// splitPath validates a clean relative path and returns its parent and name.
func splitPath(p string) (parent, name string, ok bool) {
	if p == "" || p == "." || strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/") || strings.IndexByte(p, 0) >= 0 {
		return "", "", false
	}
	for rest := p; rest != ""; {
		c := rest
		if i := strings.IndexByte(rest, '/'); i >= 0 {
			c, rest = rest[:i], rest[i+1:]
		} else {
			rest = ""
		}
		if c == "" || c == "." || c == ".." || len(c) > disklayout.MaxNameLen {
			return "", "", false
		}
	}
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[:i], p[i+1:], true
	}
	return ".", p, true
}

// scan validates entries and builds the node table and directory tree.
func (b *builder) scan() error {
	ents := b.idx.Entries
	if len(ents) == 0 || ents[0].Path != "." || ents[0].Type != index.TypeDir {
		return fmt.Errorf("%w: first entry must be the root directory \".\"", ErrInvalidIndex)
	}
	b.byPath = make(map[string]int32, len(ents))
	b.nodes = make([]node, 0, len(ents)+3)
	type link struct {
		parent int32
		name   string
		e      *index.Entry
	}
	var links []link
	for i := range ents {
		if err := b.cancelled(i); err != nil {
			return err
		}
		e := &ents[i]
		if _, dup := b.byPath[e.Path]; dup {
			return b.pathErr(e.Path, "duplicate path")
		}
		if e.Mode&^0o7777 != 0 {
			return b.pathErr(e.Path, "mode %#o has bits beyond 07777", e.Mode)
		}
		parent := int32(-1)
		var name string
		if i > 0 {
			pp, nm, ok := splitPath(e.Path)
			if !ok {
				return b.pathErr(e.Path, "not a clean relative path with names of at most 255 bytes")
			}
			pi, found := b.byPath[pp]
			if !found {
				return b.pathErr(e.Path, "parent directory %q is missing (or listed after it)", pp)
			}
			if pi < 0 {
				return b.pathErr(e.Path, "parent %q is a hard link, not a directory", pp)
			}
			if b.nodes[pi].typ != index.TypeDir {
				return b.pathErr(e.Path, "parent %q is a %v, not a directory", pp, b.nodes[pi].typ)
			}
			parent, name = pi, nm
		}
		switch e.Type {
		case index.TypeHardlink:
			if e.Linkname == "" {
				return b.pathErr(e.Path, "hard link without a target")
			}
			links = append(links, link{parent, name, e})
			b.byPath[e.Path] = -1 // taken, not an inode
			b.counts[e.Type.String()]++
			continue
		case index.TypeRegular:
			if err := b.checkData(e); err != nil {
				return err
			}
		case index.TypeSymlink:
			if e.Linkname == "" || len(e.Linkname) > maxSymlinkLen || strings.IndexByte(e.Linkname, 0) >= 0 {
				return b.pathErr(e.Path, "symlink target is empty, longer than %d bytes or contains NUL", maxSymlinkLen)
			}
		case index.TypeDir, index.TypeChar, index.TypeBlock, index.TypeFifo, index.TypeSocket:
		default:
			return b.pathErr(e.Path, "unknown entry type %v", e.Type)
		}
		if e.Ino != 0 && (i == 0 && e.Ino != disklayout.RootIno || i > 0 && (e.Ino < disklayout.FirstIno || e.Ino > maxIno)) {
			return b.pathErr(e.Path, "inode number %d is reserved or out of range", e.Ino)
		}
		ni := int32(len(b.nodes))
		b.nodes = append(b.nodes, node{ent: e, path: e.Path, typ: e.Type, nlink: 1, parent: parent, xattrBlk: -1})
		b.byPath[e.Path] = ni
		b.counts[e.Type.String()]++
		if parent >= 0 {
			b.addChild(parent, name, ni)
		}
	}
	for _, l := range links {
		ti, ok := b.byPath[l.e.Linkname]
		if !ok {
			return b.pathErr(l.e.Path, "hard link target %q is not in the index", l.e.Linkname)
		}
		if ti < 0 {
			return b.pathErr(l.e.Path, "hard link target %q is itself a hard link", l.e.Linkname)
		}
		t := &b.nodes[ti]
		if t.typ == index.TypeDir {
			return b.pathErr(l.e.Path, "hard link to directory %q", l.e.Linkname)
		}
		if t.nlink >= disklayout.LinkMax {
			return b.pathErr(l.e.Path, "more than %d links to %q", disklayout.LinkMax, l.e.Linkname)
		}
		t.nlink++
		b.addChild(l.parent, l.name, ti)
	}
	if _, ok := b.byPath["lost+found"]; !ok {
		b.lpf = int32(len(b.nodes))
		b.nodes = append(b.nodes, node{path: "lost+found", typ: index.TypeDir, nlink: 1, parent: 0, xattrBlk: -1})
		b.addChild(0, "lost+found", b.lpf)
	}
	if !b.opts.NoJournal {
		b.journal = int32(len(b.nodes))
		b.nodes = append(b.nodes, node{path: "<journal>", typ: index.TypeRegular, nlink: 1, parent: -1, xattrBlk: -1, ino: disklayout.JournalIno})
	}
	for i := range b.nodes {
		n := &b.nodes[i]
		if n.typ == index.TypeDir {
			n.nlink = 2 + n.subdirs
			if n.nlink > disklayout.LinkMax {
				n.nlink = 1 // dir_nlink: the count no longer fits
			}
		}
	}
	return nil
}

func (b *builder) addChild(parent int32, name string, ni int32) {
	p := &b.nodes[parent]
	p.kids = append(p.kids, child{name, ni})
	if b.nodes[ni].typ == index.TypeDir {
		p.subdirs++
	}
}

// checkData validates a regular file's size, source and segments.
func (b *builder) checkData(e *index.Entry) error {
	if e.Size < 0 {
		return b.pathErr(e.Path, "negative size %d", e.Size)
	}
	if uint64(e.Size) > maxFileBlocks*b.bs {
		return b.pathErr(e.Path, "size %d exceeds ext4's 16 TiB file limit", e.Size)
	}
	if e.Size > 0 && (e.Data.Segments == nil || len(e.Data.Segments) > 0) {
		if int(e.Data.Source) >= len(b.idx.Sources) {
			return b.pathErr(e.Path, "source %d not in the index's %d sources", e.Data.Source, len(b.idx.Sources))
		}
		if b.idx.Sources[e.Data.Source].Kind == index.SourceDir && e.Data.Path == "" {
			return b.pathErr(e.Path, "directory source without a file path")
		}
		if e.Data.Offset < 0 || e.Data.Offset > math.MaxInt64-e.Size {
			return b.pathErr(e.Path, "data offset %d out of range", e.Data.Offset)
		}
	}
	var end int64
	for i, s := range e.Data.Segments {
		if s.Off < end || s.Len <= 0 || s.Off > e.Size || s.Len > e.Size-s.Off {
			return b.pathErr(e.Path, "data segment %d [%d,+%d) unsorted, empty, overlapping or beyond size %d", i, s.Off, s.Len, e.Size)
		}
		end = s.Off + s.Len
	}
	return nil
}

// assignInodes honours explicit inode numbers, gives lost+found 11 as mkfs
// does, and numbers the rest from 12 in index order.
func (b *builder) assignInodes() error {
	taken := make(map[uint32]int32)
	b.nodes[0].ino = disklayout.RootIno
	taken[disklayout.RootIno] = 0
	if b.journal >= 0 {
		taken[disklayout.JournalIno] = b.journal
	}
	for i := 1; i < len(b.nodes); i++ {
		n := &b.nodes[i]
		if n.ent == nil || n.ent.Ino == 0 {
			continue
		}
		if o, dup := taken[n.ent.Ino]; dup {
			return b.pathErr(n.path, "inode number %d also given to %q", n.ent.Ino, b.nodes[o].path)
		}
		n.ino = n.ent.Ino
		taken[n.ino] = int32(i)
	}
	if lp, ok := b.byPath["lost+found"]; ok && lp >= 0 && b.nodes[lp].ino == 0 && b.nodes[lp].typ == index.TypeDir {
		if _, t := taken[disklayout.FirstIno]; !t {
			b.nodes[lp].ino = disklayout.FirstIno
			taken[disklayout.FirstIno] = lp
		}
	}
	if b.lpf >= 0 {
		if _, t := taken[disklayout.FirstIno]; !t {
			b.nodes[b.lpf].ino = disklayout.FirstIno
			taken[disklayout.FirstIno] = b.lpf
		}
	}
	next := uint32(disklayout.FirstFreeIno)
	maxUsed := uint32(disklayout.FirstIno)
	for i := range b.nodes {
		n := &b.nodes[i]
		if n.ino == 0 {
			for {
				if _, t := taken[next]; !t {
					break
				}
				next++
			}
			// Sequential numbers only need to dodge the fixed ones in
			// taken, never each other, so they stay out of the map.
			n.ino = next
			next++
		}
		maxUsed = max(maxUsed, n.ino)
	}
	b.maxInoUsed = maxUsed
	return nil
}

// ftype is the directory entry file type of a node.
func ftype(t index.Type) uint8 {
	switch t {
	case index.TypeRegular:
		return disklayout.FtRegular
	case index.TypeDir:
		return disklayout.FtDir
	case index.TypeSymlink:
		return disklayout.FtSymlink
	case index.TypeChar:
		return disklayout.FtChar
	case index.TypeBlock:
		return disklayout.FtBlock
	case index.TypeFifo:
		return disklayout.FtFifo
	case index.TypeSocket:
		return disklayout.FtSocket
	}
	return disklayout.FtUnknown
}

// planContent builds directory blocks, symlink blocks and xattrs: every
// piece of metadata whose size does not depend on where it lands.
func (b *builder) planContent() error {
	xdedup := make(map[string]int32)
	for i := range b.nodes {
		if err := b.cancelled(i); err != nil {
			return err
		}
		n := &b.nodes[i]
		switch {
		case n.typ == index.TypeDir:
			if int32(i) == b.lpf {
				b.lostFound(n)
			} else if err := b.buildDir(n); err != nil {
				return err
			}
		case n.typ == index.TypeSymlink && len(n.ent.Linkname) > disklayout.FastSymlinkMax:
			n.dirData = make([]byte, b.bs)
			copy(n.dirData, n.ent.Linkname)
		}
		if n.ent != nil && len(n.ent.Xattrs) > 0 {
			if err := b.planXattrs(n, xdedup); err != nil {
				return err
			}
		}
	}
	return nil
}

// lostFound lays out lost+found as mkfs does: "." and ".." in the first of
// four blocks, the others empty.
func (b *builder) lostFound(n *node) {
	bs := int(b.bs)
	lpfBlocks := lpfBytes / bs
	n.dirData = make([]byte, lpfBlocks*bs)
	seed := disklayout.InodeChecksumSeed(b.fsSeed, n.ino, 0)
	for k := 0; k < lpfBlocks; k++ {
		blk := n.dirData[k*bs : (k+1)*bs]
		if k == 0 {
			off := disklayout.PutDirent(blk, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
			disklayout.PutDirent(blk[off:], disklayout.RootIno, bs-off-disklayout.DirentTailSize, disklayout.FtDir, "..")
		} else {
			disklayout.PutDirent(blk, 0, bs-disklayout.DirentTailSize, 0, "")
		}
		disklayout.SetDirentTail(blk, seed)
	}
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
func (b *builder) buildDir(n *node) error {
	bs := int(b.bs)
	leafCap := bs - disklayout.DirentTailSize
	ents := make([]dirEnt, len(n.kids))
	size := 2 * disklayout.DotDirentSize
	for k, c := range n.kids {
		t := &b.nodes[c.node]
		ents[k] = dirEnt{name: c.name, ino: t.ino, ft: ftype(t.typ)}
		size += disklayout.RecLen(len(c.name))
	}
	parentIno := uint32(disklayout.RootIno)
	if n.parent >= 0 {
		parentIno = b.nodes[n.parent].ino
	}
	seed := disklayout.InodeChecksumSeed(b.fsSeed, n.ino, 0)
	if size <= leafCap {
		blk := make([]byte, bs)
		off := disklayout.PutDirent(blk, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
		last := off
		off += disklayout.PutDirent(blk[off:], parentIno, disklayout.DotDirentSize, disklayout.FtDir, "..")
		for _, e := range ents {
			last = off
			off += disklayout.PutDirent(blk[off:], e.ino, disklayout.RecLen(len(e.name)), e.ft, e.name)
		}
		disklayout.SetDirentRecLen(blk[last:], leafCap-last)
		disklayout.SetDirentTail(blk, seed)
		n.dirData = blk
		return nil
	}

	unsigned := false // s_flags says signed, as mkfs on x86
	for k := range ents {
		ents[k].hash = disklayout.DirHashHalfMD4([]byte(ents[k].name), b.hashSeed, unsigned)
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
	rootLimit, nodeLimit := disklayout.DxRootLimit(bs), disklayout.DxNodeLimit(bs)
	nnodes := 0
	if len(leaves) > rootLimit {
		nnodes = (len(leaves) + nodeLimit - 1) / nodeLimit
		if nnodes > rootLimit {
			return b.pathErr(n.path, "%d entries need more than two htree levels (large_dir)", len(ents))
		}
	}
	nblocks := 1 + nnodes + len(leaves)
	if uint64(nblocks)*b.bs > math.MaxUint32 {
		return b.pathErr(n.path, "directory too large")
	}
	data := make([]byte, nblocks*bs)
	firstLeaf := 1 + nnodes
	for li, l := range leaves {
		blk := data[(firstLeaf+li)*bs : (firstLeaf+li+1)*bs]
		off, last := 0, 0
		for _, e := range ents[l.first:l.end] {
			last = off
			off += disklayout.PutDirent(blk[off:], e.ino, disklayout.RecLen(len(e.name)), e.ft, e.name)
		}
		disklayout.SetDirentRecLen(blk[last:], leafCap-last)
		disklayout.SetDirentTail(blk, seed)
	}
	putDx := func(blk []byte, countOff, limit int, keys []uint32, blocks []uint32) {
		disklayout.PutDxEntries(blk, countOff, limit, keys, blocks)
		disklayout.SetDxChecksum(blk, countOff, seed)
	}
	root := data[:bs]
	off := disklayout.PutDirent(root, n.ino, disklayout.DotDirentSize, disklayout.FtDir, ".")
	disklayout.PutDirent(root[off:], parentIno, bs-off, disklayout.FtDir, "..")
	info := disklayout.DxRootInfo{HashVersion: disklayout.HashHalfMD4, InfoLength: disklayout.DxRootInfoSize}
	keys := make([]uint32, len(leaves))
	blocks := make([]uint32, len(leaves))
	for li, l := range leaves {
		keys[li], blocks[li] = l.key, uint32(firstLeaf+li)
	}
	if nnodes == 0 {
		info.Marshal(root[disklayout.DxRootInfoOffset:])
		putDx(root, disklayout.DxRootCountOffset, rootLimit, keys, blocks)
	} else {
		info.IndirectLevels = 1
		info.Marshal(root[disklayout.DxRootInfoOffset:])
		var rkeys, rblocks []uint32
		for j := 0; j < nnodes; j++ {
			lo, hi := j*nodeLimit, min((j+1)*nodeLimit, len(leaves))
			blk := data[(1+j)*bs : (2+j)*bs]
			disklayout.PutDirent(blk, 0, bs, 0, "")
			putDx(blk, disklayout.DxNodeCountOffset, nodeLimit, keys[lo:hi], blocks[lo:hi])
			rkeys = append(rkeys, keys[lo])
			rblocks = append(rblocks, uint32(1+j))
		}
		putDx(root, disklayout.DxRootCountOffset, rootLimit, rkeys, rblocks)
	}
	n.dirData = data
	n.dxBlocks = 1 + nnodes
	n.flags |= disklayout.InodeIndexFl
	return nil
}

// xattr is one attribute in stored form.
type xattr struct {
	index uint8
	name  string
	value []byte
}

// planXattrs places an inode's xattrs in the inode while they fit and the
// rest in an external block shared by inodes with identical blocks.
func (b *builder) planXattrs(n *node, dedup map[string]int32) error {
	xs := make([]xattr, 0, len(n.ent.Xattrs))
	for _, x := range n.ent.Xattrs {
		idx, suffix, ok := disklayout.XattrSplitName(x.Name)
		if !ok || len(suffix) > disklayout.MaxNameLen || strings.IndexByte(x.Name, 0) >= 0 {
			return b.pathErr(n.path, "xattr %q: namespace not storable in ext4", x.Name)
		}
		v := x.Value
		if idx == disklayout.XattrIndexACLAccess || idx == disklayout.XattrIndexACLDefault {
			if v, ok = disklayout.ACLToDisk(x.Value); !ok {
				return b.pathErr(n.path, "xattr %q: malformed POSIX ACL", x.Name)
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
			return b.pathErr(n.path, "duplicate xattr %q in namespace %d", xs[k].name, xs[k].index)
		}
	}
	in := make([]byte, disklayout.InodeXattrSpace)
	ih := disklayout.XattrIbodyHeader{Magic: disklayout.XattrMagic}
	ih.Marshal(in)
	// The in-inode region's offsets count from the first entry.
	inReg := in[disklayout.XattrIbodySize:]
	inEnt, inVal := 0, len(inReg)
	blk := make([]byte, b.bs)
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
			return b.pathErr(n.path, "xattrs do not fit the inode and one %d-byte block", b.bs)
		}
		bVal -= vsz
		bHashes = append(bHashes, putXattr(blk, bEnt, bVal, x))
		bEnt += esz
	}
	if nIn > 0 {
		n.xattrIn = in
	}
	if len(bHashes) == 0 {
		return nil
	}
	h := disklayout.XattrHeader{Magic: disklayout.XattrMagic, Blocks: 1, Hash: disklayout.XattrBlockHash(bHashes)}
	h.Marshal(blk)
	key := string(blk)
	if xi, ok := dedup[key]; ok && b.xblocks[xi].refs < 1024 {
		b.xblocks[xi].refs++
		n.xattrBlk = xi
		return nil
	}
	n.xattrBlk = int32(len(b.xblocks))
	dedup[key] = n.xattrBlk
	b.xblocks = append(b.xblocks, xblock{data: blk, refs: 1})
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

// dataRanges returns a file's data as block ranges with the byte length
// that is real data in each: segments rounded out to blocks and merged.
func (b *builder) dataRanges(e *index.Entry, out []blockRange) []blockRange {
	out = out[:0]
	bs := int64(b.bs)
	add := func(off, l int64) {
		first := uint64(off / bs)
		end := uint64((off + l + bs - 1) / bs)
		if k := len(out); k > 0 && out[k-1].end >= first {
			out[k-1].end = max(out[k-1].end, end)
			out[k-1].byteEnd = off + l
			return
		}
		out = append(out, blockRange{first, end, off + l})
	}
	if e.Data.Segments == nil {
		if e.Size > 0 {
			add(0, e.Size)
		}
		return out
	}
	for _, s := range e.Data.Segments {
		add(s.Off, s.Len)
	}
	return out
}

// blockRange is logical blocks [first, end) of a file whose data ends at
// byte byteEnd.
type blockRange struct {
	first, end uint64
	byteEnd    int64
}

// treeBlocks is the number of extent tree blocks n extents need beyond the
// root in the inode.
func (b *builder) treeBlocks(n int) uint64 {
	if n <= disklayout.ExtentRootMax {
		return 0
	}
	per := disklayout.ExtentsPerBlock(int(b.bs))
	total, c := 0, n
	for c > disklayout.ExtentRootMax {
		c = (c + per - 1) / per
		total += c
	}
	return uint64(total)
}

// journalBlocks is the journal length: the option, else 16 MiB capped by
// mkfs's rule for small filesystems.
func (b *builder) journalBlocks(fsBlocks uint64) uint64 {
	if b.journal < 0 {
		return 0
	}
	if b.opts.JournalSize > 0 {
		return uint64(b.opts.JournalSize) / b.bs
	}
	j := uint64(DefaultJournalSize) / b.bs
	if fsBlocks < 32768 {
		j = 1024
	}
	return j
}

// bitsAdd adds with an overflow check.
func bitsAdd(a, c uint64) (uint64, bool) {
	s, carry := bits.Add64(a, c, 0)
	return s, carry == 0
}
