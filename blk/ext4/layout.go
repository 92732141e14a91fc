package ext4

import (
	"fmt"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// layout sizes the filesystem and places every block. The number of groups
// determines the size of the group tables, which moves everything after
// them, so it starts from an estimate and grows until the plan fits.
func (b *builder) layout() error {
	bs := b.bs
	bpg := bs * 8
	var est uint64
	var ranges []blockRange
	for i := range b.nodes {
		n := &b.nodes[i]
		est += uint64(len(n.dirData)) / bs
		if n.typ == index.TypeRegular && n.ent != nil {
			ranges = b.dataRanges(n.ent, ranges)
			for _, r := range ranges {
				est += r.end - r.first
			}
			if est > maxGroups*bpg {
				return b.pathErr(n.path, "data does not fit the largest filesystem built here (%d groups)", maxGroups)
			}
		}
	}
	est += uint64(len(b.xblocks))
	writable := (uint64(b.opts.WritableSize) + bs - 1) / bs
	freeInodes := uint64(b.opts.FreeInodes)
	if freeInodes == 0 {
		freeInodes = max(minFreeInodes, uint64(b.opts.WritableSize)/bytesPerFreeInode)
	}
	jblocks := b.journalBlocks(est + writable)
	est += jblocks + writable
	ngroups := max(1, (est+bpg-1)/bpg)
	for iter := 0; iter < 64; iter++ {
		if ngroups > maxGroups {
			return fmt.Errorf("ext4: filesystem would need %d block groups (limit %d)", ngroups, maxGroups)
		}
		need, err := b.tryLayout(ngroups, jblocks, writable, freeInodes)
		if err != nil {
			return err
		}
		if need == 0 {
			return nil
		}
		ngroups = need
	}
	return fmt.Errorf("ext4: layout did not converge")
}

// tryLayout places everything in ngroups groups; it returns a larger group
// count when they are not enough, 0 on success.
func (b *builder) tryLayout(ngroups, jblocks, writable, freeInodes uint64) (uint64, error) {
	bs := b.bs
	bpg := bs * 8
	inodesPerBlock := bs / disklayout.InodeSize
	total := uint64(b.maxInoUsed) + freeInodes
	ipg := (total + ngroups - 1) / ngroups
	ipg = max(inodesPerBlock, (ipg+inodesPerBlock-1)/inodesPerBlock*inodesPerBlock)
	if ipg > bpg {
		return (total + bpg - 1) / bpg, nil
	}
	b.ngroups, b.ipg = ngroups, ipg
	b.gdtBlocks = (ngroups*disklayout.GroupDescSize64 + bs - 1) / bs
	resv := 1 + b.gdtBlocks
	a := newAllocator(bpg, resv, ngroups)
	b.alloc = a
	// Superblocks are stored per group (their group number differs); the
	// group descriptor table and the bitmaps are shared content, added by
	// emit once their bytes are known.
	b.stored = append(b.stored[:0], brange{0, 1})
	for _, s := range a.backups {
		b.stored = append(b.stored, brange{s, 1})
	}
	b.zero = b.zero[:0]
	b.dataExts = b.dataExts[:0]

	// Group tables, packed at the front as flex_bg allows.
	b.bbitmap = make([]uint64, ngroups)
	b.ibitmap = make([]uint64, ngroups)
	b.itable = make([]uint64, ngroups)
	for g := range b.bbitmap {
		b.bbitmap[g] = a.allocContig(1)
	}
	for g := range b.ibitmap {
		b.ibitmap[g] = a.allocContig(1)
	}
	itb := ipg * disklayout.InodeSize / bs
	usedMax := make([]uint64, ngroups) // highest used inode index in a group, 1-based
	usedMax[0] = disklayout.FirstIno - 1
	for i := range b.nodes {
		ino := uint64(b.nodes[i].ino)
		g := (ino - 1) / ipg
		if g >= ngroups {
			return 0, fmt.Errorf("ext4: inode %d beyond %d inodes", ino, ngroups*ipg)
		}
		usedMax[g] = max(usedMax[g], (ino-1)%ipg+1)
	}
	for g := range b.itable {
		b.itable[g] = a.allocContig(itb)
		st := (usedMax[g]*disklayout.InodeSize + bs - 1) / bs
		if st > 0 {
			b.stored = append(b.stored, brange{b.itable[g], st})
		}
		if st < itb {
			b.zero = append(b.zero, brange{b.itable[g] + st, itb - st})
		}
	}

	var runs []brange
	if b.journal >= 0 {
		n := &b.nodes[b.journal]
		runs = a.alloc(jblocks, runs[:0])
		b.setExtents(n, runs)
		n.dataBlks = jblocks
		b.stored = append(b.stored, brange{runs[0].start, 1})
		for k, r := range runs {
			if k == 0 {
				r.start++
				r.n--
			}
			if r.n > 0 {
				b.zero = append(b.zero, r)
			}
		}
	}
	for i := range b.nodes {
		n := &b.nodes[i]
		if len(n.dirData) == 0 {
			continue
		}
		nb := uint64(len(n.dirData)) / bs
		runs = a.alloc(nb, runs[:0])
		n.metaRuns = append(n.metaRuns[:0], runs...)
		b.setExtents(n, runs)
		n.dataBlks = nb
		b.stored = append(b.stored, runs...)
	}
	for k := range b.xblocks {
		b.xblocks[k].pblk = a.allocContig(1)
		b.stored = append(b.stored, brange{b.xblocks[k].pblk, 1})
	}
	var ranges []blockRange
	for i := range b.nodes {
		if err := b.cancelled(i); err != nil {
			return 0, err
		}
		n := &b.nodes[i]
		if n.typ != index.TypeRegular || n.ent == nil {
			continue
		}
		n.exts, n.dataBlks = n.exts[:0], 0
		ranges = b.dataRanges(n.ent, ranges)
		d := &n.ent.Data
		base := int64(0)
		if int(d.Source) < len(b.idx.Sources) && b.idx.Sources[d.Source].Kind == index.SourceBlob {
			base = d.Offset
		}
		path := d.Path
		for _, r := range ranges {
			if a.cur+(r.end-r.first) > maxGroups*bpg {
				return 0, b.pathErr(n.path, "data does not fit the largest filesystem built here (%d groups)", maxGroups)
			}
			runs = a.alloc(r.end-r.first, runs[:0])
			l := r.first
			for _, run := range runs {
				b.addExtents(n, l, run)
				fileOff := int64(l * bs)
				byteLen := min(run.n*bs, uint64(r.byteEnd-fileOff))
				b.dataExts = append(b.dataExts, blockmap.Extent{
					First: run.start, Count: run.n, Kind: blockmap.Data, Bytes: byteLen,
					Loc: blockmap.Location{Source: d.Source, Path: path, Offset: base + fileOff},
				})
				l += run.n
			}
			n.dataBlks += r.end - r.first
		}
	}
	for i := range b.nodes {
		n := &b.nodes[i]
		n.treeBlks = n.treeBlks[:0]
		if t := b.treeBlocks(len(n.exts)); t > 0 {
			runs = a.alloc(t, runs[:0])
			for _, r := range runs {
				for k := uint64(0); k < r.n; k++ {
					n.treeBlks = append(n.treeBlks, r.start+k)
				}
			}
			b.stored = append(b.stored, runs...)
		}
	}

	end, ok := bitsAdd(a.cur, writable)
	if !ok {
		return 0, fmt.Errorf("ext4: filesystem size overflows")
	}
	if end > bpg || ngroups > 1 {
		end = (end + bpg - 1) / bpg * bpg
	}
	need := (end + bpg - 1) / bpg
	if need > ngroups {
		return need, nil
	}
	if ngroups > 1 {
		end = ngroups * bpg
	}
	b.blocks = end
	return 0, nil
}

// setExtents maps runs to consecutive logical blocks from 0.
func (b *builder) setExtents(n *node, runs []brange) {
	n.exts = n.exts[:0]
	l := uint64(0)
	for _, r := range runs {
		b.addExtents(n, l, r)
		l += r.n
	}
}

// addExtents maps logical blocks from l onto run, in pieces no longer
// than an initialized extent may be.
func (b *builder) addExtents(n *node, l uint64, run brange) {
	for run.n > 0 {
		m := min(run.n, disklayout.MaxInitExtentLen)
		if k := len(n.exts); k > 0 {
			p := &n.exts[k-1]
			if uint64(p.lblk)+uint64(p.n) == l && p.pblk+uint64(p.n) == run.start && uint64(p.n)+m <= disklayout.MaxInitExtentLen {
				p.n += uint32(m)
				l, run.start, run.n = l+m, run.start+m, run.n-m
				continue
			}
		}
		n.exts = append(n.exts, fext{lblk: uint32(l), n: uint32(m), pblk: run.start})
		l, run.start, run.n = l+m, run.start+m, run.n-m
	}
}
