package ext4

import (
	"context"
	"fmt"
	"math/bits"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// layout is the place of every block: what the layout search produces.
type layout struct {
	geometry
	blocks   uint64    // filesystem size in blocks
	backups  []uint64  // first block of each backup group except group 0
	used     []brange  // every allocated run, merged, in order; backup areas aside
	bbitmap  []uint64  // block bitmap of each group
	ibitmap  []uint64  // inode bitmap of each group
	itable   []itable  // inode table of each group
	journal  []brange  // the journal's runs, nil without one
	nodes    []placing // parallel to tree.nodes
	xblocks  []uint64  // block of each contents.xblocks entry
	dataExts []blockmap.Extent
}

// geometry is the shape of the groups.
type geometry struct {
	bs        uint64 // block size
	bpg       uint64 // blocks per group
	ngroups   uint64
	ipg       uint64 // inodes per group
	itb       uint64 // inode table blocks per group
	gdtBlocks uint64 // group descriptor table blocks
}

// resv is the blocks at the start of a group with a superblock copy.
func (g *geometry) resv() uint64 { return 1 + g.gdtBlocks }

// itable is a group's inode table: its first block and how many of its
// blocks hold used inodes (stored); the rest read as zeros.
type itable struct {
	start, stored uint64
}

// placing is where a node's blocks landed.
type placing struct {
	metaRuns []brange // blocks holding the node's nodeData, in order
	exts     []fext
	treeRuns []brange // extent tree blocks beyond the root in i_block
	dataBlks uint64   // blocks mapped by exts
}

// fext is one extent of an inode: logical block, physical block, length.
type fext struct {
	lblk uint32
	n    uint32
	pblk uint64
}

// sizing is the input of the layout search that does not depend on the
// group count.
type sizing struct {
	jblocks    uint64 // journal blocks, 0 without one
	writable   uint64 // free blocks left after the content
	freeInodes uint64 // unused inodes beyond the highest used one
}

// searchLayout sizes the filesystem and places every block. The number of
// groups determines the size of the group tables, which moves everything
// after them, so it starts from an estimate and grows until the plan fits.
func searchLayout(ctx context.Context, idx *index.Index, opts *Options, t *tree, c *contents) (*layout, error) {
	bs := uint64(opts.BlockSize)
	bpg := bs * 8
	est, err := estimateBlocks(t, c, bs)
	if err != nil {
		return nil, err
	}
	s := sizing{writable: (uint64(opts.WritableSize) + bs - 1) / bs, freeInodes: uint64(opts.FreeInodes)}
	if s.freeInodes == 0 {
		s.freeInodes = max(minFreeInodes, uint64(opts.WritableSize)/bytesPerFreeInode)
	}
	if t.journal >= 0 {
		s.jblocks = journalBlocks(opts, est+s.writable)
	}
	est += s.jblocks + s.writable
	ngroups := max(1, (est+bpg-1)/bpg)
	for iter := 0; iter < 64; iter++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("ext4: build: %w", err)
		}
		if ngroups > maxGroups {
			return nil, fmt.Errorf("ext4: filesystem would need %d block groups (limit %d)", ngroups, maxGroups)
		}
		l, need, err := tryLayout(ctx, idx, t, c, s, newGeometry(bs, ngroups, uint64(t.maxIno)+s.freeInodes))
		if err != nil || need == 0 {
			return l, err
		}
		ngroups = need
	}
	return nil, fmt.Errorf("ext4: layout did not converge")
}

// estimateBlocks is a lower bound of the blocks the content needs, before
// group tables, journal and free space.
func estimateBlocks(t *tree, c *contents, bs uint64) (uint64, error) {
	var est uint64
	var ranges []blockRange
	for i := range t.nodes {
		n := &t.nodes[i]
		est += c.nodes[i].size / bs
		if n.typ == index.TypeRegular && n.ent != nil {
			ranges = dataRanges(n.ent, bs, ranges)
			for _, r := range ranges {
				est += r.end - r.first
			}
			if est > maxGroups*bs*8 {
				return 0, pathErr(n.path, "data does not fit the largest filesystem built here (%d groups)", maxGroups)
			}
		}
	}
	return est + uint64(len(c.xblocks)), nil
}

// journalBlocks is the journal length: the option, else 16 MiB capped by
// mkfs's rule for small filesystems.
func journalBlocks(opts *Options, fsBlocks uint64) uint64 {
	bs := uint64(opts.BlockSize)
	if opts.JournalSize > 0 {
		return uint64(opts.JournalSize) / bs
	}
	j := uint64(DefaultJournalSize) / bs
	if fsBlocks < 32768 {
		j = 1024
	}
	return j
}

// newGeometry spreads inodes over ngroups groups in whole inode table
// blocks; ipg may come out larger than a group's bitmap can hold, which
// tryLayout answers with more groups.
func newGeometry(bs, ngroups, inodes uint64) geometry {
	inodesPerBlock := bs / disklayout.InodeSize
	ipg := (inodes + ngroups - 1) / ngroups
	ipg = max(inodesPerBlock, (ipg+inodesPerBlock-1)/inodesPerBlock*inodesPerBlock)
	return geometry{bs: bs, bpg: bs * 8, ngroups: ngroups, ipg: ipg, itb: ipg * disklayout.InodeSize / bs,
		gdtBlocks: (ngroups*disklayout.GroupDescSize64 + bs - 1) / bs}
}

// tryLayout places everything in g's groups in one forward sweep: group
// tables packed at the front as flex_bg allows, then the journal,
// directory and symlink blocks, xattr blocks, file data and extent tree
// blocks. The order is part of the output: changing it moves blocks. It
// returns a larger group count when g's groups are not enough.
func tryLayout(ctx context.Context, idx *index.Index, t *tree, c *contents, s sizing, g geometry) (*layout, uint64, error) {
	if g.ipg > g.bpg {
		inodes := uint64(t.maxIno) + s.freeInodes
		return nil, (inodes + g.bpg - 1) / g.bpg, nil
	}
	a := newAllocator(g.bpg, g.resv(), g.ngroups)
	l := &layout{geometry: g, backups: a.backups, nodes: make([]placing, len(t.nodes))}
	l.bbitmap, l.ibitmap = placeBitmaps(a, g.ngroups)
	var err error
	if l.itable, err = placeInodeTables(a, g, t); err != nil {
		return nil, 0, err
	}
	if t.journal >= 0 {
		l.journal = a.alloc(s.jblocks, nil)
		l.nodes[t.journal] = placeRuns(l.journal)
	}
	for i := range c.nodes {
		if sz := c.nodes[i].size; sz > 0 {
			runs := a.alloc(sz/g.bs, nil)
			l.nodes[i] = placeRuns(runs)
			l.nodes[i].metaRuns = runs
		}
	}
	l.xblocks = make([]uint64, len(c.xblocks))
	for k := range l.xblocks {
		l.xblocks[k] = a.allocContig(1)
	}
	if l.dataExts, err = placeData(ctx, a, idx, t, l.nodes, g.bs); err != nil {
		return nil, 0, err
	}
	placeTreeBlocks(a, l.nodes, g.bs)
	l.used = a.used
	need, err := l.size(a.cur, s.writable)
	if err != nil || need > 0 {
		return nil, need, err
	}
	return l, 0, nil
}

// placeBitmaps allocates every group's block bitmap, then every group's
// inode bitmap.
func placeBitmaps(a *allocator, ngroups uint64) (bbitmap, ibitmap []uint64) {
	bbitmap, ibitmap = make([]uint64, ngroups), make([]uint64, ngroups)
	for i := range bbitmap {
		bbitmap[i] = a.allocContig(1)
	}
	for i := range ibitmap {
		ibitmap[i] = a.allocContig(1)
	}
	return bbitmap, ibitmap
}

// placeInodeTables allocates every group's inode table and sizes the part
// that holds used inodes: up to the group's highest used one.
func placeInodeTables(a *allocator, g geometry, t *tree) ([]itable, error) {
	usedMax := make([]uint64, g.ngroups) // highest used inode index in a group, 1-based
	usedMax[0] = disklayout.FirstIno - 1
	for i := range t.nodes {
		ino := uint64(t.nodes[i].ino)
		grp := (ino - 1) / g.ipg
		if grp >= g.ngroups {
			return nil, fmt.Errorf("ext4: inode %d beyond %d inodes", ino, g.ngroups*g.ipg)
		}
		usedMax[grp] = max(usedMax[grp], (ino-1)%g.ipg+1)
	}
	tables := make([]itable, g.ngroups)
	for grp := range tables {
		tables[grp] = itable{start: a.allocContig(g.itb), stored: (usedMax[grp]*disklayout.InodeSize + g.bs - 1) / g.bs}
	}
	return tables, nil
}

// placeRuns is the placing of blocks that map runs from logical block 0.
func placeRuns(runs []brange) placing {
	var p placing
	l := uint64(0)
	for _, r := range runs {
		p.addExtents(l, r)
		l += r.n
	}
	p.dataBlks = l
	return p
}

// placeData allocates the data blocks of every regular file of the index
// and returns the block map extents that point them at their sources.
func placeData(ctx context.Context, a *allocator, idx *index.Index, t *tree, nodes []placing, bs uint64) ([]blockmap.Extent, error) {
	var exts []blockmap.Extent
	var ranges []blockRange
	var runs []brange
	for i := range t.nodes {
		if err := cancelled(ctx, i); err != nil {
			return nil, err
		}
		n, p := &t.nodes[i], &nodes[i]
		if n.typ != index.TypeRegular || n.ent == nil {
			continue
		}
		ranges = dataRanges(n.ent, bs, ranges)
		d := &n.ent.Data
		base := int64(0)
		if int(d.Source) < len(idx.Sources) && idx.Sources[d.Source].Kind == index.SourceBlob {
			base = d.Offset
		}
		for _, r := range ranges {
			if a.cur+(r.end-r.first) > maxGroups*bs*8 {
				return nil, pathErr(n.path, "data does not fit the largest filesystem built here (%d groups)", maxGroups)
			}
			runs = a.alloc(r.end-r.first, runs[:0])
			l := r.first
			for _, run := range runs {
				p.addExtents(l, run)
				fileOff := int64(l * bs)
				exts = append(exts, blockmap.Extent{
					First: run.start, Count: run.n, Kind: blockmap.Data, Bytes: min(run.n*bs, uint64(r.byteEnd-fileOff)),
					Loc: blockmap.Location{Source: d.Source, Path: d.Path, Offset: base + fileOff},
				})
				l += run.n
			}
			p.dataBlks += r.end - r.first
		}
	}
	return exts, nil
}

// placeTreeBlocks allocates the extent tree blocks of every node whose
// extents do not fit in i_block.
func placeTreeBlocks(a *allocator, nodes []placing, bs uint64) {
	for i := range nodes {
		p := &nodes[i]
		if t := treeBlocks(len(p.exts), bs); t > 0 {
			p.treeRuns = a.alloc(t, nil)
		}
	}
}

// size sets the filesystem size: the allocated blocks up to end plus the
// writable space, rounded to whole groups once there is more than one. It
// returns the group count needed when that exceeds l's.
func (l *layout) size(end, writable uint64) (need uint64, err error) {
	end, ok := bitsAdd(end, writable)
	if !ok {
		return 0, fmt.Errorf("ext4: filesystem size overflows")
	}
	if end > l.bpg || l.ngroups > 1 {
		end = (end + l.bpg - 1) / l.bpg * l.bpg
	}
	if need := (end + l.bpg - 1) / l.bpg; need > l.ngroups {
		return need, nil
	}
	if l.ngroups > 1 {
		end = l.ngroups * l.bpg
	}
	l.blocks = end
	return 0, nil
}

// addExtents maps logical blocks from l onto run, in pieces no longer
// than an initialized extent may be.
func (p *placing) addExtents(l uint64, run brange) {
	for run.n > 0 {
		m := min(run.n, disklayout.MaxInitExtentLen)
		if k := len(p.exts); k > 0 {
			e := &p.exts[k-1]
			if uint64(e.lblk)+uint64(e.n) == l && e.pblk+uint64(e.n) == run.start && uint64(e.n)+m <= disklayout.MaxInitExtentLen {
				e.n += uint32(m)
				l, run.start, run.n = l+m, run.start+m, run.n-m
				continue
			}
		}
		p.exts = append(p.exts, fext{lblk: uint32(l), n: uint32(m), pblk: run.start})
		l, run.start, run.n = l+m, run.start+m, run.n-m
	}
}

// blockRange is logical blocks [first, end) of a file whose data ends at
// byte byteEnd.
type blockRange struct {
	first, end uint64
	byteEnd    int64
}

// dataRanges returns a file's data as block ranges with the byte length
// that is real data in each: segments rounded out to blocks and merged.
func dataRanges(e *index.Entry, bs uint64, out []blockRange) []blockRange {
	out = out[:0]
	b := int64(bs)
	add := func(off, l int64) {
		first := uint64(off / b)
		end := uint64((off + l + b - 1) / b)
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

// treeBlocks is the number of extent tree blocks n extents need beyond the
// root in the inode.
func treeBlocks(n int, bs uint64) uint64 {
	if n <= disklayout.ExtentRootMax {
		return 0
	}
	per := disklayout.ExtentsPerBlock(int(bs))
	total, c := 0, n
	for c > disklayout.ExtentRootMax {
		c = (c + per - 1) / per
		total += c
	}
	return uint64(total)
}

// bitsAdd adds with an overflow check.
func bitsAdd(a, c uint64) (uint64, bool) {
	s, carry := bits.Add64(a, c, 0)
	return s, carry == 0
}
