package ext4

import (
	"bytes"
	"fmt"
	"math/bits"
	"sort"

	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Feature sets this package writes.
const (
	featCompat   = disklayout.CompatExtAttr | disklayout.CompatDirIndex
	featIncompat = disklayout.IncompatFiletype | disklayout.IncompatExtents | disklayout.Incompat64Bit | disklayout.IncompatFlexBG
	featROCompat = disklayout.ROCompatSparseSuper | disklayout.ROCompatLargeFile | disklayout.ROCompatHugeFile |
		disklayout.ROCompatDirNlink | disklayout.ROCompatExtraIsize | disklayout.ROCompatMetadataCsum
	logGroupsPerFlex = 4
)

// emit writes every stored block into the metadata buffer.
func (b *builder) emit() error {
	bs := b.bs
	b.planGroups()
	sort.Slice(b.stored, func(i, j int) bool { return b.stored[i].start < b.stored[j].start })
	b.metaOff = make([]uint64, len(b.stored))
	var off uint64
	for i, r := range b.stored {
		if i > 0 && b.stored[i-1].start+b.stored[i-1].n > r.start {
			return fmt.Errorf("ext4: internal error: metadata blocks %d and %d overlap", b.stored[i-1].start, r.start)
		}
		b.metaOff[i] = off
		off += r.n * bs
	}
	b.sharedOff = make([]uint64, len(b.sharedData))
	for i, d := range b.sharedData {
		b.sharedOff[i] = off
		off += uint64(len(d))
	}
	b.meta = make([]byte, off)
	for i, d := range b.sharedData {
		copy(b.meta[b.sharedOff[i]:], d)
	}
	b.sharedData = nil

	for i := range b.nodes {
		if err := b.cancelled(i); err != nil {
			return err
		}
		n := &b.nodes[i]
		if len(n.dirData) > 0 {
			src := n.dirData
			for _, r := range n.metaRuns {
				copy(b.metaBlocks(r.start, r.n), src[:r.n*bs])
				src = src[r.n*bs:]
			}
		}
		b.writeInode(n)
	}
	// Reserved inodes other than root and the journal, as mkfs leaves them.
	for ino := uint32(1); ino < disklayout.FirstIno; ino++ {
		if ino == disklayout.RootIno || ino == disklayout.JournalIno && b.journal >= 0 {
			continue
		}
		rec := b.inodeRecord(ino)
		in := disklayout.Inode{ExtraIsize: disklayout.InodeExtraSize}
		in.Marshal(rec)
		disklayout.SetInodeChecksum(rec, b.fsSeed, ino, 0)
	}
	for k := range b.xblocks {
		x := &b.xblocks[k]
		blk := b.metaBlocks(x.pblk, 1)
		copy(blk, x.data)
		disklayout.SetXattrRefcount(blk, x.refs)
		disklayout.SetXattrBlockChecksum(blk, b.fsSeed, x.pblk)
	}
	if b.journal >= 0 {
		n := &b.nodes[b.journal]
		js := disklayout.JournalSuperBlock{
			HeaderMagic: disklayout.JournalMagic, HeaderBlocktype: disklayout.Jbd2SuperblockV2,
			BlockSize: uint32(bs), MaxLen: uint32(n.dataBlks), First: 1, Sequence: 1,
			UUID: b.uuid, NrUsers: 1,
		}
		if err := js.Marshal(b.metaBlocks(n.exts[0].pblk, 1)); err != nil {
			return fmt.Errorf("ext4: journal superblock: %w", err)
		}
	}
	return b.writeSupers()
}

// metaBlocks returns the buffer of n stored blocks starting at blk.
func (b *builder) metaBlocks(blk, n uint64) []byte {
	i := sort.Search(len(b.stored), func(i int) bool { return b.stored[i].start+b.stored[i].n > blk })
	r := b.stored[i]
	if blk < r.start || blk+n > r.start+r.n {
		panic(fmt.Sprintf("ext4: internal error: block %d+%d not stored", blk, n))
	}
	o := b.metaOff[i] + (blk-r.start)*b.bs
	return b.meta[o : o+n*b.bs]
}

// inodeRecord returns the inode table slot of ino.
func (b *builder) inodeRecord(ino uint32) []byte {
	g := uint64(ino-1) / b.ipg
	o := (uint64(ino-1) % b.ipg) * disklayout.InodeSize
	blk := b.itable[g] + o/b.bs
	return b.metaBlocks(blk, 1)[o%b.bs:][:disklayout.InodeSize]
}

func (b *builder) now() (int64, uint32) {
	if b.opts.Time.IsZero() {
		return 0, 0
	}
	return b.opts.Time.Unix(), uint32(b.opts.Time.Nanosecond())
}

// writeInode encodes a node's inode and its extent tree blocks.
func (b *builder) writeInode(n *node) {
	var in disklayout.Inode
	var uid, gid uint32
	var perm uint32
	now, nowNs := b.now()
	at, mt, ct := index.Timespec{Sec: now, Nsec: nowNs}, index.Timespec{Sec: now, Nsec: nowNs}, index.Timespec{Sec: now, Nsec: nowNs}
	if e := n.ent; e != nil {
		uid, gid, perm = e.UID, e.GID, e.Mode
		at, mt, ct = e.Atime, e.Mtime, e.Ctime
	} else if n.typ == index.TypeDir {
		perm = 0o700 // lost+found
	} else {
		perm = 0o600 // journal
	}
	var size uint64
	switch n.typ {
	case index.TypeRegular:
		in.Mode = disklayout.ModeRegular
		if n.ent != nil {
			size = uint64(n.ent.Size)
		} else {
			size = n.dataBlks * b.bs
		}
		in.Flags |= disklayout.InodeExtentsFl
	case index.TypeDir:
		in.Mode = disklayout.ModeDir
		size = uint64(len(n.dirData))
		in.Flags |= disklayout.InodeExtentsFl
	case index.TypeSymlink:
		in.Mode = disklayout.ModeSymlink
		size = uint64(len(n.ent.Linkname))
		if len(n.dirData) == 0 {
			copy(in.Block[:], n.ent.Linkname)
		} else {
			in.Flags |= disklayout.InodeExtentsFl
		}
	case index.TypeChar, index.TypeBlock:
		in.Mode = disklayout.ModeChar
		if n.typ == index.TypeBlock {
			in.Mode = disklayout.ModeBlock
		}
		in.SetDevice(n.ent.Devmajor, n.ent.Devminor)
	case index.TypeFifo:
		in.Mode = disklayout.ModeFifo
	case index.TypeSocket:
		in.Mode = disklayout.ModeSocket
	}
	in.Mode |= uint16(perm & 0o7777)
	in.Flags |= n.flags
	in.UIDLo, in.UIDHi = uint16(uid), uint16(uid>>16)
	in.GIDLo, in.GIDHi = uint16(gid), uint16(gid>>16)
	in.SizeLo, in.SizeHi = uint32(size), uint32(size>>32)
	in.Atime, in.AtimeExtra = disklayout.EncodeTime(at.Sec, at.Nsec)
	in.Mtime, in.MtimeExtra = disklayout.EncodeTime(mt.Sec, mt.Nsec)
	in.Ctime, in.CtimeExtra = disklayout.EncodeTime(ct.Sec, ct.Nsec)
	in.Crtime, in.CrtimeExtra = in.Ctime, in.CtimeExtra
	in.LinksCount = uint16(n.nlink)
	in.ExtraIsize = disklayout.InodeExtraSize
	owned := n.dataBlks + uint64(len(n.treeBlks))
	if n.xattrBlk >= 0 {
		x := b.xblocks[n.xattrBlk].pblk
		in.FileACLLo, in.FileACLHi = uint32(x), uint16(x>>32)
		owned++
	}
	sectors := owned * (b.bs / 512)
	in.BlocksLo, in.BlocksHi = uint32(sectors), uint16(sectors>>32)
	if in.Flags&disklayout.InodeExtentsFl != 0 {
		b.writeExtentTree(n, in.Block[:])
	}
	rec := b.inodeRecord(n.ino)
	in.Marshal(rec)
	if n.xattrIn != nil {
		copy(rec[disklayout.InodeXattrOffset:], n.xattrIn)
	}
	disklayout.SetInodeChecksum(rec, b.fsSeed, n.ino, 0)
}

// writeExtentTree writes the root into iblock (60 bytes) and any leaf and
// index blocks into their planned tree blocks.
func (b *builder) writeExtentTree(n *node, iblock []byte) {
	per := disklayout.ExtentsPerBlock(int(b.bs))
	seed := disklayout.InodeChecksumSeed(b.fsSeed, n.ino, 0)
	type ref struct {
		lblk uint32
		pblk uint64
	}
	if len(n.exts) <= disklayout.ExtentRootMax {
		h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(n.exts)), Max: disklayout.ExtentRootMax}
		h.Marshal(iblock)
		for k, e := range n.exts {
			disklayout.MarshalLeaf(disklayout.ExtentEntry(iblock, k), e.lblk, uint16(e.n), e.pblk)
		}
		return
	}
	tb := n.treeBlks
	var level []ref
	for k := 0; k < len(n.exts); k += per {
		chunk := n.exts[k:min(k+per, len(n.exts))]
		blk := b.metaBlocks(tb[0], 1)
		h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(chunk)), Max: uint16(per)}
		h.Marshal(blk)
		for j, e := range chunk {
			disklayout.MarshalLeaf(disklayout.ExtentEntry(blk, j), e.lblk, uint16(e.n), e.pblk)
		}
		disklayout.SetExtentBlockChecksum(blk, seed)
		level = append(level, ref{chunk[0].lblk, tb[0]})
		tb = tb[1:]
	}
	depth := uint16(1)
	for len(level) > disklayout.ExtentRootMax {
		var up []ref
		for k := 0; k < len(level); k += per {
			chunk := level[k:min(k+per, len(level))]
			blk := b.metaBlocks(tb[0], 1)
			h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(chunk)), Max: uint16(per), Depth: depth}
			h.Marshal(blk)
			for j, c := range chunk {
				disklayout.MarshalIdx(disklayout.ExtentEntry(blk, j), c.lblk, c.pblk)
			}
			disklayout.SetExtentBlockChecksum(blk, seed)
			up = append(up, ref{chunk[0].lblk, tb[0]})
			tb = tb[1:]
		}
		level = up
		depth++
	}
	h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(level)), Max: disklayout.ExtentRootMax, Depth: depth}
	h.Marshal(iblock)
	for k, c := range level {
		disklayout.MarshalIdx(disklayout.ExtentEntry(iblock, k), c.lblk, c.pblk)
	}
}

// sharedRange is a run of blocks whose bytes are shared content: the
// group descriptor table copies and the bitmaps, which on a large image
// are mostly identical (full data groups, empty inode groups), so each
// distinct block is stored once.
type sharedRange struct {
	r  brange
	id int // index into builder.sharedData / sharedOff
}

// intern returns the id of content c, adding a copy if it is new.
func (b *builder) intern(c []byte) int {
	if id, ok := b.sharedIDs[string(c)]; ok {
		return id
	}
	id := len(b.sharedData)
	b.sharedData = append(b.sharedData, bytes.Clone(c))
	b.sharedIDs[string(c)] = id
	return id
}

// planGroups computes the bitmaps, free counts and group descriptors of
// every group from the finished layout, one group at a time.
func (b *builder) planGroups() {
	bs, bpg, ipg := b.bs, b.bs*8, b.ipg
	resv := 1 + b.gdtBlocks
	b.shared = b.shared[:0]
	b.sharedData = nil
	b.sharedIDs = make(map[string]int)
	type usedIno struct {
		ino uint64
		dir bool
	}
	inos := make([]usedIno, 0, len(b.nodes)+disklayout.FirstIno)
	for ino := uint64(1); ino < disklayout.FirstIno; ino++ {
		if ino != disklayout.RootIno && !(ino == disklayout.JournalIno && b.journal >= 0) {
			inos = append(inos, usedIno{ino, false})
		}
	}
	for i := range b.nodes {
		inos = append(inos, usedIno{uint64(b.nodes[i].ino), b.nodes[i].typ == index.TypeDir})
	}
	sort.Slice(inos, func(i, j int) bool { return inos[i].ino < inos[j].ino })

	gdt := make([]byte, b.gdtBlocks*bs)
	buf := make([]byte, bs)
	used := b.alloc.used
	ui, ii := 0, 0
	b.freeBlocks, b.freeInodes = 0, 0
	for g := uint64(0); g < b.ngroups; g++ {
		gstart, gend := g*bpg, min((g+1)*bpg, b.blocks)
		free := gend - gstart
		clear(buf)
		if disklayout.HasSuper(g) {
			setBits(buf, 0, resv)
			free -= resv
		}
		for ui < len(used) && used[ui].start+used[ui].n <= gstart {
			ui++
		}
		for k := ui; k < len(used) && used[k].start < gend; k++ {
			s, e := max(used[k].start, gstart), min(used[k].start+used[k].n, gend)
			setBits(buf, s-gstart, e-s)
			free -= e - s
		}
		if gend-gstart < bpg {
			setBits(buf, gend-gstart, bpg-(gend-gstart)) // past the end of the disk
		}
		bbc := disklayout.BitmapChecksum(b.fsSeed, buf[:bpg/8])
		b.shared = append(b.shared, sharedRange{brange{b.bbitmap[g], 1}, b.intern(buf)})

		clear(buf)
		var ifree, dirs, usedMax uint64 = ipg, 0, 0
		for ; ii < len(inos) && (inos[ii].ino-1)/ipg == g; ii++ {
			i := (inos[ii].ino - 1) % ipg
			setBits(buf, i, 1)
			ifree--
			usedMax = i + 1
			if inos[ii].dir {
				dirs++
			}
		}
		setBits(buf, ipg, bs*8-ipg)
		ibc := disklayout.BitmapChecksum(b.fsSeed, buf[:ipg/8])
		b.shared = append(b.shared, sharedRange{brange{b.ibitmap[g], 1}, b.intern(buf)})

		unused := ipg - usedMax
		gd := disklayout.GroupDesc{
			BlockBitmapLo: uint32(b.bbitmap[g]), BlockBitmapHi: uint32(b.bbitmap[g] >> 32),
			InodeBitmapLo: uint32(b.ibitmap[g]), InodeBitmapHi: uint32(b.ibitmap[g] >> 32),
			InodeTableLo: uint32(b.itable[g]), InodeTableHi: uint32(b.itable[g] >> 32),
			FreeBlocksCountLo: uint16(free), FreeBlocksCountHi: uint16(free >> 16),
			FreeInodesCountLo: uint16(ifree), FreeInodesCountHi: uint16(ifree >> 16),
			UsedDirsCountLo: uint16(dirs), UsedDirsCountHi: uint16(dirs >> 16),
			ItableUnusedLo: uint16(unused), ItableUnusedHi: uint16(unused >> 16),
			BlockBitmapCsumLo: uint16(bbc), BlockBitmapCsumHi: uint16(bbc >> 16),
			InodeBitmapCsumLo: uint16(ibc), InodeBitmapCsumHi: uint16(ibc >> 16),
			Flags: disklayout.BGItableZeroed,
		}
		gd.Marshal(gdt[g*disklayout.GroupDescSize64:], b.fsSeed, uint32(g))
		b.freeBlocks += free
		b.freeInodes += ifree
	}
	id := b.intern(gdt)
	b.shared = append(b.shared, sharedRange{brange{1, b.gdtBlocks}, id})
	for _, s := range b.alloc.backups {
		b.shared = append(b.shared, sharedRange{brange{s + 1, b.gdtBlocks}, id})
	}
	b.sharedIDs = nil
}

// writeSupers writes the primary superblock and its backups.
func (b *builder) writeSupers() error {
	bs, bpg, ipg := b.bs, b.bs*8, b.ipg
	totalFreeBlocks, totalFreeInodes := b.freeBlocks, b.freeInodes
	now, _ := b.now()
	t32, thi := uint32(now), uint8(uint64(now)>>32)
	sb := disklayout.SuperBlock{
		InodesCount:   uint32(ipg * b.ngroups),
		BlocksCountLo: uint32(b.blocks), BlocksCountHi: uint32(b.blocks >> 32),
		FreeBlocksCountLo: uint32(totalFreeBlocks), FreeBlocksCountHi: uint32(totalFreeBlocks >> 32),
		FreeInodesCount: uint32(totalFreeInodes),
		LogBlockSize:    uint32(bits.TrailingZeros64(bs) - 10), LogClusterSize: uint32(bits.TrailingZeros64(bs) - 10),
		BlocksPerGroup: uint32(bpg), ClustersPerGroup: uint32(bpg), InodesPerGroup: uint32(ipg),
		Wtime: t32, WtimeHi: thi, LastCheck: t32, LastCheckHi: thi, MkfsTime: t32, MkfsTimeHi: thi,
		MaxMntCount:      0xFFFF,
		Magic:            disklayout.SuperMagic,
		State:            disklayout.StateClean,
		Errors:           disklayout.ErrorsContinue,
		RevLevel:         disklayout.GoodOldRevNum,
		FirstIno:         disklayout.FirstIno,
		InodeSize:        disklayout.InodeSize,
		FeatureCompat:    featCompat,
		FeatureIncompat:  featIncompat,
		FeatureROCompat:  featROCompat,
		UUID:             b.uuid,
		HashSeed:         b.hashSeed,
		DefHashVersion:   disklayout.HashHalfMD4,
		DescSize:         disklayout.GroupDescSize64,
		DefaultMountOpts: disklayout.MountOptXattrUser | disklayout.MountOptACL,
		MinExtraIsize:    disklayout.InodeExtraSize, WantExtraIsize: disklayout.InodeExtraSize,
		Flags:            disklayout.FlagsSignedHash,
		LogGroupsPerFlex: logGroupsPerFlex,
		ChecksumType:     disklayout.ChecksumCRC32C,
	}
	copy(sb.VolumeName[:], b.opts.VolumeName)
	if b.journal >= 0 {
		sb.FeatureCompat |= disklayout.CompatHasJournal
		sb.JournalInum = disklayout.JournalIno
		sb.JnlBackupType = disklayout.JnlBackupBlocks
		var jin disklayout.Inode
		if err := jin.Unmarshal(b.inodeRecord(disklayout.JournalIno)); err != nil {
			return fmt.Errorf("ext4: journal inode: %w", err)
		}
		sb.JnlBlocks = jin.JournalBackup()
	}
	write := func(g uint64) error {
		sb.BlockGroupNr = uint16(g)
		buf := b.metaBlocks(g*bpg, 1)
		at := 0
		if g == 0 {
			at = disklayout.SuperBlockOffset
		}
		if err := sb.Marshal(buf[at:]); err != nil {
			return fmt.Errorf("ext4: superblock of group %d: %w", g, err)
		}
		return nil
	}
	if err := write(0); err != nil {
		return err
	}
	for _, s := range b.alloc.backups {
		if err := write(s / bpg); err != nil {
			return err
		}
	}
	return nil
}

// setBits sets n bits of a little-endian bitmap from bit i.
func setBits(bm []byte, i, n uint64) {
	for n > 0 && i%8 != 0 {
		bm[i/8] |= 1 << (i % 8)
		i, n = i+1, n-1
	}
	for n >= 8 {
		bm[i/8] = 0xFF
		i, n = i+8, n-8
	}
	for n > 0 {
		bm[i/8] |= 1 << (i % 8)
		i, n = i+1, n-1
	}
}

// blockMap combines stored, zero and data ranges into the block map.
func (b *builder) blockMap() (*blockmap.Map, error) {
	all := make([]blockmap.Extent, 0, len(b.stored)+len(b.shared)+len(b.zero)+len(b.dataExts))
	for i, r := range b.stored {
		all = append(all, blockmap.Extent{First: r.start, Count: r.n, Kind: blockmap.Meta,
			Loc: blockmap.Location{Offset: int64(b.metaOff[i])}, Bytes: r.n * b.bs})
	}
	for _, r := range b.shared {
		all = append(all, blockmap.Extent{First: r.r.start, Count: r.r.n, Kind: blockmap.Meta,
			Loc: blockmap.Location{Offset: int64(b.sharedOff[r.id])}, Bytes: r.r.n * b.bs})
	}
	for _, r := range b.zero {
		all = append(all, blockmap.Extent{First: r.start, Count: r.n, Kind: blockmap.Zero})
	}
	all = append(all, b.dataExts...)
	sort.Slice(all, func(i, j int) bool { return all[i].First < all[j].First })
	mb := blockmap.NewBuilder(uint32(b.bs), b.blocks)
	for _, e := range all {
		mb.Add(e)
	}
	m, err := mb.Map()
	if err != nil {
		return nil, fmt.Errorf("ext4: block map: %w", err)
	}
	return m, nil
}
