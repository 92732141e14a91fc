// Package ext4 synthesizes the metadata of an ext4 filesystem from an image
// index: superblocks, group descriptors, bitmaps, inode tables, extent
// trees, directories (linear and htree), symlinks, xattrs and an empty
// journal. File data is not copied: data extents are recorded in a block
// map pointing back into the index's content sources.
//
// The feature set is mkfs.ext4's default (has_journal, ext_attr, dir_index,
// filetype, extent, 64bit, flex_bg, sparse_super, large_file, huge_file,
// dir_nlink, extra_isize, metadata_csum) without resize_inode. Not
// produced: 1 KiB blocks, large_dir (htrees deeper than two index levels),
// ea_inode (an inode's xattrs must fit in it plus one block), inline_data,
// casefold, encryption, project quotas.
//
// It is about 2,600 lines, over the project's usual package size, because
// the planner, the block allocator and the emitter work on one unexported
// plan of the filesystem that must agree byte for byte with what is
// written; the on-disk structures themselves are in disklayout.
package ext4

import (
	"crypto/sha256"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Defaults applied by Build to zero Options fields.
const (
	DefaultBlockSize    = 4096
	DefaultWritableSize = 1 << 30  // free space left for guest writes
	DefaultJournalSize  = 16 << 20 // capped by mkfs's rule for small filesystems
	bytesPerFreeInode   = 16384    // mkfs's inode_ratio, for the writable space
	minFreeInodes       = 1024
)

// Options tune Build. The zero value gives mkfs.ext4's feature set with a
// 16 MiB journal and 1 GiB of free space.
type Options struct {
	// BlockSize is 4096 (the default, used when 0) or 2048.
	BlockSize int
	// WritableSize is free space, in bytes, added after the image content
	// for guest writes; 0 means DefaultWritableSize, negative means none.
	WritableSize int64
	// JournalSize is the journal size in bytes; 0 means the default.
	JournalSize int64
	// NoJournal leaves out the journal (and the has_journal feature).
	NoJournal bool
	// FreeInodes is the number of unused inodes to provide beyond the
	// image's; 0 means one per 16 KiB of writable space.
	FreeInodes uint32
	// Time stamps the filesystem (creation, write and check times) and the
	// inodes Build creates itself (lost+found, journal).
	Time time.Time
	// UUID is the filesystem UUID; zero derives one from the index.
	UUID [16]byte
	// HashSeed is the htree hash seed; zero derives one from the index.
	HashSeed [16]byte
	// VolumeName is the filesystem label (at most 16 bytes).
	VolumeName string
	// TempDir is where the metadata file is made while it is written
	// (unlinked at once); empty means the system's temporary directory.
	// Put it on the file system of the image's directory so that WriteTo
	// copies within one file system.
	TempDir string
	// MaxMetadataBytes is the metadata budget: the most metadata bytes the
	// image may need; 0 means DefaultMaxMetadataBytes.
	MaxMetadataBytes int64
	// MaxBuildMemory is the build memory budget: the most bytes the build
	// may hold in memory by its own accounting (see budget); 0 means
	// DefaultMaxBuildMemory.
	MaxBuildMemory int64
}

// identity derives a stable 32-byte digest of the index so that the same
// input always yields the same UUID and hash seed.
func identity(idx *index.Index) [32]byte {
	h := sha256.New()
	var buf []byte
	for _, s := range idx.Sources {
		buf = append(buf[:0], byte(s.Kind))
		buf = append(buf, s.ID...)
		buf = append(buf, 0)
		h.Write(buf)
	}
	for i := range idx.Entries {
		e := &idx.Entries[i]
		buf = append(buf[:0], e.Path...)
		buf = append(buf, 0, byte(e.Type))
		buf = append(buf, e.Linkname...)
		buf = append(buf, 0)
		for _, v := range []uint64{uint64(e.Mode), uint64(e.UID), uint64(e.GID), uint64(e.Size),
			uint64(e.Mtime.Sec), uint64(e.Mtime.Nsec), uint64(e.Devmajor), uint64(e.Devminor)} {
			for k := 0; k < 8; k++ {
				buf = append(buf, byte(v>>(8*k)))
			}
		}
		h.Write(buf)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}
