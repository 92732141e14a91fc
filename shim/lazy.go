package shim

import (
	"context"
	"fmt"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/sandbox/rootfs"
)

// lazyRootfs serves the pod's first container from the registry image its
// AnnotationLazyImage names, when the configuration allows it: the image
// is resolved and its store opened here, and the sandbox takes the store
// over. Without the annotation spec is left as it is.
func (s *service) lazyRootfs(ctx context.Context, spec *sandbox.Spec) error {
	ref := spec.Annotations[config.AnnotationLazyImage]
	if ref == "" {
		return nil
	}
	reg := spec.Config.KataFSX.Registry
	if !reg.LazyImageAnnotation {
		return errInvalid("container %s: annotation %s=%s: lazy images by annotation are off; set [kata_fsx.registry] lazy_image_annotation = true to allow them", spec.ID, config.AnnotationLazyImage, ref)
	}
	if !rootfs.IsLazyImage(ref) {
		return errInvalid("container %s: annotation %s=%q: want registry:HOST/REPO[:TAG|@DIGEST]", spec.ID, config.AnnotationLazyImage, ref)
	}
	lazy, err := rootfs.OpenLazyImage(ctx, ref, spec.Config, s.logf(spec.ID))
	if err != nil {
		return fmt.Errorf("container %s: annotation %s: %w", spec.ID, config.AnnotationLazyImage, err)
	}
	s.log(spec.ID).Infof("rootfs: %s read lazily on imagefs-blk (indexes: %s), in place of the rootfs containerd mounted", ref, lazy.Image.IndexSource)
	spec.RootfsIndex, spec.RootfsLazy = lazy.TakeTree(), lazy
	spec.Rootfs = config.Rootfs{Kind: config.RootfsImage, ImageRef: ref}
	lazyBackend(spec, ref)
	return nil
}

// lazyBackend puts a pod whose first container is a lazy image on
// imagefs-blk, the one backend that reads it, and says so.
func lazyBackend(spec *sandbox.Spec, ref string) {
	spec.Backend = config.SharedFSImagefsBlk
	spec.BackendReason = fmt.Sprintf("annotation %s=%s requests a lazy image, which only imagefs-blk reads", config.AnnotationLazyImage, ref)
}

// remoteSandboxRootfs serves the pod's first container, whose rootfs the
// kata-fsx snapshotter left remote, from the lazy store when the policy
// put the pod (decision d) on imagefs-blk; on virtio-fs the rootfs mount
// materializes the layers instead (rootfs.Mount).
func (s *service) remoteSandboxRootfs(ctx context.Context, spec *sandbox.Spec, remote *rootfs.Remote, d config.Decision) error {
	if d.Backend != config.SharedFSImagefsBlk {
		return nil
	}
	idx, lazy, err := s.remoteLazyRootfs(ctx, spec.ID, d.Config, remote)
	if err != nil {
		return err
	}
	if lazy != nil {
		spec.RootfsIndex, spec.RootfsLazy = idx, lazy
		spec.Rootfs = config.Rootfs{Kind: config.RootfsImage, ImageRef: remote.ImageRef()}
	}
	return nil
}

// remoteLazyRootfs opens the remote rootfs's image for an imagefs-blk disk.
// When the rootfs is not that image alone, its remote layers are
// materialized instead and lazy is nil: the disk is then built from the
// layer directories like any overlay rootfs.
func (s *service) remoteLazyRootfs(ctx context.Context, cid string, cfg *config.Config, remote *rootfs.Remote) (*index.Index, sandbox.LazyRootfs, error) {
	logf := s.logf(cid)
	root, why, err := remote.OpenLazy(ctx, cfg, logf)
	if err != nil {
		return nil, nil, fmt.Errorf("container %s: %w", cid, err)
	}
	if root != nil {
		s.log(cid).Infof("rootfs: remote layers of %s read lazily on imagefs-blk (indexes: %s)", remote.TopRef(), root.Image.IndexSource)
		return root.TakeTree(), root, nil
	}
	s.log(cid).Infof("rootfs: materializing its remote layers: %s", why)
	if _, err := remote.Materialize(ctx, logf); err != nil {
		return nil, nil, fmt.Errorf("container %s: %w", cid, err)
	}
	return nil, nil, nil
}

// logf logs a container's progress lines at info level.
func (s *service) logf(cid string) func(string, ...any) {
	return func(format string, args ...any) { s.log(cid).Infof(format, args...) }
}
