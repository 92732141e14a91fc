package config

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func overlayRootfs() Rootfs {
	return RootfsFromMounts([]Mount{{Type: "overlay", Source: "overlay", Options: []string{
		"index=off", "workdir=/snap/3/work", "upperdir=/snap/3/fs", "lowerdir=/snap/2/fs:/snap/1/fs",
	}}}, "")
}

func TestRootfsFromOverlayMount(t *testing.T) {
	r := overlayRootfs()
	if r.Kind != RootfsOverlay || strings.Join(r.Layers, ",") != "/snap/1/fs,/snap/2/fs,/snap/3/fs" || r.UpperDir != "/snap/3/fs" {
		t.Fatalf("got %+v", r)
	}
	if r := RootfsFromMounts([]Mount{{Type: "ext4", Source: "/dev/dm-3"}}, ""); r.Indexable() || !strings.Contains(r.Why, "/dev/dm-3") {
		t.Fatalf("block rootfs: %+v", r)
	}
	if r := RootfsFromMounts(nil, "/bundle/rootfs"); r.Kind != RootfsDir || r.Layers[0] != "/bundle/rootfs" {
		t.Fatalf("dir rootfs: %+v", r)
	}
}

func policyConfig(t *testing.T) *Config {
	c := validConfig(t)
	c.KataFSX.SharedFS = SharedFSAuto
	c.QEMU().EnableAnnotations = []string{"shared_fs", "virtio_fs_cache$"}
	c.QEMU().ValidVirtioFSDaemonPaths = []string{filepath.Join(filepath.Dir(c.QEMU().VirtioFSDaemon), "*")}
	return c
}

func TestAutoWithOverlayPicksImagefsBlk(t *testing.T) {
	d, err := Decide(policyConfig(t), Pod{Rootfs: overlayRootfs()})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != SharedFSImagefsBlk || !strings.Contains(d.Reason, "auto") || !strings.Contains(d.Reason, "3 layers") || d.VolumesViaVirtioFS {
		t.Fatalf("got %+v", d)
	}
}

func TestAutoWithUnindexableRootfsPicksVirtioFS(t *testing.T) {
	d, err := Decide(policyConfig(t), Pod{Rootfs: RootfsFromMounts([]Mount{{Type: "fuse.stargz", Source: "/x"}}, "")})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != SharedFSVirtioFS || !strings.Contains(d.Reason, "cannot be indexed") || !strings.Contains(d.Reason, "fuse.stargz") {
		t.Fatalf("got %+v", d)
	}
}

func TestExplicitImagefsBlkUnindexableFails(t *testing.T) {
	c := policyConfig(t)
	c.KataFSX.SharedFS = SharedFSImagefsBlk
	_, err := Decide(c, Pod{Rootfs: RootfsFromMounts([]Mount{{Type: "ext4", Source: "/dev/dm-1"}}, "")})
	var ce *Error
	if !errors.As(err, &ce) || ce.Key != "kata_fsx.shared_fs" || !strings.Contains(err.Error(), "cannot be indexed") {
		t.Fatalf("got %v", err)
	}
}

func TestImagefsBlkWithHostVolumesAlsoNeedsVirtioFS(t *testing.T) {
	d, err := Decide(policyConfig(t), Pod{Rootfs: overlayRootfs(), HostVolumes: []string{"/data"}})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != SharedFSImagefsBlk || !d.VolumesViaVirtioFS || !strings.Contains(d.Reason, "virtiofsd runs for the volumes only") {
		t.Fatalf("got %+v", d)
	}
	c := policyConfig(t)
	c.QEMU().VirtioFSDaemon = ""
	if _, err := Decide(c, Pod{Rootfs: overlayRootfs(), HostVolumes: []string{"/data"}}); err == nil || !strings.Contains(err.Error(), "virtio_fs_daemon") {
		t.Fatalf("volumes without a daemon: %v", err)
	}
}

func TestAnnotationAllowedOverridesBackend(t *testing.T) {
	d, err := Decide(policyConfig(t), Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationSharedFS: "virtio-fs"}})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != SharedFSVirtioFS || !strings.Contains(d.Reason, "annotation "+AnnotationSharedFS) {
		t.Fatalf("got %+v", d)
	}
}

func TestAnnotationRefusedWhenNotEnabled(t *testing.T) {
	c := policyConfig(t)
	c.QEMU().EnableAnnotations = []string{"kernel_params"}
	_, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationSharedFS: "virtio-fs"}})
	if err == nil || err.Error() != "annotation io.katacontainers.config.hypervisor.shared_fs is not enabled" {
		t.Fatalf("got %v", err)
	}
	// Kata's rule is an unanchored match: "fs" enables every key containing it.
	c.QEMU().EnableAnnotations = []string{"fs"}
	if _, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationSharedFS: "virtio-fs"}}); err != nil {
		t.Fatalf("unanchored regex: %v", err)
	}
	// An anchored regex limits it: virtio_fs_cache$ does not enable virtio_fs_cache_size.
	c = policyConfig(t)
	if _, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationVirtioFSCacheSize: "64"}}); err == nil {
		t.Fatal("virtio_fs_cache_size accepted without being enabled")
	}
	// Annotations outside the hypervisor prefix are never checked.
	if _, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{"io.kubernetes.cri.container-type": "sandbox"}}); err != nil {
		t.Fatal(err)
	}
}

func TestAnnotationBadSharedFS(t *testing.T) {
	_, err := Decide(policyConfig(t), Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationSharedFS: "nfs"}})
	if err == nil || !strings.Contains(err.Error(), "Invalid hypervisor shared file system nfs specified for annotation shared_fs") {
		t.Fatalf("got %v", err)
	}
}

func TestAnnotationDaemonMustMatchValidPaths(t *testing.T) {
	c := policyConfig(t)
	c.QEMU().EnableAnnotations = []string{"virtio_fs_daemon"}
	_, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationVirtioFSDaemon: "/usr/bin/evil"}})
	if err == nil || err.Error() != "virtiofs daemon /usr/bin/evil required from annotation is not valid" {
		t.Fatalf("got %v", err)
	}
	d, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{AnnotationVirtioFSDaemon: c.QEMU().VirtioFSDaemon}})
	if err != nil || d.Config.QEMU().VirtioFSDaemon != c.QEMU().VirtioFSDaemon {
		t.Fatalf("valid daemon path refused: %v", err)
	}
}

func TestAnnotationsDoNotMutateConfig(t *testing.T) {
	c := policyConfig(t)
	c.QEMU().EnableAnnotations = []string{".*"}
	d, err := Decide(c, Pod{Rootfs: overlayRootfs(), Annotations: map[string]string{
		AnnotationVirtioFSExtraArgs: `["--xattr"]`, AnnotationVirtioFSCache: "always", AnnotationDefaultMemory: "512",
	}})
	if err != nil {
		t.Fatal(err)
	}
	if d.Config.QEMU().VirtioFSCache != "always" || d.Config.QEMU().DefaultMemory != 512 || len(d.Config.QEMU().VirtioFSExtraArgs) != 1 {
		t.Fatalf("not applied: %+v", d.Config.QEMU())
	}
	if c.QEMU().VirtioFSCache != defaultVirtioFSCache || c.QEMU().DefaultMemory != 2048 || len(c.QEMU().VirtioFSExtraArgs) != 0 {
		t.Fatalf("original mutated: %+v", c.QEMU())
	}
	if _, err := Decide(c, Pod{Annotations: map[string]string{AnnotationDefaultMemory: "-1"}}); err == nil || !strings.Contains(err.Error(), "Please specify positive numeric value") {
		t.Fatalf("bad number: %v", err)
	}
}
