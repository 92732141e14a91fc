package index

import (
	"fmt"
	"io"
)

// A per-layer index describes one image layer as overlayfs sees it, before
// any merge: whiteouts are character devices 0:0, opaque directories carry
// XattrOpaque="y", and tar layers add the XattrImplicit and XattrLowerLink
// markers. Every layered source produces this one form, so that one merge
// and one per-layer cache serve host layer directories and layer tars
// alike. It passes ValidateLayer rather than Validate, and its encoding is
// marked so that Decode never mistakes it for a merged index.

// Extended attribute names of per-layer indexes. They are all in the
// overlay namespace, which never reaches a merged index: the merge strips
// it, and tar layers drop image-supplied overlay xattrs so an image cannot
// forge the markers.
const (
	// XattrOverlayPrefix is the namespace Validate refuses in a merged index.
	XattrOverlayPrefix = "trusted.overlay."
	// XattrOpaque="y" hides every lower entry below a directory.
	XattrOpaque = "trusted.overlay.opaque"
	// XattrImplicit marks a directory a tar layer only implies (a parent of
	// an entry, or the holder of an opaque marker): it keeps a lower
	// directory's metadata or gets ImpliedDir's.
	XattrImplicit = "trusted.overlay.kata-fsx.implicit"
	// XattrLowerLink marks a tar hard link whose target is in a lower layer.
	XattrLowerLink = "trusted.overlay.kata-fsx.lowerlink"
)

// IsWhiteout reports whether e is an overlay whiteout (a character device
// 0:0).
func IsWhiteout(e *Entry) bool {
	return e.Type == TypeChar && e.Devmajor == 0 && e.Devminor == 0
}

// IsOpaque reports whether e carries the opaque marker XattrOpaque="y".
func IsOpaque(e *Entry) bool {
	v, ok := XattrValue(e.Xattrs, XattrOpaque)
	return ok && string(v) == "y"
}

// ImpliedDir returns the metadata of a directory that a layer only implies
// and no lower layer provides.
func ImpliedDir() Entry {
	return Entry{Type: TypeDir, Mode: 0o755}
}

// EncodeLayer writes a per-layer index in the binary index format, marked
// as a layer index.
func EncodeLayer(w io.Writer, ix *Index) error {
	return encode(w, ix, flagLayer)
}

// DecodeLayer reads an index written by EncodeLayer, with Decode's
// distrust of its input; the result passes ValidateLayer.
func DecodeLayer(r io.Reader) (*Index, error) {
	ix, flags, err := decode(r)
	if err != nil {
		return nil, err
	}
	if flags&flagLayer == 0 {
		return nil, Invalidf("decode index: a merged index, not a per-layer index")
	}
	if err := ix.validate(true); err != nil {
		return nil, fmt.Errorf("decode index: %w", err)
	}
	return ix, nil
}

// ValidateLayer is Validate for a per-layer index: overlay xattrs are
// allowed, and a hard link marked XattrLowerLink may name a target in a
// lower layer.
func (ix *Index) ValidateLayer() error {
	return ix.validate(true)
}
