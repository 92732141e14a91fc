package config

import (
	"fmt"
	"path/filepath"
	"strings"
)

// Mount is one rootfs mount as containerd hands it to the shim.
type Mount struct {
	Type    string
	Source  string
	Options []string
}

// RootfsKind classifies a container rootfs for the backend policy.
type RootfsKind string

// Rootfs kinds.
const (
	RootfsOverlay RootfsKind = "overlay" // overlayfs snapshot: lowerdir layers plus upperdir
	RootfsDir     RootfsKind = "dir"     // a bind snapshot or a plain directory: one layer
	RootfsImage   RootfsKind = "image"   // an image the imagefs-blk store knows by reference
	RootfsOther   RootfsKind = "other"   // anything else (block devices, FUSE snapshotters)
)

// Rootfs describes a container's root filesystem.
type Rootfs struct {
	Kind RootfsKind
	// Layers are the layer directories, lowest first (overlay lowerdirs
	// reversed, then upperdir), or the one directory of a dir rootfs.
	Layers []string
	// UpperDir is the overlay's writable layer, if any.
	UpperDir string
	// ImageRef names the image for RootfsImage.
	ImageRef string
	// Why says, for RootfsOther, what makes it unindexable.
	Why string
}

// RootfsFromMounts describes the rootfs containerd passes in a Create
// request; dir is the bundle's rootfs directory, used when there are no mounts.
func RootfsFromMounts(mounts []Mount, dir string) Rootfs {
	if len(mounts) == 0 {
		if dir == "" {
			return Rootfs{Kind: RootfsOther, Why: "no rootfs mounts and no rootfs directory"}
		}
		return Rootfs{Kind: RootfsDir, Layers: []string{dir}}
	}
	if len(mounts) > 1 {
		return Rootfs{Kind: RootfsOther, Why: fmt.Sprintf("%d stacked rootfs mounts", len(mounts))}
	}
	m := mounts[0]
	switch m.Type {
	case "overlay":
		var r Rootfs
		r.Kind = RootfsOverlay
		for _, o := range m.Options {
			k, v, _ := strings.Cut(o, "=")
			switch k {
			case "lowerdir":
				lowers := strings.Split(v, ":")
				for i := len(lowers) - 1; i >= 0; i-- {
					r.Layers = append(r.Layers, lowers[i])
				}
			case "upperdir":
				r.UpperDir = v
			}
		}
		if r.UpperDir != "" {
			r.Layers = append(r.Layers, r.UpperDir)
		}
		if len(r.Layers) == 0 {
			return Rootfs{Kind: RootfsOther, Why: "overlay mount without lowerdir"}
		}
		for _, l := range r.Layers {
			if !filepath.IsAbs(l) {
				return Rootfs{Kind: RootfsOther, Why: fmt.Sprintf("overlay layer %q is not an absolute path", l)}
			}
		}
		return r
	case "bind", "rbind", "none", "":
		if !filepath.IsAbs(m.Source) {
			return Rootfs{Kind: RootfsOther, Why: fmt.Sprintf("bind source %q is not an absolute path", m.Source)}
		}
		return Rootfs{Kind: RootfsDir, Layers: []string{m.Source}}
	}
	return Rootfs{Kind: RootfsOther, Why: fmt.Sprintf("%s mount of %s cannot be indexed", m.Type, m.Source)}
}

// Indexable reports whether imagefs-blk can build a disk from r.
func (r Rootfs) Indexable() bool { return r.Kind != RootfsOther && r.Kind != "" }

// Pod is what the policy looks at: its annotations, its rootfs and its
// host-directory volumes.
type Pod struct {
	Annotations map[string]string
	Rootfs      Rootfs
	HostVolumes []string
}

// Decision is the backend the policy picked for a pod and why.
type Decision struct {
	Backend string // virtio-fs, virtio-9p or imagefs-blk
	Reason  string
	// VolumesViaVirtioFS is set when an imagefs-blk pod also needs
	// virtiofsd, for its host-directory volumes only.
	VolumesViaVirtioFS bool
	// Config is the configuration with the pod's annotations applied.
	Config *Config
}

// Decide picks the filesystem backend of a pod from the configuration, its
// annotations and its rootfs, and says why in words an operator can act on.
func Decide(c *Config, pod Pod) (Decision, error) {
	eff, err := ApplyAnnotations(c, pod.Annotations)
	if err != nil {
		return Decision{}, err
	}
	fs := eff.SharedFS()
	from := eff.SharedFSKey()
	if _, ok := eff.Annotated[AnnotationSharedFS]; ok {
		from = "annotation " + AnnotationSharedFS
	}
	d := Decision{Config: eff}
	switch fs {
	case SharedFSVirtioFS, SharedFS9P:
		d.Backend = fs
		d.Reason = fmt.Sprintf("%s = %q", from, fs)
		return d, nil
	case SharedFSImagefsBlk:
		if !pod.Rootfs.Indexable() {
			return Decision{}, &Error{Key: from, Value: fs,
				Problem: "the rootfs cannot be indexed: " + pod.Rootfs.Why,
				Fix:     "use the overlayfs or native snapshotter, or shared_fs = \"auto\" to fall back to virtio-fs"}
		}
		d.Backend = SharedFSImagefsBlk
		d.Reason = fmt.Sprintf("%s = %q and the %s rootfs can be indexed", from, fs, pod.Rootfs.Kind)
	case SharedFSAuto:
		if !pod.Rootfs.Indexable() {
			d.Backend = SharedFSVirtioFS
			d.Reason = fmt.Sprintf("%s = \"auto\" and the rootfs cannot be indexed (%s): virtio-fs", from, pod.Rootfs.Why)
			return d, nil
		}
		d.Backend = SharedFSImagefsBlk
		d.Reason = fmt.Sprintf("%s = \"auto\" and the %s rootfs can be indexed (%d layers): imagefs-blk", from, pod.Rootfs.Kind, len(pod.Rootfs.Layers))
	default:
		return Decision{}, &Error{Key: from, Value: fs, Problem: "unknown shared filesystem",
			Fix: "use virtio-fs, virtio-9p, imagefs-blk or auto"}
	}
	if len(pod.HostVolumes) > 0 {
		if eff.QEMU().VirtioFSDaemon == "" {
			return Decision{}, &Error{Key: "hypervisor.qemu.virtio_fs_daemon",
				Problem: fmt.Sprintf("the pod's host-directory volumes (%s) need virtio-fs beside imagefs-blk, but no daemon is configured", strings.Join(pod.HostVolumes, ", ")),
				Fix:     "set virtio_fs_daemon"}
		}
		d.VolumesViaVirtioFS = true
		d.Reason += fmt.Sprintf("; its %d host-directory volume(s) (%s) also need virtio-fs, so virtiofsd runs for the volumes only",
			len(pod.HostVolumes), strings.Join(pod.HostVolumes, ", "))
	}
	return d, nil
}
