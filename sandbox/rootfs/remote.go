// Package rootfs is a container's rootfs as containerd hands it to the
// shim: its mount on the host for the shared-directory backends, the
// kata-fsx snapshotter's remote layers, and the lazy images they (or a
// pod's annotation) name, opened from the node's lazy store.
package rootfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/node"
)

// Remote is a container rootfs the kata-fsx snapshotter returned
// with remote layers below it: a mount of type layerdir.MountType whose
// options are overlayfs's (or a bind's, for a one-layer view).
type Remote struct {
	mount config.Mount
	// lowers are the overlay's lower directories, topmost first, as in
	// the lowerdir option; remotes[i] describes lowers[i] when it is a
	// remote layer (Ref is empty for a local one).
	lowers  []string
	remotes []layerdir.Remote
	upper   string
}

// ParseRemote recognizes the snapshotter's remote mount; ok is false
// for any other rootfs.
func ParseRemote(mounts []config.Mount) (_ *Remote, ok bool, err error) {
	if len(mounts) != 1 || mounts[0].Type != layerdir.MountType {
		return nil, false, nil
	}
	r := &Remote{mount: mounts[0]}
	// The layers as the policy reads any overlay or bind rootfs.
	rf := config.RootfsFromMounts(r.PolicyMounts(), "")
	if !rf.Indexable() {
		return nil, true, fmt.Errorf("rootfs %s mount of %s: %s", r.mount.Type, r.mount.Source, rf.Why)
	}
	layers := rf.Layers // bottom first, the upper last
	if rf.UpperDir != "" {
		r.upper, layers = rf.UpperDir, layers[:len(layers)-1]
	}
	for i := len(layers) - 1; i >= 0; i-- {
		r.lowers = append(r.lowers, layers[i])
	}
	for _, l := range r.lowers {
		rem, _, err := layerdir.ReadRemote(l)
		if err != nil {
			return nil, true, fmt.Errorf("rootfs layer %s: %w", l, err)
		}
		r.remotes = append(r.remotes, rem)
	}
	return r, true, nil
}

// ImageRef is the lazy image the remote layers come from, as a
// config.RootfsImage names it.
func (r *Remote) ImageRef() string { return lazyroot.Prefix + r.TopRef() }

// TopRef is the image of the topmost remote layer.
func (r *Remote) TopRef() string {
	for _, rem := range r.remotes {
		if rem.Ref != "" {
			return rem.Ref
		}
	}
	return ""
}

// PolicyMounts is the rootfs as the backend policy should see it: the
// overlay (or bind) the remote mount stands for.
func (r *Remote) PolicyMounts() []config.Mount {
	m := r.mount
	m.Type = "overlay"
	for _, o := range m.Options {
		if o == "bind" || o == "rbind" {
			m.Type = "bind"
		}
	}
	return []config.Mount{m}
}

// OpenLazy opens the image the remote layers came from as a lazy rootfs,
// after checking it is exactly this rootfs: the topmost remote layer's
// image, layer for layer, and nothing written in the container's own
// layer yet. ok is false, with the reason in why, when the rootfs is not
// that image alone; the caller then materializes it.
func (r *Remote) OpenLazy(ctx context.Context, cfg *config.Config, logf func(string, ...any)) (root *lazyroot.Root, why string, err error) {
	top := r.TopRef()
	if top == "" {
		return nil, "no remote layer", nil
	}
	if r.upper != "" {
		empty, err := dirEmpty(r.upper)
		if err != nil {
			return nil, "", fmt.Errorf("rootfs upperdir: %w", err)
		}
		if !empty {
			return nil, "the container's own layer " + r.upper + " is not empty", nil
		}
	}
	root, err = lazyroot.Open(ctx, lazyroot.Prefix+top, node.LazyRootOptions(cfg, logf))
	if err != nil {
		return nil, "", fmt.Errorf("rootfs: remote image %s: %w", top, err)
	}
	layers := root.Image.Manifest.Layers
	mismatch := ""
	if len(layers) != len(r.lowers) {
		mismatch = fmt.Sprintf("image %s has %d layers, the rootfs %d", top, len(layers), len(r.lowers))
	} else {
		for i, rem := range r.remotes {
			want := layers[len(layers)-1-i].Digest
			if rem.Ref != "" && rem.Layer != want {
				mismatch = fmt.Sprintf("rootfs layer %s is %s, image %s has %s there", r.lowers[i], rem.Layer, top, want)
				break
			}
		}
	}
	if mismatch != "" {
		return nil, mismatch, root.Close()
	}
	return root, "", nil
}

// Materialize makes every remote layer of the rootfs a real directory and
// returns the plain overlay (or bind) mounts over them.
func (r *Remote) Materialize(ctx context.Context, logf func(string, ...any)) ([]config.Mount, error) {
	for i, l := range r.lowers {
		if r.remotes[i].Ref == "" {
			continue
		}
		if err := layerdir.Materialize(ctx, l, logf); err != nil {
			return nil, fmt.Errorf("rootfs layer %s (%s of %s): %w", l, r.remotes[i].Layer, r.remotes[i].Ref, err)
		}
	}
	return r.PolicyMounts(), nil
}

func dirEmpty(dir string) (bool, error) {
	f, err := os.Open(dir)
	if err != nil {
		return false, err
	}
	defer f.Close()
	_, err = f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return true, nil
	}
	return false, err
}
