// Package index describes a merged container image tree: every entry's
// metadata and, for regular files, where the bytes live. An Index is
// immutable once built; the ext4 synthesizer reads it and the block device
// resolves data extents through the Source table it carries.
//
// This package holds the model, its binary encoding and its validation,
// plus what every source shares: Options, the limits, the per-layer index
// form (layer.go) and the path and error helpers. The sources are packages
// of their own that import this one and never the reverse: hostfs (a host
// directory, and the Opener for what the sources produce), overlayfs
// (overlay layer stacks), tarlayer (one layer tar) and oci (OCI layouts and
// archives). A new source is a new package beside them.
package index

import (
	"fmt"
	"io"
)

// Type is the kind of a tree entry.
type Type uint8

// Entry types. The values are part of the encoded index format.
const (
	TypeRegular Type = iota + 1
	TypeDir
	TypeSymlink
	TypeHardlink // another name for the entry at Linkname (a non-directory)
	TypeChar
	TypeBlock
	TypeFifo
	TypeSocket
)

// String returns the type's name as used in errors and listings.
func (t Type) String() string {
	switch t {
	case TypeRegular:
		return "regular"
	case TypeDir:
		return "dir"
	case TypeSymlink:
		return "symlink"
	case TypeHardlink:
		return "hardlink"
	case TypeChar:
		return "char"
	case TypeBlock:
		return "block"
	case TypeFifo:
		return "fifo"
	case TypeSocket:
		return "socket"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Timespec is a timestamp with nanosecond precision, as ext4 stores it.
type Timespec struct {
	Sec  int64
	Nsec uint32
}

// Xattr is one extended attribute; an entry's xattrs are sorted by Name.
type Xattr struct {
	Name  string // full name with namespace prefix, e.g. "security.capability"
	Value []byte
}

// Range is a half-open byte range [Off, Off+Len) of a file.
type Range struct {
	Off int64
	Len int64
}

// SourceKind says how a Source's content is reached.
type SourceKind uint8

// Source kinds. The values are part of the encoded index format.
const (
	// SourceDir is a host directory (a plain tree or one overlay layer);
	// a file's Data.Path is relative to it.
	SourceDir SourceKind = iota + 1
	// SourceBlob is a content-addressed blob (an uncompressed layer tar
	// kept in the content cache, later a remote store); a file's bytes are
	// at Data.Offset in it.
	SourceBlob
)

// Source is one place file bytes come from. Its identity (Kind plus ID) is
// stable: a layer directory's path or a blob's digest. How it is opened is
// up to the reader of the index (see Opener), so that a later
// content-addressed store with remote tiers plugs in without changing the
// index or the block map.
type Source struct {
	Kind SourceKind
	ID   string // directory path for SourceDir, "sha256:<hex>" for SourceBlob
}

// Data says where a regular file's bytes live.
type Data struct {
	Source uint32 // index into Index.Sources
	Path   string // for SourceDir: path relative to the source root
	Offset int64  // for SourceBlob: offset of the file's byte 0 in the blob
	// Segments are the file's data ranges, sorted and non-overlapping; the
	// rest of [0, Size) is a hole. Nil means the whole file is data.
	Segments []Range
}

// Entry is one name in the tree.
type Entry struct {
	Path     string // clean, relative, slash-separated; "." is the root directory
	Type     Type
	Mode     uint32 // permission bits plus setuid, setgid and sticky (07777)
	UID, GID uint32
	Atime    Timespec
	Mtime    Timespec
	Ctime    Timespec
	Size     int64  // regular files: length in bytes
	Linkname string // symlink target, or hard link's target path in this index
	Devmajor uint32
	Devminor uint32
	Xattrs   []Xattr
	Data     Data // regular files only
	// Ino, when non-zero, is the inode number the synthesizer must give
	// this entry; zero lets it choose.
	Ino uint32
}

// Index is an immutable, path-sorted description of a merged image tree.
// Entries are sorted by Path in byte order with "." first, every parent
// directory precedes its children, and every TypeHardlink's Linkname names
// a non-directory, non-hardlink entry of the same index that precedes it.
//
// The exact order is ComparePaths: byte order in which '/' sorts below every
// other byte. That is a depth-first pre-order walk with each directory's
// children sorted by name in byte order, so a directory's whole subtree
// directly follows it ("a", "a/x", "a-b"), which plain string order of full
// paths does not guarantee ("a-b" < "a/x" because '-' < '/'). A
// TypeHardlink entry repeats its target's metadata (Mode, UID, GID, times,
// Size, Xattrs) but carries no Data; the synthesizer should use the target's.
type Index struct {
	Sources []Source
	Entries []Entry
}

// Opener gives random access to a source's content; the block device uses it
// to read data extents on demand. A returned reader that also implements
// io.Closer holds an open file and must be closed by the caller.
type Opener interface {
	// Open returns a reader for the file at path within src (SourceDir) or
	// for the blob itself (SourceBlob, path empty).
	Open(src Source, path string) (io.ReaderAt, error)
}
