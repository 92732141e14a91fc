package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
)

// remoteRootfs is a container rootfs the kata-fsx snapshotter returned
// with remote layers below it: a mount of type layerdir.MountType whose
// options are overlayfs's (or a bind's, for a one-layer view).
type remoteRootfs struct {
	mount config.Mount
	// lowers are the overlay's lower directories, topmost first, as in
	// the lowerdir option; remotes[i] describes lowers[i] when it is a
	// remote layer (Ref is empty for a local one).
	lowers  []string
	remotes []layerdir.Remote
	upper   string
}

// parseRemoteRootfs recognizes the snapshotter's remote mount; ok is false
// for any other rootfs.
func parseRemoteRootfs(mounts []config.Mount) (_ *remoteRootfs, ok bool, err error) {
	if len(mounts) != 1 || mounts[0].Type != layerdir.MountType {
		return nil, false, nil
	}
	r := &remoteRootfs{mount: mounts[0]}
	// The layers as the policy reads any overlay or bind rootfs.
	rf := config.RootfsFromMounts(r.policyMounts(), "")
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

// topRef is the image of the topmost remote layer.
func (r *remoteRootfs) topRef() string {
	for _, rem := range r.remotes {
		if rem.Ref != "" {
			return rem.Ref
		}
	}
	return ""
}

// policyMounts is the rootfs as the backend policy should see it: the
// overlay (or bind) the remote mount stands for.
func (r *remoteRootfs) policyMounts() []config.Mount {
	m := r.mount
	m.Type = "overlay"
	for _, o := range m.Options {
		if o == "bind" || o == "rbind" {
			m.Type = "bind"
		}
	}
	return []config.Mount{m}
}

// openLazy opens the image the remote layers came from as a lazy rootfs,
// after checking it is exactly this rootfs: the topmost remote layer's
// image, layer for layer, and nothing written in the container's own
// layer yet. ok is false, with the reason in why, when the rootfs is not
// that image alone; the caller then materializes it.
func (r *remoteRootfs) openLazy(ctx context.Context, cfg *config.Config, logf func(string, ...any)) (root *lazyroot.Root, why string, err error) {
	top := r.topRef()
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
	root, err = lazyroot.Open(ctx, lazyroot.Prefix+top, lazyroot.ConfigOptions(cfg, logf))
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

// materialize makes every remote layer of the rootfs a real directory and
// returns the plain overlay (or bind) mounts over them.
func (r *remoteRootfs) materialize(ctx context.Context, logf func(string, ...any)) ([]config.Mount, error) {
	for i, l := range r.lowers {
		if r.remotes[i].Ref == "" {
			continue
		}
		if err := layerdir.Materialize(ctx, l, logf); err != nil {
			return nil, fmt.Errorf("rootfs layer %s (%s of %s): %w", l, r.remotes[i].Layer, r.remotes[i].Ref, err)
		}
	}
	return r.policyMounts(), nil
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
