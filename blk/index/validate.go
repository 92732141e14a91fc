package index

import (
	"errors"
	"fmt"
	"strings"
)

// Limits of what an index may describe; they follow Linux and ext4.
const (
	MaxNameLen      = 255       // bytes in one path component
	MaxPathLen      = 4096      // bytes in a whole path
	MaxSymlinkLen   = 4095      // bytes in a symlink target
	MaxXattrNameLen = 255       // bytes in an xattr name, prefix included
	MaxXattrSize    = 65536     // bytes in one xattr value
	MaxDevMajor     = 1<<12 - 1 // ext4's 32-bit device encoding keeps 12 major bits
	MaxDevMinor     = 1<<20 - 1 // and 20 minor bits

	// DefaultMaxEntries bounds the entries of one index unless Options says
	// otherwise.
	DefaultMaxEntries = 1 << 22
)

// ErrInvalid marks an index or image that breaks the rules of this package;
// every rejection of hostile input wraps it.
var ErrInvalid = errors.New("invalid image index")

// Invalidf returns an error wrapping ErrInvalid with a formatted reason.
func Invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// CheckPath verifies that p is a clean, relative, slash-separated index path
// within the length limits ("." is the root).
func CheckPath(p string) error {
	if p == "." {
		return nil
	}
	if p == "" {
		return Invalidf("empty path")
	}
	if len(p) > MaxPathLen {
		return Invalidf("path of %d bytes exceeds %d", len(p), MaxPathLen)
	}
	if p[0] == '/' {
		return Invalidf("absolute path %q", p)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return Invalidf("path %q contains a NUL byte", p)
	}
	for rest := p; ; {
		i := strings.IndexByte(rest, '/')
		c := rest
		if i >= 0 {
			c = rest[:i]
		}
		switch {
		case c == "":
			return Invalidf("path %q has an empty component", p)
		case c == "." || c == "..":
			return Invalidf("path %q has a %q component", p, c)
		case len(c) > MaxNameLen:
			return Invalidf("path %q has a component of %d bytes (max %d)", Trunc(p), len(c), MaxNameLen)
		}
		if i < 0 {
			return nil
		}
		rest = rest[i+1:]
	}
}

// Trunc shortens a long string (a path or name from hostile input) for an
// error message.
func Trunc(s string) string {
	if len(s) > 120 {
		return s[:60] + "..." + s[len(s)-40:]
	}
	return s
}

// CheckDev verifies that a device number fits ext4's encoding.
func CheckDev(major, minor uint64) error {
	if major > MaxDevMajor || minor > MaxDevMinor {
		return Invalidf("device %d:%d out of range (ext4 encodes major < %d, minor < %d)", major, minor, MaxDevMajor+1, MaxDevMinor+1)
	}
	return nil
}

// Validate checks every invariant documented on Index and Entry: order,
// parents, types, modes, device numbers, xattr order, data sources and
// segments, and hard link targets. Decode runs it on everything it returns.
func (ix *Index) Validate() error {
	return ix.validate(false)
}

// validate serves Validate and, with layer set, ValidateLayer.
func (ix *Index) validate(layer bool) error {
	for i, s := range ix.Sources {
		switch s.Kind {
		case SourceDir:
			if s.ID == "" {
				return Invalidf("source %d: empty directory", i)
			}
		case SourceBlob:
			if _, err := BlobHex(s.ID); err != nil {
				return fmt.Errorf("source %d: %w", i, err)
			}
		default:
			return Invalidf("source %d: unknown kind %d", i, s.Kind)
		}
	}
	if len(ix.Entries) == 0 {
		return Invalidf("no root entry")
	}
	if ix.Entries[0].Path != "." || ix.Entries[0].Type != TypeDir {
		return Invalidf("first entry %q is not the root directory", Trunc(ix.Entries[0].Path))
	}
	// Directories along the current depth-first branch: with the Index order
	// an entry's parent, if present, is on this stack.
	stack := make([]string, 0, 64)
	for i := range ix.Entries {
		e := &ix.Entries[i]
		if err := e.check(ix, layer); err != nil {
			return fmt.Errorf("entry %q: %w", Trunc(e.Path), err)
		}
		if i > 0 {
			if ComparePaths(ix.Entries[i-1].Path, e.Path) >= 0 {
				return Invalidf("entry %q out of order after %q", Trunc(e.Path), Trunc(ix.Entries[i-1].Path))
			}
			parent := ParentPath(e.Path)
			for len(stack) > 0 && stack[len(stack)-1] != parent {
				stack = stack[:len(stack)-1]
			}
			if len(stack) == 0 {
				return Invalidf("entry %q: parent %q is not a directory of the index", Trunc(e.Path), Trunc(parent))
			}
		}
		if e.Type == TypeDir {
			stack = append(stack, e.Path)
		}
		if e.Type == TypeHardlink && !(layer && HasXattr(e.Xattrs, XattrLowerLink)) {
			j := ix.Lookup(e.Linkname)
			if j < 0 || j >= i {
				return Invalidf("hard link %q: target %q is missing or does not precede it", Trunc(e.Path), Trunc(e.Linkname))
			}
			if t := ix.Entries[j].Type; t == TypeDir || t == TypeHardlink {
				return Invalidf("hard link %q: target %q is a %s", Trunc(e.Path), Trunc(e.Linkname), t)
			}
		}
	}
	return nil
}

func (e *Entry) check(ix *Index, layer bool) error {
	if err := CheckPath(e.Path); err != nil {
		return err
	}
	if e.Mode&^07777 != 0 {
		return Invalidf("mode %#o has bits outside 07777", e.Mode)
	}
	if e.Atime.Nsec >= 1e9 || e.Mtime.Nsec >= 1e9 || e.Ctime.Nsec >= 1e9 {
		return Invalidf("nanoseconds out of range")
	}
	if e.Size < 0 {
		return Invalidf("negative size %d", e.Size)
	}
	for j, x := range e.Xattrs {
		if x.Name == "" || len(x.Name) > MaxXattrNameLen || strings.IndexByte(x.Name, 0) >= 0 {
			return Invalidf("bad xattr name %q", Trunc(x.Name))
		}
		if len(x.Value) > MaxXattrSize {
			return Invalidf("xattr %q value of %d bytes exceeds %d", x.Name, len(x.Value), MaxXattrSize)
		}
		if j > 0 && e.Xattrs[j-1].Name >= x.Name {
			return Invalidf("xattrs not sorted or duplicated at %q", x.Name)
		}
		if !layer && strings.HasPrefix(x.Name, XattrOverlayPrefix) {
			return Invalidf("overlay xattr %q in a merged index", x.Name)
		}
	}
	if e.Type != TypeSymlink && e.Type != TypeHardlink && e.Linkname != "" {
		return Invalidf("link name on a %s", e.Type)
	}
	if e.Type != TypeChar && e.Type != TypeBlock && (e.Devmajor != 0 || e.Devminor != 0) {
		return Invalidf("device number on a %s", e.Type)
	}
	if e.Type != TypeRegular && e.Type != TypeHardlink && e.Size != 0 {
		return Invalidf("size %d on a %s", e.Size, e.Type)
	}
	if e.Type != TypeRegular && !e.Data.isZero() {
		return Invalidf("data on a %s", e.Type)
	}
	switch e.Type {
	case TypeRegular:
		return e.Data.check(ix, e.Size)
	case TypeDir, TypeFifo, TypeSocket:
	case TypeSymlink:
		if e.Linkname == "" || len(e.Linkname) > MaxSymlinkLen || strings.IndexByte(e.Linkname, 0) >= 0 {
			return Invalidf("bad symlink target of %d bytes", len(e.Linkname))
		}
	case TypeHardlink:
		if err := CheckPath(e.Linkname); err != nil || e.Linkname == "." {
			return Invalidf("bad hard link target %q", Trunc(e.Linkname))
		}
	case TypeChar, TypeBlock:
		return CheckDev(uint64(e.Devmajor), uint64(e.Devminor))
	default:
		return Invalidf("unknown type %d", uint8(e.Type))
	}
	return nil
}

func (d *Data) isZero() bool {
	return d.Source == 0 && d.Path == "" && d.Offset == 0 && d.Segments == nil
}

func (d *Data) check(ix *Index, size int64) error {
	if int(d.Source) >= len(ix.Sources) {
		if size == 0 && d.isZero() {
			return nil
		}
		return Invalidf("data source %d out of range (%d sources)", d.Source, len(ix.Sources))
	}
	switch ix.Sources[d.Source].Kind {
	case SourceDir:
		if err := CheckPath(d.Path); err != nil || d.Path == "." {
			return Invalidf("bad data path %q", Trunc(d.Path))
		}
		if d.Offset != 0 {
			return Invalidf("offset on a directory source")
		}
	case SourceBlob:
		if d.Path != "" {
			return Invalidf("path on a blob source")
		}
		if d.Offset < 0 || d.Offset > maxInt64-size {
			return Invalidf("blob offset %d out of range", d.Offset)
		}
	}
	var end int64
	for _, r := range d.Segments {
		if r.Off < end || r.Len <= 0 || r.Off > size || r.Len > size-r.Off {
			return Invalidf("data segment [%d,+%d) unsorted, empty or beyond size %d", r.Off, r.Len, size)
		}
		end = r.Off + r.Len
	}
	return nil
}

const maxInt64 = 1<<63 - 1

// BlobHex returns the hex part of a "sha256:<64 lowercase hex>" digest, the
// only form a SourceBlob ID may take.
func BlobHex(id string) (string, error) {
	h, ok := strings.CutPrefix(id, "sha256:")
	if !ok || len(h) != 64 {
		return "", Invalidf("bad blob digest %q", Trunc(id))
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return "", Invalidf("bad blob digest %q", Trunc(id))
		}
	}
	return h, nil
}

// HasXattr reports whether xs has an attribute called name.
func HasXattr(xs []Xattr, name string) bool {
	for _, x := range xs {
		if x.Name == name {
			return true
		}
	}
	return false
}

// XattrValue returns the value of the attribute called name in xs, if any.
func XattrValue(xs []Xattr, name string) ([]byte, bool) {
	for _, x := range xs {
		if x.Name == name {
			return x.Value, true
		}
	}
	return nil, false
}
