package overlayfs

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// impliedDir is shared by every implied directory of a merge; emit copies it.
var impliedDir = index.ImpliedDir()

// mnode is one name of the tree being merged.
type mnode struct {
	e     *index.Entry // metadata (for a hard link: its target's)
	src   uint32       // layer of e, which is also e's Source in the result
	key   uint64       // identity shared by hard links; 0 for directories
	kids  map[string]*mnode
	isDir bool
}

// Merge applies per-layer indexes (each with exactly one Source) from
// lowest to highest and returns the merged index, with at most max
// entries; names label the layers in errors.
func Merge(ctx context.Context, layers []*index.Index, names []string, max int) (*index.Index, error) {
	if len(layers) == 0 {
		return nil, index.Invalidf("no layers")
	}
	root := &mnode{e: &impliedDir, isDir: true}
	linked := map[uint64]bool{}
	type frame struct {
		path string
		n    *mnode
	}
	stack := make([]frame, 0, 64)
	for li, l := range layers {
		if len(l.Sources) != 1 {
			return nil, fmt.Errorf("layer %s: %w", names[li], index.Invalidf("%d sources, want 1", len(l.Sources)))
		}
		// Hard links into lower layers resolve against the tree before this
		// layer changes it.
		lower := map[string]*mnode{}
		for i := range l.Entries {
			e := &l.Entries[i]
			if e.Type == index.TypeHardlink && index.HasXattr(e.Xattrs, index.XattrLowerLink) {
				t := lookupNode(root, e.Linkname)
				if t == nil || t.isDir {
					return nil, fmt.Errorf("layer %s: entry %q: %w", names[li], index.Trunc(e.Path), index.Invalidf("hard link target %q missing in lower layers or a directory", index.Trunc(e.Linkname)))
				}
				lower[e.Path] = t
			}
		}
		stack = stack[:0]
		for i := range l.Entries {
			if i&4095 == 0 {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
			}
			e := &l.Entries[i]
			if i == 0 {
				// The layer's root directory.
				if !index.HasXattr(e.Xattrs, index.XattrImplicit) {
					root.e, root.src = e, uint32(li)
				}
				if index.IsOpaque(e) {
					root.kids = nil
				}
				stack = append(stack, frame{".", root})
				continue
			}
			pp := index.ParentPath(e.Path)
			for len(stack) > 0 && stack[len(stack)-1].path != pp {
				stack = stack[:len(stack)-1]
			}
			if len(stack) == 0 {
				return nil, fmt.Errorf("layer %s: entry %q: %w", names[li], index.Trunc(e.Path), index.Invalidf("parent is not a directory of the layer"))
			}
			parent := stack[len(stack)-1].n
			name := index.BaseName(e.Path)
			old := parent.kids[name]
			if index.IsWhiteout(e) {
				delete(parent.kids, name)
				continue
			}
			if parent.kids == nil {
				parent.kids = map[string]*mnode{}
			}
			var n *mnode
			switch {
			case e.Type == index.TypeDir:
				implicit := index.HasXattr(e.Xattrs, index.XattrImplicit)
				switch {
				case old != nil && old.isDir:
					n = old
					if !implicit {
						n.e, n.src = e, uint32(li)
					}
					if index.IsOpaque(e) {
						n.kids = nil
					}
				case old != nil && implicit:
					return nil, fmt.Errorf("layer %s: entry %q: %w", names[li], index.Trunc(e.Path), index.Invalidf("parent of a layer entry is a %s in a lower layer, not a directory", old.e.Type))
				case implicit:
					n = &mnode{e: &impliedDir, isDir: true}
				default:
					n = &mnode{e: e, src: uint32(li), isDir: true}
				}
				stack = append(stack, frame{e.Path, n})
			case e.Type == index.TypeHardlink:
				t := lower[e.Path]
				if t == nil {
					t = lookupNode(root, e.Linkname)
				}
				if t == nil || t.isDir {
					return nil, fmt.Errorf("layer %s: entry %q: %w", names[li], index.Trunc(e.Path), index.Invalidf("hard link target %q missing or a directory", index.Trunc(e.Linkname)))
				}
				n = &mnode{e: t.e, src: t.src, key: t.key}
				linked[t.key] = true
			default:
				n = &mnode{e: e, src: uint32(li), key: uint64(li)<<32 | uint64(i)}
			}
			parent.kids[name] = n
		}
	}
	total := 0
	for _, l := range layers {
		total += len(l.Entries)
	}
	ix := &index.Index{Sources: make([]index.Source, len(layers)), Entries: make([]index.Entry, 0, min(total, max))}
	for i, l := range layers {
		ix.Sources[i] = l.Sources[0]
	}
	o := emitter{ix: ix, linked: linked, leaders: map[uint64]int{}, max: max}
	if err := o.emit(".", root); err != nil {
		return nil, err
	}
	return ix, nil
}

func lookupNode(root *mnode, p string) *mnode {
	n := root
	for p != "" {
		var c string
		c, p, _ = strings.Cut(p, "/")
		if !n.isDir {
			return nil
		}
		n = n.kids[c]
		if n == nil {
			return nil
		}
	}
	return n
}

type emitter struct {
	ix      *index.Index
	linked  map[uint64]bool
	leaders map[uint64]int // hard link group -> entry that carries it
	max     int
}

// emit appends n and its subtree in Index order.
func (o *emitter) emit(p string, n *mnode) error {
	if len(o.ix.Entries) >= o.max {
		return index.Invalidf("merged tree has more than %d entries (at %q): over the entries budget (kata_fsx.imagefs_blk.max_entries)", o.max, index.Trunc(p))
	}
	e := *n.e
	e.Path = p
	e.Xattrs = stripOverlay(e.Xattrs)
	if e.Type == index.TypeRegular {
		e.Data.Source = n.src
	}
	if n.key != 0 && o.linked[n.key] {
		if li, ok := o.leaders[n.key]; ok {
			t := &o.ix.Entries[li]
			e = index.Entry{Path: p, Type: index.TypeHardlink, Linkname: t.Path, Mode: t.Mode, UID: t.UID, GID: t.GID,
				Atime: t.Atime, Mtime: t.Mtime, Ctime: t.Ctime, Size: t.Size, Xattrs: t.Xattrs}
		} else {
			o.leaders[n.key] = len(o.ix.Entries)
		}
	}
	o.ix.Entries = append(o.ix.Entries, e)
	if !n.isDir || len(n.kids) == 0 {
		return nil
	}
	for _, k := range slices.Sorted(maps.Keys(n.kids)) {
		if err := o.emit(index.JoinPath(p, k), n.kids[k]); err != nil {
			return err
		}
	}
	return nil
}

// stripOverlay drops overlay xattrs, copying only when there are some.
func stripOverlay(xs []index.Xattr) []index.Xattr {
	k := 0
	for _, x := range xs {
		if strings.HasPrefix(x.Name, index.XattrOverlayPrefix) {
			k++
		}
	}
	if k == 0 {
		return xs
	}
	if k == len(xs) {
		return nil
	}
	out := make([]index.Xattr, 0, len(xs)-k)
	for _, x := range xs {
		if !strings.HasPrefix(x.Name, index.XattrOverlayPrefix) {
			out = append(out, x)
		}
	}
	return out
}
