package ext4

import (
	"bytes"
	"context"
	"fmt"
	"math/bits"
	"os"
	"sort"

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

// metadata is what emit writes: the metadata file and where each stored
// and shared range sits in it.
type metadata struct {
	f         *os.File // unlinked temporary file, closed by Image.Close
	size      uint64
	storedOff []uint64 // byte offset of plan.stored[i]
	shared    []sharedRange
	sharedOff []uint64 // byte offset of the content with id i
}

// sharedRange is a run of blocks whose bytes are shared content: the
// group descriptor table copies and the bitmaps, which on a large image
// are mostly identical (full data groups, empty inode groups), so each
// distinct block is stored once.
type sharedRange struct {
	r  brange
	id int // index into metadata.sharedOff
}

// emitter writes a plan's bytes straight to the metadata file, block by
// block, so that what it holds is one node's blocks at a time.
type emitter struct {
	p   *plan
	bs  uint64
	md  *metadata
	err error // first write error; later writes are skipped
	// journalInode is kept for the superblock's s_jnl_blocks copy.
	journalInode disklayout.Inode
	blk          []byte // scratch block
}

// emit writes every stored block of the plan and the shared group tables
// into a metadata file created in dir (the system's temporary directory
// when empty), computing every checksum. The file is unlinked at once, so
// a failed or killed build leaves nothing behind.
func emit(ctx context.Context, p *plan, dir string) (md *metadata, err error) {
	f, err := os.CreateTemp(dir, ".ext4-meta-*")
	if err != nil {
		return nil, fmt.Errorf("ext4: metadata file: %w", err)
	}
	if err := os.Remove(f.Name()); err != nil {
		f.Close()
		return nil, fmt.Errorf("ext4: metadata file: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	e := &emitter{p: p, bs: p.layout.bs, md: &metadata{f: f}, blk: make([]byte, p.layout.bs)}
	shared := e.groupTables()
	if err := p.budget.metadata(e.storedBytes(shared)); err != nil {
		return nil, err
	}
	e.allocate(shared)
	shared = nil
	for i := range p.tree.nodes {
		if err := cancelled(ctx, i); err != nil {
			return nil, err
		}
		if err := e.writeContent(i); err != nil {
			return nil, err
		}
		e.writeInode(i)
		if e.err != nil {
			break
		}
	}
	e.writeReservedInodes()
	e.writeXattrBlocks()
	if err := e.writeJournalSuper(); err != nil {
		return nil, err
	}
	if err := e.writeSupers(); err != nil {
		return nil, err
	}
	if e.err != nil {
		return nil, fmt.Errorf("ext4: write metadata: %w", e.err)
	}
	return e.md, nil
}

// groupTables encodes every group's bitmaps and the group descriptor
// table, returning each distinct content once; e.md.shared says which
// blocks hold which.
func (e *emitter) groupTables() [][]byte {
	p, l := e.p, e.p.layout
	var data [][]byte
	ids := make(map[string]int)
	intern := func(c []byte) int {
		if id, ok := ids[string(c)]; ok {
			return id
		}
		data = append(data, bytes.Clone(c))
		ids[string(c)] = len(data) - 1
		return len(data) - 1
	}
	gdt := make([]byte, l.gdtBlocks*e.bs)
	buf := make([]byte, e.bs)
	for g := uint64(0); g < l.ngroups; g++ {
		clear(buf)
		l.usedBlocks(g, func(off, n uint64) { setBits(buf, off, n) })
		if start, end := l.groupBlocks(g); end-start < l.bpg {
			setBits(buf, end-start, l.bpg-(end-start)) // past the end of the disk
		}
		bbc := disklayout.BitmapChecksum(p.fsSeed, buf[:l.bpg/8])
		e.md.shared = append(e.md.shared, sharedRange{brange{l.bbitmap[g], 1}, intern(buf)})

		clear(buf)
		for _, in := range p.groups.groupInodes(g) {
			setBits(buf, (in.ino-1)%l.ipg, 1)
		}
		setBits(buf, l.ipg, e.bs*8-l.ipg)
		ibc := disklayout.BitmapChecksum(p.fsSeed, buf[:l.ipg/8])
		e.md.shared = append(e.md.shared, sharedRange{brange{l.ibitmap[g], 1}, intern(buf)})

		c := &p.groups.groups[g]
		it := l.itable[g].start
		gd := disklayout.GroupDesc{
			BlockBitmapLo: uint32(l.bbitmap[g]), BlockBitmapHi: uint32(l.bbitmap[g] >> 32),
			InodeBitmapLo: uint32(l.ibitmap[g]), InodeBitmapHi: uint32(l.ibitmap[g] >> 32),
			InodeTableLo: uint32(it), InodeTableHi: uint32(it >> 32),
			FreeBlocksCountLo: uint16(c.freeBlocks), FreeBlocksCountHi: uint16(c.freeBlocks >> 16),
			FreeInodesCountLo: uint16(c.freeInodes), FreeInodesCountHi: uint16(c.freeInodes >> 16),
			UsedDirsCountLo: uint16(c.dirs), UsedDirsCountHi: uint16(c.dirs >> 16),
			ItableUnusedLo: uint16(c.itableUnused), ItableUnusedHi: uint16(c.itableUnused >> 16),
			BlockBitmapCsumLo: uint16(bbc), BlockBitmapCsumHi: uint16(bbc >> 16),
			InodeBitmapCsumLo: uint16(ibc), InodeBitmapCsumHi: uint16(ibc >> 16),
			Flags: disklayout.BGItableZeroed,
		}
		gd.Marshal(gdt[g*disklayout.GroupDescSize64:], p.fsSeed, uint32(g))
	}
	id := intern(gdt)
	e.md.shared = append(e.md.shared, sharedRange{brange{1, l.gdtBlocks}, id})
	for _, s := range l.backups {
		e.md.shared = append(e.md.shared, sharedRange{brange{s + 1, l.gdtBlocks}, id})
	}
	return data
}

// storedBytes is the size of the metadata file: the stored ranges plus
// the shared contents.
func (e *emitter) storedBytes(shared [][]byte) uint64 {
	var n uint64
	for _, r := range e.p.stored {
		n += r.n * e.bs
	}
	for _, d := range shared {
		n += uint64(len(d))
	}
	return n
}

// allocate lays out the metadata file, the stored ranges in block order
// then the shared contents, and writes the shared contents. Blocks emit
// does not write (the unused part of a directory's last block, say) stay
// holes that read as zeros.
func (e *emitter) allocate(shared [][]byte) {
	md := e.md
	md.storedOff = make([]uint64, len(e.p.stored))
	var off uint64
	for i, r := range e.p.stored {
		md.storedOff[i] = off
		off += r.n * e.bs
	}
	md.sharedOff = make([]uint64, len(shared))
	for i, d := range shared {
		md.sharedOff[i] = off
		off += uint64(len(d))
	}
	md.size = off
	if err := md.f.Truncate(int64(off)); err != nil {
		e.err = err
		return
	}
	for i, d := range shared {
		e.writeAt(d, md.sharedOff[i])
	}
}

// writeAt writes b at byte off of the metadata file, keeping the first
// error.
func (e *emitter) writeAt(b []byte, off uint64) {
	if e.err != nil {
		return
	}
	if _, err := e.md.f.WriteAt(b, int64(off)); err != nil {
		e.err = err
	}
}

// metaOff returns where n stored blocks starting at blk are in the
// metadata file.
func (e *emitter) metaOff(blk, n uint64) uint64 {
	stored := e.p.stored
	i := sort.Search(len(stored), func(i int) bool { return stored[i].start+stored[i].n > blk })
	if i == len(stored) || blk < stored[i].start || blk+n > stored[i].start+stored[i].n {
		panic(fmt.Sprintf("ext4: internal error: block %d+%d not stored", blk, n))
	}
	return e.md.storedOff[i] + (blk-stored[i].start)*e.bs
}

// putBlocks writes whole blocks b at block blk.
func (e *emitter) putBlocks(blk uint64, b []byte) {
	e.writeAt(b, e.metaOff(blk, uint64(len(b))/e.bs))
}

// scratch returns the zeroed scratch block.
func (e *emitter) scratch() []byte {
	clear(e.blk)
	return e.blk
}

// inodeOff returns where ino's inode table slot is in the metadata file.
func (e *emitter) inodeOff(ino uint32) uint64 {
	l := e.p.layout
	g := uint64(ino-1) / l.ipg
	o := (uint64(ino-1) % l.ipg) * disklayout.InodeSize
	return e.metaOff(l.itable[g].start+o/e.bs, 1) + o%e.bs
}

// writeContent makes node i's directory or symlink blocks again, writes
// them where they were placed and checksums a directory's blocks there.
func (e *emitter) writeContent(i int) error {
	c, n := &e.p.content.nodes[i], &e.p.tree.nodes[i]
	if c.size == 0 {
		return nil
	}
	data, err := nodeData(e.p.tree, int32(i), c, e.bs, e.p.hashSeed)
	if err != nil {
		return err
	}
	if uint64(len(data)) != c.size {
		return fmt.Errorf("ext4: internal error: %q made %d bytes of blocks, planned %d", n.path, len(data), c.size)
	}
	seed := disklayout.InodeChecksumSeed(e.p.fsSeed, n.ino, 0)
	src, k := data, 0
	for _, r := range e.p.layout.nodes[i].metaRuns {
		dst := src[:r.n*e.bs]
		src = src[r.n*e.bs:]
		for blks := dst; n.typ == index.TypeDir && len(blks) > 0; k++ {
			blk := blks[:e.bs]
			switch {
			case k == 0 && c.dxBlocks > 0:
				disklayout.SetDxChecksum(blk, disklayout.DxRootCountOffset, seed)
			case k < c.dxBlocks:
				disklayout.SetDxChecksum(blk, disklayout.DxNodeCountOffset, seed)
			default:
				disklayout.SetDirentTail(blk, seed)
			}
			blks = blks[e.bs:]
		}
		e.putBlocks(r.start, dst)
	}
	return nil
}

// writeInode encodes node i's inode and its extent tree blocks.
func (e *emitter) writeInode(i int) {
	n, c, pl := &e.p.tree.nodes[i], &e.p.content.nodes[i], &e.p.layout.nodes[i]
	var in disklayout.Inode
	var uid, gid uint32
	var perm uint32
	now, nowNs := e.p.opts.now()
	at, mt, ct := index.Timespec{Sec: now, Nsec: nowNs}, index.Timespec{Sec: now, Nsec: nowNs}, index.Timespec{Sec: now, Nsec: nowNs}
	if ent := n.ent; ent != nil {
		uid, gid, perm = ent.UID, ent.GID, ent.Mode
		at, mt, ct = ent.Atime, ent.Mtime, ent.Ctime
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
			size = pl.dataBlks * e.bs
		}
		in.Flags |= disklayout.InodeExtentsFl
	case index.TypeDir:
		in.Mode = disklayout.ModeDir
		size = c.size
		in.Flags |= disklayout.InodeExtentsFl
	case index.TypeSymlink:
		in.Mode = disklayout.ModeSymlink
		size = uint64(len(n.ent.Linkname))
		if c.size == 0 {
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
	in.Flags |= c.flags
	in.UIDLo, in.UIDHi = uint16(uid), uint16(uid>>16)
	in.GIDLo, in.GIDHi = uint16(gid), uint16(gid>>16)
	in.SizeLo, in.SizeHi = uint32(size), uint32(size>>32)
	in.Atime, in.AtimeExtra = disklayout.EncodeTime(at.Sec, at.Nsec)
	in.Mtime, in.MtimeExtra = disklayout.EncodeTime(mt.Sec, mt.Nsec)
	in.Ctime, in.CtimeExtra = disklayout.EncodeTime(ct.Sec, ct.Nsec)
	in.Crtime, in.CrtimeExtra = in.Ctime, in.CtimeExtra
	in.LinksCount = uint16(n.nlink)
	in.ExtraIsize = disklayout.InodeExtraSize
	owned := pl.dataBlks + runBlocks(pl.treeRuns)
	if c.xattrBlk >= 0 {
		x := e.p.layout.xblocks[c.xattrBlk]
		in.FileACLLo, in.FileACLHi = uint32(x), uint16(x>>32)
		owned++
	}
	sectors := owned * (e.bs / 512)
	in.BlocksLo, in.BlocksHi = uint32(sectors), uint16(sectors>>32)
	if in.Flags&disklayout.InodeExtentsFl != 0 {
		e.writeExtentTree(n.ino, pl, in.Block[:])
	}
	rec := e.scratch()[:disklayout.InodeSize]
	in.Marshal(rec)
	if c.xattrIn != nil {
		copy(rec[disklayout.InodeXattrOffset:], c.xattrIn)
	}
	disklayout.SetInodeChecksum(rec, e.p.fsSeed, n.ino, 0)
	e.writeAt(rec, e.inodeOff(n.ino))
	if int32(i) == e.p.tree.journal {
		e.journalInode = in
	}
}

// runBlocks is the number of blocks in runs.
func runBlocks(runs []brange) uint64 {
	var n uint64
	for _, r := range runs {
		n += r.n
	}
	return n
}

// writeExtentTree writes the root into iblock (i_block) and any leaf and
// index blocks into their planned tree blocks.
func (e *emitter) writeExtentTree(ino uint32, pl *placing, iblock []byte) {
	per := disklayout.ExtentsPerBlock(int(e.bs))
	seed := disklayout.InodeChecksumSeed(e.p.fsSeed, ino, 0)
	type ref struct {
		lblk uint32
		pblk uint64
	}
	if len(pl.exts) <= disklayout.ExtentRootMax {
		h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(pl.exts)), Max: disklayout.ExtentRootMax}
		h.Marshal(iblock)
		for k, x := range pl.exts {
			disklayout.MarshalLeaf(disklayout.ExtentEntry(iblock, k), x.lblk, uint16(x.n), x.pblk)
		}
		return
	}
	var tb []uint64 // tree blocks in allocation order: leaves, then each index level
	for _, r := range pl.treeRuns {
		for k := uint64(0); k < r.n; k++ {
			tb = append(tb, r.start+k)
		}
	}
	next := func() uint64 {
		b := tb[0]
		tb = tb[1:]
		return b
	}
	var level []ref
	for k := 0; k < len(pl.exts); k += per {
		chunk := pl.exts[k:min(k+per, len(pl.exts))]
		pblk := next()
		blk := e.scratch()
		h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(chunk)), Max: uint16(per)}
		h.Marshal(blk)
		for j, x := range chunk {
			disklayout.MarshalLeaf(disklayout.ExtentEntry(blk, j), x.lblk, uint16(x.n), x.pblk)
		}
		disklayout.SetExtentBlockChecksum(blk, seed)
		e.putBlocks(pblk, blk)
		level = append(level, ref{chunk[0].lblk, pblk})
	}
	depth := uint16(1)
	for len(level) > disklayout.ExtentRootMax {
		var up []ref
		for k := 0; k < len(level); k += per {
			chunk := level[k:min(k+per, len(level))]
			pblk := next()
			blk := e.scratch()
			h := disklayout.ExtentHeader{Magic: disklayout.ExtentMagic, Entries: uint16(len(chunk)), Max: uint16(per), Depth: depth}
			h.Marshal(blk)
			for j, c := range chunk {
				disklayout.MarshalIdx(disklayout.ExtentEntry(blk, j), c.lblk, c.pblk)
			}
			disklayout.SetExtentBlockChecksum(blk, seed)
			e.putBlocks(pblk, blk)
			up = append(up, ref{chunk[0].lblk, pblk})
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

// writeReservedInodes writes the reserved inodes other than root and the
// journal as mkfs leaves them: empty but for i_extra_isize.
func (e *emitter) writeReservedInodes() {
	for ino := uint32(1); ino < disklayout.FirstIno; ino++ {
		if ino == disklayout.RootIno || ino == disklayout.JournalIno && e.p.tree.journal >= 0 {
			continue
		}
		rec := e.scratch()[:disklayout.InodeSize]
		in := disklayout.Inode{ExtraIsize: disklayout.InodeExtraSize}
		in.Marshal(rec)
		disklayout.SetInodeChecksum(rec, e.p.fsSeed, ino, 0)
		e.writeAt(rec, e.inodeOff(ino))
	}
}

// writeXattrBlocks writes the shared xattr blocks with their reference
// counts and checksums.
func (e *emitter) writeXattrBlocks() {
	for k, x := range e.p.content.xblocks {
		pblk := e.p.layout.xblocks[k]
		blk := e.scratch()
		copy(blk, x.data)
		disklayout.SetXattrRefcount(blk, x.refs)
		disklayout.SetXattrBlockChecksum(blk, e.p.fsSeed, pblk)
		e.putBlocks(pblk, blk)
	}
}

// writeJournalSuper writes an empty journal's superblock in its first block.
func (e *emitter) writeJournalSuper() error {
	p := e.p
	if p.tree.journal < 0 {
		return nil
	}
	js := disklayout.JournalSuperBlock{
		HeaderMagic: disklayout.JournalMagic, HeaderBlocktype: disklayout.Jbd2SuperblockV2,
		BlockSize: uint32(e.bs), MaxLen: uint32(p.layout.nodes[p.tree.journal].dataBlks), First: 1, Sequence: 1,
		UUID: p.uuid, NrUsers: 1,
	}
	blk := e.scratch()
	if err := js.Marshal(blk); err != nil {
		return fmt.Errorf("ext4: journal superblock: %w", err)
	}
	e.putBlocks(p.layout.journal[0].start, blk)
	return nil
}

// writeSupers writes the primary superblock and its backups.
func (e *emitter) writeSupers() error {
	p, l := e.p, e.p.layout
	now, _ := p.opts.now()
	t32, thi := uint32(now), uint8(uint64(now)>>32)
	logBS := uint32(bits.TrailingZeros64(e.bs) - 10)
	sb := disklayout.SuperBlock{
		InodesCount:   uint32(l.ipg * l.ngroups),
		BlocksCountLo: uint32(l.blocks), BlocksCountHi: uint32(l.blocks >> 32),
		FreeBlocksCountLo: uint32(p.groups.freeBlocks), FreeBlocksCountHi: uint32(p.groups.freeBlocks >> 32),
		FreeInodesCount: uint32(p.groups.freeInodes),
		LogBlockSize:    logBS, LogClusterSize: logBS,
		BlocksPerGroup: uint32(l.bpg), ClustersPerGroup: uint32(l.bpg), InodesPerGroup: uint32(l.ipg),
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
		UUID:             p.uuid,
		HashSeed:         p.hashSeed,
		DefHashVersion:   disklayout.HashHalfMD4,
		DescSize:         disklayout.GroupDescSize64,
		DefaultMountOpts: disklayout.MountOptXattrUser | disklayout.MountOptACL,
		MinExtraIsize:    disklayout.InodeExtraSize, WantExtraIsize: disklayout.InodeExtraSize,
		Flags:            disklayout.FlagsSignedHash,
		LogGroupsPerFlex: logGroupsPerFlex,
		ChecksumType:     disklayout.ChecksumCRC32C,
	}
	copy(sb.VolumeName[:], p.opts.VolumeName)
	if p.tree.journal >= 0 {
		sb.FeatureCompat |= disklayout.CompatHasJournal
		sb.JournalInum = disklayout.JournalIno
		sb.JnlBackupType = disklayout.JnlBackupBlocks
		sb.JnlBlocks = e.journalInode.JournalBackup()
	}
	write := func(g uint64) error {
		sb.BlockGroupNr = uint16(g)
		buf := e.scratch()
		at := 0
		if g == 0 {
			at = disklayout.SuperBlockOffset
		}
		if err := sb.Marshal(buf[at:]); err != nil {
			return fmt.Errorf("ext4: superblock of group %d: %w", g, err)
		}
		e.putBlocks(g*l.bpg, buf)
		return nil
	}
	if err := write(0); err != nil {
		return err
	}
	for _, s := range l.backups {
		if err := write(s / l.bpg); err != nil {
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
