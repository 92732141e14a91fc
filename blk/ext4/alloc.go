package ext4

import (
	"sort"

	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
)

// brange is a run of physical blocks.
type brange struct {
	start, n uint64
}

// allocator hands out blocks in increasing order, stepping over the
// superblock and group descriptor copies at the start of backup groups.
// Planning is a single forward sweep, so the used blocks are exactly the
// returned runs plus the backup areas.
type allocator struct {
	cur     uint64
	bpg     uint64
	resv    uint64   // blocks at the start of a backup group: superblock + GDT
	backups []uint64 // first block of each backup group except group 0, sorted
	used    []brange // runs handed out, merged, in order
}

func newAllocator(bpg, resv, ngroups uint64) *allocator {
	a := &allocator{bpg: bpg, resv: resv, cur: resv}
	for g := uint64(1); g < ngroups; g++ {
		if disklayout.HasSuper(g) {
			a.backups = append(a.backups, g*bpg)
		}
	}
	return a
}

// skip moves the cursor past a backup area it stands in and returns the
// block where the next backup area starts (or ^0).
func (a *allocator) skip() uint64 {
	i := sort.Search(len(a.backups), func(i int) bool { return a.backups[i]+a.resv > a.cur })
	if i < len(a.backups) && a.backups[i] <= a.cur {
		a.cur = a.backups[i] + a.resv
		i++
	}
	if i < len(a.backups) {
		return a.backups[i]
	}
	return ^uint64(0)
}

func (a *allocator) take(start, n uint64) {
	if k := len(a.used); k > 0 && a.used[k-1].start+a.used[k-1].n == start {
		a.used[k-1].n += n
	} else {
		a.used = append(a.used, brange{start, n})
	}
	a.cur = start + n
}

// alloc returns n blocks as one or more runs.
func (a *allocator) alloc(n uint64, out []brange) []brange {
	for n > 0 {
		limit := a.skip()
		m := min(n, limit-a.cur)
		out = append(out, brange{a.cur, m})
		a.take(a.cur, m)
		n -= m
	}
	return out
}

// allocContig returns n contiguous blocks, leaving a gap before a backup
// area if the run would cross it.
func (a *allocator) allocContig(n uint64) uint64 {
	limit := a.skip()
	if a.cur+n > limit {
		a.cur = limit
		a.skip()
	}
	s := a.cur
	a.take(s, n)
	return s
}
