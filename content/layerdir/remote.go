// Package layerdir turns a remote layer of the kata-fsx snapshotter into an
// overlayfs layer directory on demand. The snapshotter commits a layer that
// CRI pulled as *remote*: its directory stays empty and a sidecar file beside
// it names the registry image and layer; the kata-fsx shim on imagefs-blk
// reads such a layer from the node's lazy store and never needs it on disk.
// Every other consumer (runc, the shim on virtio-fs, containerd's own mounts)
// gets the snapshot as a mount of type MountType, whose helper materializes
// the remote layers from the lazy store and then mounts a plain overlay.
package layerdir

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"

	"github.com/kata-fsx/kata-fsx/atomicfile"
)

const (
	// MountType is the type of a snapshot mount with remote layers below it.
	// containerd (and its runc shim) run "mount.fuse3 SOURCE TARGET -o OPTS
	// -t kata-fsx-overlay" for it, which runs HelperName with the same
	// arguments; the options are overlayfs's.
	MountType = "fuse3." + HelperName
	// HelperName is the mount helper's program name, on containerd's PATH.
	HelperName = "kata-fsx-overlay"

	// SidecarName is the remote layer's description, in the snapshot's
	// directory beside its fs directory (the overlay lowerdir).
	SidecarName = "kata-fsx-remote.json"
	// MarkerName marks a remote layer whose fs directory is complete.
	MarkerName = "kata-fsx-materialized"
)

// Remote describes a remote layer: where its bytes are and how to reach them.
type Remote struct {
	// Ref is the image the layer was pulled with, pinned to its manifest:
	// HOST/REPO@sha256:... .
	Ref string `json:"ref"`
	// Layer is the layer's blob digest in that manifest.
	Layer digest.Digest `json:"layer"`
	// Config is the kata-fsx configuration file whose [kata_fsx.registry]
	// table and imagefs-blk state_dir the snapshotter used, so that a mount
	// helper and the shim read through the same node store. Empty means
	// the configuration config.Load finds by default.
	Config string `json:"config"`
}

// WriteRemote records r as the remote description of the snapshot whose
// directory is snapDir (the parent of its fs directory).
func WriteRemote(snapDir string, r Remote) error {
	if r.Ref == "" || r.Layer.Validate() != nil {
		return fmt.Errorf("remote layer in %s: ref %q, layer %q: both must be set", snapDir, r.Ref, r.Layer)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(filepath.Join(snapDir, SidecarName), b, 0o600); err != nil {
		return fmt.Errorf("remote layer sidecar: %w", err)
	}
	return nil
}

// ReadRemote returns the remote description of the layer whose overlay
// lowerdir is lower, and false if it is an ordinary (local) layer.
func ReadRemote(lower string) (Remote, bool, error) {
	p := filepath.Join(filepath.Dir(filepath.Clean(lower)), SidecarName)
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return Remote{}, false, nil
	}
	if err != nil {
		return Remote{}, false, fmt.Errorf("remote layer sidecar: %w", err)
	}
	var r Remote
	if err := json.Unmarshal(b, &r); err != nil {
		return Remote{}, false, fmt.Errorf("remote layer sidecar %s: %w", p, err)
	}
	if r.Ref == "" || r.Layer.Validate() != nil {
		return Remote{}, false, fmt.Errorf("remote layer sidecar %s: ref %q, layer %q: both must be set", p, r.Ref, r.Layer)
	}
	return r, true, nil
}

// Materialized reports whether the remote layer whose lowerdir is lower has
// its fs directory complete.
func Materialized(lower string) bool {
	_, err := os.Stat(filepath.Join(filepath.Dir(filepath.Clean(lower)), MarkerName))
	return err == nil
}
