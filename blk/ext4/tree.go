package ext4

import (
	"context"
	"fmt"
	"math"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/ext4/disklayout"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// tree is the index as inodes: what scan and assignInodes produce.
type tree struct {
	nodes   []node
	byPath  map[string]int32 // index path to node, -1 for a hard link
	lpf     int32            // lost+found node Build adds, or -1 if the index brings its own
	journal int32            // journal node, or -1
	counts  map[string]int   // index entries by type, for the manifest
	maxIno  uint32           // highest inode number in use
}

// node is one inode.
type node struct {
	ent     *index.Entry // nil for inodes Build creates itself
	path    string
	ino     uint32
	typ     index.Type
	nlink   uint32
	parent  int32 // -1 for the root and the journal
	kids    []child
	subdirs uint32
}

// child is one name in a directory.
type child struct {
	name string
	node int32
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

// scan validates the index's entries and builds the node table and the
// directory tree, adding lost+found and the journal when needed.
func scan(ctx context.Context, idx *index.Index, bs uint64, withJournal bool) (*tree, error) {
	ents := idx.Entries
	if len(ents) == 0 || ents[0].Path != "." || ents[0].Type != index.TypeDir {
		return nil, fmt.Errorf("%w: first entry must be the root directory \".\"", ErrInvalidIndex)
	}
	t := &tree{byPath: make(map[string]int32, len(ents)), nodes: make([]node, 0, len(ents)+3),
		lpf: -1, journal: -1, counts: make(map[string]int)}
	type link struct {
		parent int32
		name   string
		e      *index.Entry
	}
	var links []link
	for i := range ents {
		if err := cancelled(ctx, i); err != nil {
			return nil, err
		}
		e := &ents[i]
		if _, dup := t.byPath[e.Path]; dup {
			return nil, pathErr(e.Path, "duplicate path")
		}
		if e.Mode&^0o7777 != 0 {
			return nil, pathErr(e.Path, "mode %#o has bits beyond 07777", e.Mode)
		}
		parent := int32(-1)
		var name string
		if i > 0 {
			pp, nm, ok := splitPath(e.Path)
			if !ok {
				return nil, pathErr(e.Path, "not a clean relative path with names of at most 255 bytes")
			}
			pi, found := t.byPath[pp]
			if !found {
				return nil, pathErr(e.Path, "parent directory %q is missing (or listed after it)", pp)
			}
			if pi < 0 {
				return nil, pathErr(e.Path, "parent %q is a hard link, not a directory", pp)
			}
			if t.nodes[pi].typ != index.TypeDir {
				return nil, pathErr(e.Path, "parent %q is a %v, not a directory", pp, t.nodes[pi].typ)
			}
			parent, name = pi, nm
		}
		switch e.Type {
		case index.TypeHardlink:
			if e.Linkname == "" {
				return nil, pathErr(e.Path, "hard link without a target")
			}
			links = append(links, link{parent, name, e})
			t.byPath[e.Path] = -1 // taken, not an inode
			t.counts[e.Type.String()]++
			continue
		case index.TypeRegular:
			if err := checkData(idx, e, bs); err != nil {
				return nil, err
			}
		case index.TypeSymlink:
			if e.Linkname == "" || len(e.Linkname) > maxSymlinkLen || strings.IndexByte(e.Linkname, 0) >= 0 {
				return nil, pathErr(e.Path, "symlink target is empty, longer than %d bytes or contains NUL", maxSymlinkLen)
			}
		case index.TypeDir, index.TypeChar, index.TypeBlock, index.TypeFifo, index.TypeSocket:
		default:
			return nil, pathErr(e.Path, "unknown entry type %v", e.Type)
		}
		if e.Ino != 0 && (i == 0 && e.Ino != disklayout.RootIno || i > 0 && (e.Ino < disklayout.FirstIno || e.Ino > maxIno)) {
			return nil, pathErr(e.Path, "inode number %d is reserved or out of range", e.Ino)
		}
		ni := int32(len(t.nodes))
		t.nodes = append(t.nodes, node{ent: e, path: e.Path, typ: e.Type, nlink: 1, parent: parent})
		t.byPath[e.Path] = ni
		t.counts[e.Type.String()]++
		if parent >= 0 {
			t.addChild(parent, name, ni)
		}
	}
	for _, l := range links {
		ti, ok := t.byPath[l.e.Linkname]
		if !ok {
			return nil, pathErr(l.e.Path, "hard link target %q is not in the index", l.e.Linkname)
		}
		if ti < 0 {
			return nil, pathErr(l.e.Path, "hard link target %q is itself a hard link", l.e.Linkname)
		}
		n := &t.nodes[ti]
		if n.typ == index.TypeDir {
			return nil, pathErr(l.e.Path, "hard link to directory %q", l.e.Linkname)
		}
		if n.nlink >= disklayout.LinkMax {
			return nil, pathErr(l.e.Path, "more than %d links to %q", disklayout.LinkMax, l.e.Linkname)
		}
		n.nlink++
		t.addChild(l.parent, l.name, ti)
	}
	if _, ok := t.byPath["lost+found"]; !ok {
		t.lpf = int32(len(t.nodes))
		t.nodes = append(t.nodes, node{path: "lost+found", typ: index.TypeDir, nlink: 1, parent: 0})
		t.addChild(0, "lost+found", t.lpf)
	}
	if withJournal {
		t.journal = int32(len(t.nodes))
		t.nodes = append(t.nodes, node{path: "<journal>", typ: index.TypeRegular, nlink: 1, parent: -1, ino: disklayout.JournalIno})
	}
	for i := range t.nodes {
		n := &t.nodes[i]
		if n.typ == index.TypeDir {
			n.nlink = 2 + n.subdirs
			if n.nlink > disklayout.LinkMax {
				n.nlink = 1 // dir_nlink: the count no longer fits
			}
		}
	}
	return t, nil
}

func (t *tree) addChild(parent int32, name string, ni int32) {
	p := &t.nodes[parent]
	p.kids = append(p.kids, child{name, ni})
	if t.nodes[ni].typ == index.TypeDir {
		p.subdirs++
	}
}

// checkData validates a regular file's size, source and segments.
func checkData(idx *index.Index, e *index.Entry, bs uint64) error {
	if e.Size < 0 {
		return pathErr(e.Path, "negative size %d", e.Size)
	}
	if uint64(e.Size) > maxFileBlocks*bs {
		return pathErr(e.Path, "size %d exceeds ext4's 16 TiB file limit", e.Size)
	}
	if e.Size > 0 && (e.Data.Segments == nil || len(e.Data.Segments) > 0) {
		if int(e.Data.Source) >= len(idx.Sources) {
			return pathErr(e.Path, "source %d not in the index's %d sources", e.Data.Source, len(idx.Sources))
		}
		if idx.Sources[e.Data.Source].Kind == index.SourceDir && e.Data.Path == "" {
			return pathErr(e.Path, "directory source without a file path")
		}
		if e.Data.Offset < 0 || e.Data.Offset > math.MaxInt64-e.Size {
			return pathErr(e.Path, "data offset %d out of range", e.Data.Offset)
		}
	}
	var end int64
	for i, s := range e.Data.Segments {
		if s.Off < end || s.Len <= 0 || s.Off > e.Size || s.Len > e.Size-s.Off {
			return pathErr(e.Path, "data segment %d [%d,+%d) unsorted, empty, overlapping or beyond size %d", i, s.Off, s.Len, e.Size)
		}
		end = s.Off + s.Len
	}
	return nil
}

// assignInodes honours explicit inode numbers, gives lost+found 11 as mkfs
// does, and numbers the rest from 12 in index order.
func (t *tree) assignInodes() error {
	taken := make(map[uint32]int32)
	t.nodes[0].ino = disklayout.RootIno
	taken[disklayout.RootIno] = 0
	if t.journal >= 0 {
		taken[disklayout.JournalIno] = t.journal
	}
	for i := 1; i < len(t.nodes); i++ {
		n := &t.nodes[i]
		if n.ent == nil || n.ent.Ino == 0 {
			continue
		}
		if o, dup := taken[n.ent.Ino]; dup {
			return pathErr(n.path, "inode number %d also given to %q", n.ent.Ino, t.nodes[o].path)
		}
		n.ino = n.ent.Ino
		taken[n.ino] = int32(i)
	}
	if lp, ok := t.byPath["lost+found"]; ok && lp >= 0 && t.nodes[lp].ino == 0 && t.nodes[lp].typ == index.TypeDir {
		if _, tk := taken[disklayout.FirstIno]; !tk {
			t.nodes[lp].ino = disklayout.FirstIno
			taken[disklayout.FirstIno] = lp
		}
	}
	if t.lpf >= 0 {
		if _, tk := taken[disklayout.FirstIno]; !tk {
			t.nodes[t.lpf].ino = disklayout.FirstIno
			taken[disklayout.FirstIno] = t.lpf
		}
	}
	next := uint32(disklayout.FirstFreeIno)
	maxUsed := uint32(disklayout.FirstIno)
	for i := range t.nodes {
		n := &t.nodes[i]
		if n.ino == 0 {
			for {
				if _, tk := taken[next]; !tk {
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
	t.maxIno = maxUsed
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
