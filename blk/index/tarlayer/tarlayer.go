package tarlayer

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Tar whiteout conventions of the OCI image spec.
const (
	whPrefix = ".wh."
	whOpaque = ".wh..wh..opq"
	whMeta   = ".wh..wh." // other AUFS metadata names, ignored
)

// linode is one inode of a tar layer; hard links share it.
type linode struct {
	e     index.Entry
	links int
}

// lnode is one name of a tar layer while it is read.
type lnode struct {
	ino       *linode // nil for an implicit directory or a bare whiteout
	isDir     bool
	whiteout  bool   // lower entries at this name are removed
	opaque    bool   // lower contents of this directory are hidden
	lowerLink string // hard link to this path in a lower layer
	kids      map[string]*lnode
}

// Read indexes one uncompressed layer tar read from r (which must seek, so
// file data offsets can be recorded and skipped cheaply) into a per-layer
// index whose regular files point into src at their tar offset. Whiteouts
// (.wh.NAME) and opaque markers (.wh..wh..opq) become the overlay
// representation that a host layer directory has too; hostile entries are
// rejected with an error naming the entry and layer. max bounds the entries.
func Read(ctx context.Context, r io.ReadSeeker, src index.Source, max int, layer string) (*index.Index, error) {
	ix, err := readTar(ctx, r, src, max)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", layer, err)
	}
	return ix, nil
}

type tarReader struct {
	root    *lnode
	count   int
	max     int
	nlinks  int
	entries []index.Entry
}

func readTar(ctx context.Context, r io.ReadSeeker, src index.Source, max int) (*index.Index, error) {
	t := &tarReader{root: &lnode{isDir: true}, max: max}
	tr := tar.NewReader(r)
	last := ""
	for n := 0; ; n++ {
		if n&1023 == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			// archive/tar does not say which field was bad (a negative size,
			// a broken checksum): point at where it happened instead.
			return nil, fmt.Errorf("read tar header after %d entries (last %q): %w", n, index.Trunc(last), err)
		}
		last = hdr.Name
		off, err := r.Seek(0, io.SeekCurrent)
		if err != nil {
			return nil, fmt.Errorf("tar entry %q: %w", index.Trunc(hdr.Name), err)
		}
		if err := t.add(hdr, off); err != nil {
			return nil, fmt.Errorf("tar entry %q: %w", index.Trunc(hdr.Name), err)
		}
	}
	t.entries = make([]index.Entry, 0, t.count+1)
	seen := map[*linode]string{}
	if err := t.flatten(".", t.root, seen); err != nil {
		return nil, err
	}
	return &index.Index{Sources: []index.Source{src}, Entries: t.entries}, nil
}

// MemberPath validates a tar member name and returns it as a clean index
// path ("." for the root). Absolute names and ".." components are rejected
// rather than cleaned, since they only appear in archives built to escape.
func MemberPath(name string) (string, error) {
	if strings.HasPrefix(name, "/") {
		return "", index.Invalidf("absolute path")
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", index.Invalidf("NUL byte in name")
	}
	parts := strings.Split(name, "/")
	out := parts[:0]
	for _, c := range parts {
		switch c {
		case "", ".":
			continue
		case "..":
			return "", index.Invalidf("\"..\" component")
		}
		if len(c) > index.MaxNameLen {
			return "", index.Invalidf("name component of %d bytes exceeds %d", len(c), index.MaxNameLen)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return ".", nil
	}
	p := strings.Join(out, "/")
	if len(p) > index.MaxPathLen {
		return "", index.Invalidf("path of %d bytes exceeds %d", len(p), index.MaxPathLen)
	}
	return p, nil
}

// dir returns the directory node at p, creating implicit directories; a
// non-directory on the way is an error (nothing is ever resolved through a
// symlink: an image symlink is just an entry).
func (t *tarReader) dir(p string) (*lnode, error) {
	n := t.root
	if p == "." {
		return n, nil
	}
	walked := "."
	for rest := p; rest != ""; {
		var c string
		c, rest, _ = strings.Cut(rest, "/")
		walked = index.JoinPath(walked, c)
		k := n.kids[c]
		switch {
		case k == nil:
			if err := t.grow(); err != nil {
				return nil, err
			}
			k = &lnode{isDir: true}
			if n.kids == nil {
				n.kids = map[string]*lnode{}
			}
			n.kids[c] = k
		case !k.isDir && (k.ino != nil || k.lowerLink != ""):
			return nil, index.Invalidf("parent %q is not a directory in this layer", index.Trunc(walked))
		case !k.isDir:
			k.isDir = true // a bare whiteout that now has children
		}
		n = k
	}
	return n, nil
}

func (t *tarReader) grow() error {
	t.count++
	if t.count > t.max {
		return index.Invalidf("more than %d entries: over the entries budget (kata_fsx.imagefs_blk.max_entries)", t.max)
	}
	return nil
}

func tarTime(t time.Time, def index.Timespec) index.Timespec {
	if t.IsZero() {
		return def
	}
	return index.Timespec{Sec: t.Unix(), Nsec: uint32(t.Nanosecond())}
}

func (t *tarReader) add(hdr *tar.Header, off int64) error {
	p, err := MemberPath(hdr.Name)
	if err != nil {
		return err
	}
	base := index.BaseName(p)
	if p != "." && strings.HasPrefix(base, whPrefix) {
		return t.whiteout(p, base)
	}
	var e index.Entry
	switch hdr.Typeflag {
	case tar.TypeReg:
		e.Type = index.TypeRegular
	case tar.TypeDir:
		e.Type = index.TypeDir
	case tar.TypeSymlink:
		e.Type = index.TypeSymlink
	case tar.TypeLink:
		e.Type = index.TypeHardlink
	case tar.TypeChar:
		e.Type = index.TypeChar
	case tar.TypeBlock:
		e.Type = index.TypeBlock
	case tar.TypeFifo:
		e.Type = index.TypeFifo
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeGNUSparse:
		return index.Invalidf("sparse tar entries are not supported")
	default:
		return index.Invalidf("unsupported tar entry type %q", hdr.Typeflag)
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return index.Invalidf("sparse tar entries are not supported")
		}
	}
	if hdr.Size < 0 {
		return index.Invalidf("negative size %d", hdr.Size)
	}
	if hdr.Uid < 0 || int64(hdr.Uid) > math.MaxUint32 || hdr.Gid < 0 || int64(hdr.Gid) > math.MaxUint32 {
		return index.Invalidf("uid/gid %d/%d out of range", hdr.Uid, hdr.Gid)
	}
	e.Mode = uint32(hdr.Mode & 07777)
	e.UID, e.GID = uint32(hdr.Uid), uint32(hdr.Gid)
	e.Mtime = tarTime(hdr.ModTime, index.Timespec{})
	e.Atime = tarTime(hdr.AccessTime, e.Mtime)
	e.Ctime = tarTime(hdr.ChangeTime, e.Mtime)
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || strings.HasPrefix(name, index.XattrOverlayPrefix) {
			continue
		}
		if name == "" || len(name) > index.MaxXattrNameLen || len(v) > index.MaxXattrSize {
			return index.Invalidf("xattr %q: bad name or value of %d bytes", index.Trunc(name), len(v))
		}
		e.Xattrs = append(e.Xattrs, index.Xattr{Name: name, Value: []byte(v)})
	}
	slices.SortFunc(e.Xattrs, func(a, b index.Xattr) int { return strings.Compare(a.Name, b.Name) })
	switch e.Type {
	case index.TypeRegular:
		e.Size = hdr.Size
		e.Data = index.Data{Offset: off}
		if off < 0 || off > math.MaxInt64-hdr.Size {
			return index.Invalidf("data offset out of range")
		}
	case index.TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) > index.MaxSymlinkLen || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return index.Invalidf("symlink target of %d bytes (max %d)", len(hdr.Linkname), index.MaxSymlinkLen)
		}
		e.Linkname = hdr.Linkname
	case index.TypeChar, index.TypeBlock:
		if hdr.Devmajor < 0 || hdr.Devminor < 0 {
			return index.Invalidf("negative device number %d:%d", hdr.Devmajor, hdr.Devminor)
		}
		if err := index.CheckDev(uint64(hdr.Devmajor), uint64(hdr.Devminor)); err != nil {
			return err
		}
		e.Devmajor, e.Devminor = uint32(hdr.Devmajor), uint32(hdr.Devminor)
	}
	if p == "." {
		if e.Type != index.TypeDir {
			return index.Invalidf("root entry is a %s", e.Type)
		}
		t.root.ino = &linode{e: e}
		return nil
	}
	parent, err := t.dir(index.ParentPath(p))
	if err != nil {
		return err
	}
	old := parent.kids[base]
	if old == nil {
		if err := t.grow(); err != nil {
			return err
		}
		if parent.kids == nil {
			parent.kids = map[string]*lnode{}
		}
	}
	n := &lnode{}
	if old != nil {
		n.whiteout = old.whiteout
		if e.Type == index.TypeDir && old.isDir {
			// A directory entry over a directory of the same layer keeps its
			// contents, as extraction would.
			n.kids, n.opaque = old.kids, old.opaque
		}
	}
	switch e.Type {
	case index.TypeDir:
		n.isDir = true
		n.ino = &linode{e: e}
	case index.TypeHardlink:
		if err := t.link(n, hdr.Linkname, e); err != nil {
			return err
		}
	default:
		n.ino = &linode{e: e}
	}
	parent.kids[base] = n
	return nil
}

// link resolves a hard link when it is read: to an inode of this layer when
// the target name exists here, otherwise to the target in a lower layer
// (checked when the layers are merged).
func (t *tarReader) link(n *lnode, target string, e index.Entry) error {
	tp, err := MemberPath(target)
	if err != nil {
		return fmt.Errorf("hard link target %q outside the tree: %w", index.Trunc(target), err)
	}
	if tp == "." {
		return index.Invalidf("hard link to the root directory")
	}
	k := t.root
	for rest := tp; rest != "" && k != nil; {
		var c string
		c, rest, _ = strings.Cut(rest, "/")
		if !k.isDir {
			return index.Invalidf("hard link target %q: %q is not a directory", index.Trunc(target), c)
		}
		k = k.kids[c]
	}
	switch {
	case k == nil && t.pathWhitedOut(tp):
		return index.Invalidf("hard link target %q is removed by a whiteout in this layer", index.Trunc(target))
	case k == nil:
		n.lowerLink = tp
	case k.isDir:
		return index.Invalidf("hard link target %q is a directory", index.Trunc(target))
	case k.lowerLink != "":
		n.lowerLink = k.lowerLink
	case k.ino == nil:
		return index.Invalidf("hard link target %q is removed by a whiteout in this layer", index.Trunc(target))
	default:
		k.ino.links++
		t.nlinks++
		n.ino = k.ino
	}
	if n.lowerLink != "" {
		// Keep the link's own metadata fields empty: the merge takes the
		// target's.
		n.ino = nil
	}
	return nil
}

// pathWhitedOut reports whether a prefix of p is a bare whiteout or an
// opaque directory of this layer, so that p cannot name a lower entry.
func (t *tarReader) pathWhitedOut(p string) bool {
	k := t.root
	if k.opaque {
		return true
	}
	for rest := p; rest != ""; {
		var c string
		c, rest, _ = strings.Cut(rest, "/")
		k = k.kids[c]
		if k == nil {
			return false
		}
		if k.whiteout && k.ino == nil || k.opaque || !k.isDir && rest != "" {
			return true
		}
	}
	return false
}

func (t *tarReader) whiteout(p, base string) error {
	dir := index.ParentPath(p)
	if base == whOpaque {
		d, err := t.dir(dir)
		if err != nil {
			return err
		}
		d.opaque = true
		return nil
	}
	if strings.HasPrefix(base, whMeta) {
		return nil
	}
	name := base[len(whPrefix):]
	if name == "" || name == "." || name == ".." {
		return index.Invalidf("whiteout of %q", name)
	}
	parent, err := t.dir(dir)
	if err != nil {
		return err
	}
	if parent.kids == nil {
		parent.kids = map[string]*lnode{}
	}
	n := parent.kids[name]
	if n == nil {
		if err := t.grow(); err != nil {
			return err
		}
		n = &lnode{}
		parent.kids[name] = n
	}
	// A whiteout only hides lower layers; an entry of this layer at the same
	// name stays (and, if a directory, becomes opaque).
	n.whiteout = true
	return nil
}

// flatten emits the layer tree in Index order as a per-layer index.
func (t *tarReader) flatten(p string, n *lnode, seen map[*linode]string) error {
	var e index.Entry
	switch {
	case n.isDir && n.ino != nil:
		e = n.ino.e
		if n.whiteout || n.opaque {
			e.Xattrs = withXattr(e.Xattrs, index.XattrOpaque, "y")
		}
	case n.isDir && n.whiteout:
		// Lower entry removed, then implied as a parent: a fresh directory.
		e = index.ImpliedDir()
		e.Xattrs = withXattr(nil, index.XattrOpaque, "y")
	case n.isDir:
		e = index.ImpliedDir()
		e.Xattrs = withXattr(nil, index.XattrImplicit, "y")
		if n.opaque {
			e.Xattrs = withXattr(e.Xattrs, index.XattrOpaque, "y")
		}
	case n.lowerLink != "":
		e = index.Entry{Type: index.TypeHardlink, Linkname: n.lowerLink, Xattrs: withXattr(nil, index.XattrLowerLink, "y")}
	case n.ino == nil:
		e = index.Entry{Type: index.TypeChar} // whiteout
	default:
		if first, ok := seen[n.ino]; ok {
			l := n.ino.e
			e = index.Entry{Type: index.TypeHardlink, Linkname: first, Mode: l.Mode, UID: l.UID, GID: l.GID,
				Atime: l.Atime, Mtime: l.Mtime, Ctime: l.Ctime, Size: l.Size, Xattrs: l.Xattrs}
		} else {
			e = n.ino.e
			if n.ino.links > 0 {
				seen[n.ino] = p
			}
		}
		if e.Type == index.TypeHardlink && e.Linkname == "" {
			return index.Invalidf("hard link %q without target", index.Trunc(p))
		}
	}
	e.Path = p
	t.entries = append(t.entries, e)
	if !n.isDir || len(n.kids) == 0 {
		return nil
	}
	for _, k := range slices.Sorted(maps.Keys(n.kids)) {
		if err := t.flatten(index.JoinPath(p, k), n.kids[k], seen); err != nil {
			return err
		}
	}
	return nil
}

// withXattr returns xs plus name=value, sorted, without modifying xs.
func withXattr(xs []index.Xattr, name, value string) []index.Xattr {
	out := make([]index.Xattr, 0, len(xs)+1)
	out = append(out, xs...)
	i, found := slices.BinarySearchFunc(out, name, func(x index.Xattr, n string) int { return strings.Compare(x.Name, n) })
	if found {
		out[i].Value = []byte(value)
		return out
	}
	return slices.Insert(out, i, index.Xattr{Name: name, Value: []byte(value)})
}
