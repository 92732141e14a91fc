package ext4

import (
	"fmt"
	"unsafe"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Budgets a build enforces, named as their configuration keys so that an
// error says what to raise.
const (
	BudgetMetadata    = "kata_fsx.imagefs_blk.max_metadata_mb"
	BudgetBuildMemory = "kata_fsx.imagefs_blk.max_build_memory_mb"
)

// Default budgets, applied by Build to zero Options fields. The metadata
// of a large legitimate image (a million files in ten thousand
// directories) is a few hundred MiB; a layer of nothing but empty
// directories makes 4 KiB of metadata per 100-byte tar header, and is
// what the metadata budget stops.
const (
	DefaultMaxMetadataBytes = 4 << 30
	DefaultMaxBuildMemory   = 1 << 30
)

// BudgetError reports an index whose image would exceed one of the
// build's budgets. Need is what had been counted when the budget ran out:
// the whole image needs at least that much.
type BudgetError struct {
	Budget string // BudgetMetadata or BudgetBuildMemory
	Limit  uint64
	Need   uint64
}

func (e *BudgetError) Error() string {
	return fmt.Sprintf("ext4: image exceeds the %s budget: it needs at least %d bytes, the budget is %d (raise %s if the image is trusted)",
		e.Budget, e.Need, e.Limit, e.Budget)
}

// Per-item memory of the build's tables, charged up front. They are
// estimates of the large structures, not a measurement: a node's entry
// in every per-node table plus map overhead, and a block map extent with
// its sorting copy.
const (
	perNodeBytes = uint64(unsafe.Sizeof(node{})+unsafe.Sizeof(child{})+unsafe.Sizeof(content{})+
		unsafe.Sizeof(placing{})+unsafe.Sizeof(fext{})+unsafe.Sizeof(usedIno{})) + 64
	perExtentBytes = 2 * 64
	// transientFactor covers a directory's blocks plus the sorted entry
	// list they are made from, both alive while one directory is written.
	transientFactor = 3
)

// budget counts what a build holds against Options' budgets.
type budget struct {
	maxMeta, maxMem uint64
	held            uint64 // memory held until the build ends
	peak            uint64 // the largest transient buffer (one directory's blocks)
}

func newBudget(o *Options) *budget {
	return &budget{maxMeta: uint64(o.MaxMetadataBytes), maxMem: uint64(o.MaxBuildMemory)}
}

// hold charges n bytes of memory kept for the rest of the build.
func (b *budget) hold(n uint64) error {
	b.held += n
	return b.checkMem()
}

// transient charges a buffer of n bytes that lives only while one node is
// planned or written: the build holds the largest of them at a time.
func (b *budget) transient(n uint64) error {
	b.peak = max(b.peak, n)
	return b.checkMem()
}

func (b *budget) checkMem() error {
	if need := b.held + transientFactor*b.peak; need > b.maxMem {
		return &BudgetError{Budget: BudgetBuildMemory, Limit: b.maxMem, Need: need}
	}
	return nil
}

// metadata checks that n bytes of metadata are within the budget.
func (b *budget) metadata(n uint64) error {
	if n > b.maxMeta {
		return &BudgetError{Budget: BudgetMetadata, Limit: b.maxMeta, Need: n}
	}
	return nil
}

// indexBytes estimates the memory idx occupies, which the build keeps
// referring to until it ends.
func indexBytes(idx *index.Index) uint64 {
	n := uint64(len(idx.Entries)) * uint64(unsafe.Sizeof(index.Entry{}))
	for i := range idx.Entries {
		e := &idx.Entries[i]
		n += uint64(len(e.Path) + len(e.Linkname) + len(e.Data.Path) + len(e.Data.Segments)*int(unsafe.Sizeof(index.Range{})))
		for _, x := range e.Xattrs {
			n += uint64(unsafe.Sizeof(x)) + uint64(len(x.Name)+len(x.Value))
		}
	}
	return n
}
