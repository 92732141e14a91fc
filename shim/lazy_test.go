package shim

import (
	"context"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

func TestLazyRootfsAnnotationGated(t *testing.T) {
	s := newService(context.Background(), serviceOptions{})
	cfg := config.Default()
	spec := sandbox.Spec{ID: "c1", Config: cfg, Annotations: map[string]string{}}
	if err := s.lazyRootfs(context.Background(), &spec); err != nil || spec.RootfsLazy != nil || spec.Backend != "" {
		t.Fatalf("no annotation: %v, spec changed: %+v", err, spec)
	}
	spec.Annotations[config.AnnotationLazyImage] = "registry:127.0.0.1:1/x:y"
	err := s.lazyRootfs(context.Background(), &spec)
	if err == nil || !strings.Contains(err.Error(), "lazy_image_annotation") || spec.RootfsLazy != nil {
		t.Fatalf("annotation with lazy_image_annotation off: %v, want a refusal naming the key", err)
	}
	cfg.KataFSX.Registry.LazyImageAnnotation = true
	spec.Annotations[config.AnnotationLazyImage] = "oci:/some/dir"
	if err := s.lazyRootfs(context.Background(), &spec); err == nil || !strings.Contains(err.Error(), "want registry:") {
		t.Fatalf("non-registry source: %v, want an error saying what is wanted", err)
	}
}

// A pod put on imagefs-blk by the lazy-image annotation says so, not
// that the backend was requested explicitly.
func TestLazyBackendReason(t *testing.T) {
	cfg := config.Default()
	spec := sandbox.Spec{ID: "c1", Config: cfg, Annotations: map[string]string{},
		Rootfs: config.Rootfs{Kind: config.RootfsImage, ImageRef: "registry:127.0.0.1:1/x:y"}}
	lazyBackend(&spec, "registry:127.0.0.1:1/x:y")
	d, err := sandbox.Decide(spec)
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != config.SharedFSImagefsBlk {
		t.Errorf("backend %s, want %s", d.Backend, config.SharedFSImagefsBlk)
	}
	if !strings.Contains(d.Reason, "annotation "+config.AnnotationLazyImage) || strings.Contains(d.Reason, "--backend") {
		t.Errorf("reason %q, want one naming the annotation", d.Reason)
	}
}
