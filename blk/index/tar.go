package index

import (
	"archive/tar"
	"context"
	"maps"

	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// Tar whiteout conventions of the OCI image spec.
const (
	whPrefix = ".wh."
	whOpaque = ".wh..wh..opq"
	whMeta   = ".wh..wh." // other AUFS metadata names, ignored
)

// linode is one inode of a tar layer; hard links share it.
type linode struct {
	e     Entry
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

// readTarLayer indexes one uncompressed layer tar read from r (which must
// seek, so file data offsets can be recorded and skipped cheaply) into a
// per-layer index whose regular files point into src at their tar offset.
// Whiteouts (.wh.NAME) and opaque markers (.wh..wh..opq) become the overlay
// representation that FromLayers also reads; hostile entries are rejected
// with an error naming the entry and layer.
func readTarLayer(ctx context.Context, r io.ReadSeeker, src Source, max int, layer string) (*Index, error) {
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
	entries []Entry
}

func readTar(ctx context.Context, r io.ReadSeeker, src Source, max int) (*Index, error) {
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
			return nil, fmt.Errorf("read tar header after %d entries (last %q): %w", n, Trunc(last), err)
		}
		last = hdr.Name
		off, err := r.Seek(0, io.SeekCurrent)
		if err != nil {
			return nil, fmt.Errorf("tar entry %q: %w", Trunc(hdr.Name), err)
		}
		if err := t.add(hdr, off); err != nil {
			return nil, fmt.Errorf("tar entry %q: %w", Trunc(hdr.Name), err)
		}
	}
	t.entries = make([]Entry, 0, t.count+1)
	seen := map[*linode]string{}
	if err := t.flatten(".", t.root, seen); err != nil {
		return nil, err
	}
	return &Index{Sources: []Source{src}, Entries: t.entries}, nil
}

// tarPath validates a tar name and returns it as a clean index path ("."
// for the root). Absolute names and ".." components are rejected rather
// than cleaned, since they only appear in archives built to escape.
func tarPath(name string) (string, error) {
	if strings.HasPrefix(name, "/") {
		return "", Invalidf("absolute path")
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", Invalidf("NUL byte in name")
	}
	parts := strings.Split(name, "/")
	out := parts[:0]
	for _, c := range parts {
		switch c {
		case "", ".":
			continue
		case "..":
			return "", Invalidf("\"..\" component")
		}
		if len(c) > MaxNameLen {
			return "", Invalidf("name component of %d bytes exceeds %d", len(c), MaxNameLen)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return ".", nil
	}
	p := strings.Join(out, "/")
	if len(p) > MaxPathLen {
		return "", Invalidf("path of %d bytes exceeds %d", len(p), MaxPathLen)
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
		walked = JoinPath(walked, c)
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
			return nil, Invalidf("parent %q is not a directory in this layer", Trunc(walked))
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
		return Invalidf("more than %d entries", t.max)
	}
	return nil
}

func tarTime(t time.Time, def Timespec) Timespec {
	if t.IsZero() {
		return def
	}
	return Timespec{Sec: t.Unix(), Nsec: uint32(t.Nanosecond())}
}

func (t *tarReader) add(hdr *tar.Header, off int64) error {
	p, err := tarPath(hdr.Name)
	if err != nil {
		return err
	}
	base := BaseName(p)
	if p != "." && strings.HasPrefix(base, whPrefix) {
		return t.whiteout(p, base)
	}
	var e Entry
	switch hdr.Typeflag {
	case tar.TypeReg:
		e.Type = TypeRegular
	case tar.TypeDir:
		e.Type = TypeDir
	case tar.TypeSymlink:
		e.Type = TypeSymlink
	case tar.TypeLink:
		e.Type = TypeHardlink
	case tar.TypeChar:
		e.Type = TypeChar
	case tar.TypeBlock:
		e.Type = TypeBlock
	case tar.TypeFifo:
		e.Type = TypeFifo
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeGNUSparse:
		return Invalidf("sparse tar entries are not supported")
	default:
		return Invalidf("unsupported tar entry type %q", hdr.Typeflag)
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return Invalidf("sparse tar entries are not supported")
		}
	}
	if hdr.Size < 0 {
		return Invalidf("negative size %d", hdr.Size)
	}
	if hdr.Uid < 0 || int64(hdr.Uid) > math.MaxUint32 || hdr.Gid < 0 || int64(hdr.Gid) > math.MaxUint32 {
		return Invalidf("uid/gid %d/%d out of range", hdr.Uid, hdr.Gid)
	}
	e.Mode = uint32(hdr.Mode & 07777)
	e.UID, e.GID = uint32(hdr.Uid), uint32(hdr.Gid)
	e.Mtime = tarTime(hdr.ModTime, Timespec{})
	e.Atime = tarTime(hdr.AccessTime, e.Mtime)
	e.Ctime = tarTime(hdr.ChangeTime, e.Mtime)
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || strings.HasPrefix(name, XattrOverlayPrefix) {
			continue
		}
		if name == "" || len(name) > MaxXattrNameLen || len(v) > MaxXattrSize {
			return Invalidf("xattr %q: bad name or value of %d bytes", Trunc(name), len(v))
		}
		e.Xattrs = append(e.Xattrs, Xattr{Name: name, Value: []byte(v)})
	}
	slices.SortFunc(e.Xattrs, func(a, b Xattr) int { return strings.Compare(a.Name, b.Name) })
	switch e.Type {
	case TypeRegular:
		e.Size = hdr.Size
		e.Data = Data{Offset: off}
		if off < 0 || off > maxInt64-hdr.Size {
			return Invalidf("data offset out of range")
		}
	case TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) > MaxSymlinkLen || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return Invalidf("symlink target of %d bytes (max %d)", len(hdr.Linkname), MaxSymlinkLen)
		}
		e.Linkname = hdr.Linkname
	case TypeChar, TypeBlock:
		if hdr.Devmajor < 0 || hdr.Devminor < 0 {
			return Invalidf("negative device number %d:%d", hdr.Devmajor, hdr.Devminor)
		}
		if err := CheckDev(uint64(hdr.Devmajor), uint64(hdr.Devminor)); err != nil {
			return err
		}
		e.Devmajor, e.Devminor = uint32(hdr.Devmajor), uint32(hdr.Devminor)
	}
	if p == "." {
		if e.Type != TypeDir {
			return Invalidf("root entry is a %s", e.Type)
		}
		t.root.ino = &linode{e: e}
		return nil
	}
	parent, err := t.dir(ParentPath(p))
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
		if e.Type == TypeDir && old.isDir {
			// A directory entry over a directory of the same layer keeps its
			// contents, as extraction would.
			n.kids, n.opaque = old.kids, old.opaque
		}
	}
	switch e.Type {
	case TypeDir:
		n.isDir = true
		n.ino = &linode{e: e}
	case TypeHardlink:
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
func (t *tarReader) link(n *lnode, target string, e Entry) error {
	tp, err := tarPath(target)
	if err != nil {
		return fmt.Errorf("hard link target %q outside the tree: %w", Trunc(target), err)
	}
	if tp == "." {
		return Invalidf("hard link to the root directory")
	}
	k := t.root
	for rest := tp; rest != "" && k != nil; {
		var c string
		c, rest, _ = strings.Cut(rest, "/")
		if !k.isDir {
			return Invalidf("hard link target %q: %q is not a directory", Trunc(target), c)
		}
		k = k.kids[c]
	}
	switch {
	case k == nil && t.pathWhitedOut(tp):
		return Invalidf("hard link target %q is removed by a whiteout in this layer", Trunc(target))
	case k == nil:
		n.lowerLink = tp
	case k.isDir:
		return Invalidf("hard link target %q is a directory", Trunc(target))
	case k.lowerLink != "":
		n.lowerLink = k.lowerLink
	case k.ino == nil:
		return Invalidf("hard link target %q is removed by a whiteout in this layer", Trunc(target))
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
	dir := ParentPath(p)
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
		return Invalidf("whiteout of %q", name)
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
	var e Entry
	switch {
	case n.isDir && n.ino != nil:
		e = n.ino.e
		if n.whiteout || n.opaque {
			e.Xattrs = withXattr(e.Xattrs, XattrOpaque, "y")
		}
	case n.isDir && n.whiteout:
		// Lower entry removed, then implied as a parent: a fresh directory.
		e = ImpliedDir()
		e.Xattrs = withXattr(nil, XattrOpaque, "y")
	case n.isDir:
		e = ImpliedDir()
		e.Xattrs = withXattr(nil, XattrImplicit, "y")
		if n.opaque {
			e.Xattrs = withXattr(e.Xattrs, XattrOpaque, "y")
		}
	case n.lowerLink != "":
		e = Entry{Type: TypeHardlink, Linkname: n.lowerLink, Xattrs: withXattr(nil, XattrLowerLink, "y")}
	case n.ino == nil:
		e = Entry{Type: TypeChar} // whiteout
	default:
		if first, ok := seen[n.ino]; ok {
			l := n.ino.e
			e = Entry{Type: TypeHardlink, Linkname: first, Mode: l.Mode, UID: l.UID, GID: l.GID,
				Atime: l.Atime, Mtime: l.Mtime, Ctime: l.Ctime, Size: l.Size, Xattrs: l.Xattrs}
		} else {
			e = n.ino.e
			if n.ino.links > 0 {
				seen[n.ino] = p
			}
		}
		if e.Type == TypeHardlink && e.Linkname == "" {
			return Invalidf("hard link %q without target", Trunc(p))
		}
	}
	e.Path = p
	t.entries = append(t.entries, e)
	if !n.isDir || len(n.kids) == 0 {
		return nil
	}
	for _, k := range slices.Sorted(maps.Keys(n.kids)) {
		if err := t.flatten(JoinPath(p, k), n.kids[k], seen); err != nil {
			return err
		}
	}
	return nil
}

// withXattr returns xs plus name=value, sorted, without modifying xs.
func withXattr(xs []Xattr, name, value string) []Xattr {
	out := make([]Xattr, 0, len(xs)+1)
	out = append(out, xs...)
	i, found := slices.BinarySearchFunc(out, name, func(x Xattr, n string) int { return strings.Compare(x.Name, n) })
	if found {
		out[i].Value = []byte(value)
		return out
	}
	return slices.Insert(out, i, Xattr{Name: name, Value: []byte(value)})
}
