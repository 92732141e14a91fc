package shim

import (
	"context"
	"fmt"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/sandbox"
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
	if !lazyroot.IsSource(ref) {
		return errInvalid("container %s: annotation %s=%q: want registry:HOST/REPO[:TAG|@DIGEST]", spec.ID, config.AnnotationLazyImage, ref)
	}
	lazy, err := lazyroot.Open(ctx, ref, lazyroot.ConfigOptions(spec.Config, func(format string, args ...any) { s.log(spec.ID).Infof(format, args...) }))
	if err != nil {
		return toStatus(fmt.Errorf("container %s: annotation %s: %w", spec.ID, config.AnnotationLazyImage, err))
	}
	s.log(spec.ID).Infof("rootfs: %s read lazily on imagefs-blk (indexes: %s), in place of the rootfs containerd mounted", ref, lazy.Image.IndexSource)
	spec.RootfsIndex, spec.RootfsLazy = lazy.Tree, lazy
	spec.Rootfs = config.Rootfs{Kind: config.RootfsImage, ImageRef: ref}
	spec.Backend = config.SharedFSImagefsBlk
	return nil
}
