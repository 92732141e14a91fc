package blk

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/oci"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
)

// ErrSourceSpec is wrapped by errors about a malformed source spec.
var ErrSourceSpec = errors.New("bad image source")

// IndexSource indexes an image source spec: dir:PATH, layers:L1:L2:...
// (lowest first), oci:PATH[:TAG] (an OCI layout) or oci-archive:PATH[:TAG]
// (an OCI or docker-save archive). OCI sources need cacheDir for their
// uncompressed layers.
func IndexSource(ctx context.Context, spec, cacheDir string, budgets Budgets) (*index.Index, error) {
	kind, rest, ok := strings.Cut(spec, ":")
	if !ok || rest == "" {
		return nil, fmt.Errorf("%w: source %q: want dir:PATH, layers:L1:L2:..., oci:PATH[:TAG] or oci-archive:PATH[:TAG]", ErrSourceSpec, spec)
	}
	opts := budgets.indexOptions(cacheDir, nil)
	switch kind {
	case "dir":
		return hostfs.FromDir(ctx, rest, opts)
	case "layers":
		return overlayfs.FromLayers(ctx, strings.Split(rest, ":"), opts)
	case "oci", "oci-archive":
		path, tag := splitTag(rest)
		if cacheDir == "" {
			return nil, fmt.Errorf("source %s: OCI sources need a cache directory (--cache)", spec)
		}
		return oci.FromOCI(ctx, path, tag, opts)
	}
	return nil, fmt.Errorf("%w: source kind %q: want dir, layers, oci or oci-archive", ErrSourceSpec, kind)
}

// splitTag splits PATH[:TAG]; a colon inside the last path element starts the tag.
func splitTag(s string) (path, tag string) {
	slash := strings.LastIndex(s, "/")
	if i := strings.LastIndex(s, ":"); i > slash {
		if _, err := os.Stat(s); err != nil {
			return s[:i], s[i+1:]
		}
	}
	return s, ""
}

// CreateFromIndex is Create for an already built index. The image comes
// from the node's image store under opts.CacheDir: built there once for
// every pod of the same index and options, and shared read-only; without
// a CacheDir it is synthesized into dir/image.
func CreateFromIndex(ctx context.Context, idx *index.Index, dir string, opts Options) (*Disk, error) {
	return create(ctx, idx, dir, opts, BuildInfo{})
}
