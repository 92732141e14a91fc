package ext4

import (
	"context"
	"errors"
	"fmt"
	"sort"

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

func pathErr(p string, format string, args ...any) error {
	return fmt.Errorf("%w: %q: %s", ErrInvalidIndex, p, fmt.Sprintf(format, args...))
}

// cancelled checks ctx every cancelEvery items of a loop.
func cancelled(ctx context.Context, i int) error {
	if i%cancelEvery == 0 {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("ext4: build: %w", err)
		}
	}
	return nil
}

// Build plans and emits the metadata of an ext4 filesystem holding idx.
// The metadata goes to an unlinked file in Options.TempDir as it is made;
// the Image holds it open until Close. A hostile index cannot make it
// spend more than Options' budgets allow: the error then names the budget
// (see BudgetError).
func Build(ctx context.Context, idx *index.Index, opts Options) (*Image, error) {
	if idx == nil {
		return nil, fmt.Errorf("%w: nil index", ErrInvalidIndex)
	}
	if err := opts.normalize(); err != nil {
		return nil, err
	}
	p, err := makePlan(ctx, idx, opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("ext4: build: %w", err)
	}
	md, err := emit(ctx, p, opts.TempDir)
	if err != nil {
		return nil, err
	}
	img, err := newImage(p, md)
	if err != nil {
		md.f.Close()
		return nil, err
	}
	return img, nil
}

// normalize applies the defaults and checks the options.
func (o *Options) normalize() error {
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.BlockSize != 2048 && o.BlockSize != 4096 {
		// 1024 would need s_first_data_block = 1 and shifted groups.
		return fmt.Errorf("ext4: block size %d not supported (2048 or 4096)", o.BlockSize)
	}
	if o.WritableSize == 0 {
		o.WritableSize = DefaultWritableSize
	}
	if o.WritableSize < 0 {
		o.WritableSize = 0
	}
	if o.JournalSize < 0 || o.JournalSize > 0 && (o.JournalSize/int64(o.BlockSize) < 1024 || o.JournalSize/int64(o.BlockSize) > maxJournalBlocks) {
		return fmt.Errorf("ext4: journal size %d outside %d..%d blocks", o.JournalSize, 1024, maxJournalBlocks)
	}
	if o.MaxMetadataBytes < 0 || o.MaxBuildMemory < 0 {
		return fmt.Errorf("ext4: negative budget (metadata %d, build memory %d bytes)", o.MaxMetadataBytes, o.MaxBuildMemory)
	}
	if o.MaxMetadataBytes == 0 {
		o.MaxMetadataBytes = DefaultMaxMetadataBytes
	}
	if o.MaxBuildMemory == 0 {
		o.MaxBuildMemory = DefaultMaxBuildMemory
	}
	if len(o.VolumeName) > 16 {
		return fmt.Errorf("ext4: volume name %q longer than 16 bytes", o.VolumeName)
	}
	return nil
}

// now is the build's timestamp: Options.Time, or the epoch.
func (o *Options) now() (int64, uint32) {
	if o.Time.IsZero() {
		return 0, 0
	}
	return o.Time.Unix(), uint32(o.Time.Nanosecond())
}

// plan is everything Build decides before writing a byte; emit only reads it.
type plan struct {
	idx      *index.Index
	opts     Options
	uuid     [16]byte
	hashSeed [4]uint32
	fsSeed   uint32 // seed of every metadata checksum

	tree    *tree
	content *contents
	layout  *layout
	stored  []brange // blocks whose bytes are in the metadata file, sorted
	zero    []brange // allocated blocks that read as zeros
	groups  *groupUse
	budget  *budget
}

// makePlan runs the planning phases: scan the index, number the inodes,
// build the content of directories, symlinks and xattrs, place every
// block, then derive what the block map and the group descriptors need.
func makePlan(ctx context.Context, idx *index.Index, opts Options) (*plan, error) {
	p := &plan{idx: idx, opts: opts, budget: newBudget(&opts)}
	if err := p.budget.hold(indexBytes(idx)); err != nil {
		return nil, err
	}
	id := identity(idx)
	p.uuid = opts.UUID
	if p.uuid == ([16]byte{}) {
		copy(p.uuid[:], id[:16])
		p.uuid[6] = p.uuid[6]&0x0f | 0x40 // version 4 layout, as uuid_generate
		p.uuid[8] = p.uuid[8]&0x3f | 0x80
	}
	hs := opts.HashSeed
	if hs == ([16]byte{}) {
		copy(hs[:], id[16:])
	}
	p.hashSeed = disklayout.HashSeedWords(hs)
	p.fsSeed = disklayout.FSChecksumSeed(p.uuid)

	bs := uint64(opts.BlockSize)
	var err error
	// Charged up front, before the tables are made, so that an index too
	// large for the memory budget is refused before it is spent.
	if err := p.budget.hold(uint64(len(idx.Entries)+3) * perNodeBytes); err != nil {
		return nil, err
	}
	if p.tree, err = scan(ctx, idx, bs, !opts.NoJournal); err != nil {
		return nil, err
	}
	if err = p.tree.assignInodes(); err != nil {
		return nil, err
	}
	if p.content, err = planContent(ctx, p.tree, bs, p.hashSeed, p.budget); err != nil {
		return nil, err
	}
	if p.layout, err = searchLayout(ctx, idx, &p.opts, p.tree, p.content); err != nil {
		return nil, err
	}
	if p.stored, p.zero, err = p.layout.storedAndZero(); err != nil {
		return nil, err
	}
	if err := p.budget.hold(uint64(len(p.layout.dataExts)+len(p.stored)+len(p.zero)) * perExtentBytes); err != nil {
		return nil, err
	}
	p.groups = useGroups(p.tree, p.layout)
	return p, nil
}

// storedAndZero lists the blocks whose bytes go in the metadata file,
// sorted, and the allocated blocks that read as zeros: inode table space
// past a group's last used inode, the journal after its superblock. Group
// descriptor tables and bitmaps are neither: emit stores each distinct
// content once.
func (l *layout) storedAndZero() (stored, zero []brange, err error) {
	stored = append(stored, brange{0, 1})
	for _, s := range l.backups {
		stored = append(stored, brange{s, 1}) // superblocks differ in their group number
	}
	for _, t := range l.itable {
		if t.stored > 0 {
			stored = append(stored, brange{t.start, t.stored})
		}
		if t.stored < l.itb {
			zero = append(zero, brange{t.start + t.stored, l.itb - t.stored})
		}
	}
	for k, r := range l.journal {
		if k == 0 {
			stored = append(stored, brange{r.start, 1})
			r.start++
			r.n--
		}
		if r.n > 0 {
			zero = append(zero, r)
		}
	}
	for i := range l.nodes {
		stored = append(stored, l.nodes[i].metaRuns...)
	}
	for _, x := range l.xblocks {
		stored = append(stored, brange{x, 1})
	}
	for i := range l.nodes {
		stored = append(stored, l.nodes[i].treeRuns...)
	}
	sort.Slice(stored, func(i, j int) bool { return stored[i].start < stored[j].start })
	for i := 1; i < len(stored); i++ {
		if stored[i-1].start+stored[i-1].n > stored[i].start {
			return nil, nil, fmt.Errorf("ext4: internal error: metadata blocks %d and %d overlap", stored[i-1].start, stored[i].start)
		}
	}
	return stored, zero, nil
}

// groupUse is what the group descriptors and bitmaps count.
type groupUse struct {
	groups     []groupCounts
	inodes     []usedIno // every used inode, sorted
	inodeStart []int     // inodes[inodeStart[g]:inodeStart[g+1]] are group g's
	freeBlocks uint64
	freeInodes uint64
}

// groupCounts is one group's share of the superblock counts.
type groupCounts struct {
	freeBlocks, freeInodes, dirs, itableUnused uint64
}

// usedIno is an inode in use.
type usedIno struct {
	ino uint64
	dir bool
}

// useGroups counts the free blocks and inodes and the directories of every
// group, and lists the used inodes by group for the inode bitmaps.
func useGroups(t *tree, l *layout) *groupUse {
	u := &groupUse{groups: make([]groupCounts, l.ngroups), inodeStart: make([]int, l.ngroups+1)}
	u.inodes = make([]usedIno, 0, len(t.nodes)+disklayout.FirstIno)
	for ino := uint64(1); ino < disklayout.FirstIno; ino++ {
		if ino != disklayout.RootIno && !(ino == disklayout.JournalIno && t.journal >= 0) {
			u.inodes = append(u.inodes, usedIno{ino, false})
		}
	}
	for i := range t.nodes {
		u.inodes = append(u.inodes, usedIno{uint64(t.nodes[i].ino), t.nodes[i].typ == index.TypeDir})
	}
	sort.Slice(u.inodes, func(i, j int) bool { return u.inodes[i].ino < u.inodes[j].ino })
	k := 0
	for g := range u.groups {
		u.inodeStart[g] = k
		for k < len(u.inodes) && (u.inodes[k].ino-1)/l.ipg == uint64(g) {
			k++
		}
	}
	u.inodeStart[l.ngroups] = k

	for g := range u.groups {
		c := &u.groups[g]
		start, end := l.groupBlocks(uint64(g))
		c.freeBlocks = end - start
		l.usedBlocks(uint64(g), func(_, n uint64) { c.freeBlocks -= n })
		inos := u.groupInodes(uint64(g))
		c.freeInodes = l.ipg - uint64(len(inos))
		for _, in := range inos {
			if in.dir {
				c.dirs++
			}
		}
		c.itableUnused = l.ipg
		if len(inos) > 0 {
			c.itableUnused = l.ipg - ((inos[len(inos)-1].ino-1)%l.ipg + 1)
		}
		u.freeBlocks += c.freeBlocks
		u.freeInodes += c.freeInodes
	}
	return u
}

// groupInodes is the used inodes of group g.
func (u *groupUse) groupInodes(g uint64) []usedIno {
	return u.inodes[u.inodeStart[g]:u.inodeStart[g+1]]
}

// groupBlocks is the range of blocks of group g on the disk: the last
// group may be short.
func (l *layout) groupBlocks(g uint64) (start, end uint64) {
	return g * l.bpg, min((g+1)*l.bpg, l.blocks)
}

// usedBlocks calls fn for each run of used blocks of group g, as offsets
// from the group's start: the superblock and descriptor copy, then the
// allocated runs.
func (l *layout) usedBlocks(g uint64, fn func(off, n uint64)) {
	start, end := l.groupBlocks(g)
	if disklayout.HasSuper(g) {
		fn(0, l.resv())
	}
	i := sort.Search(len(l.used), func(i int) bool { return l.used[i].start+l.used[i].n > start })
	for ; i < len(l.used) && l.used[i].start < end; i++ {
		s, e := max(l.used[i].start, start), min(l.used[i].start+l.used[i].n, end)
		fn(s-start, e-s)
	}
}
