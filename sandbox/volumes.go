package sandbox

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// guestVolumesMount is where an imagefs-blk pod's guest mounts the share
// of its volumes. Kata mounts its share on GuestSharedMount before any
// block rootfs is mounted below it; imagefs-blk mounts its disks there
// first and plugs the share later, and a share mounted over that
// directory would hide the disks of the running containers.
const guestVolumesMount = "/run/kata-containers/shared/volumes/"

// guestEphemeral is where the guest keeps emptyDirs of medium Memory, as
// tmpfs (Kata's ephemeral storage).
const guestEphemeral = "/run/kata-containers/sandbox/ephemeral"

// volumesFSID is the QEMU id of an imagefs-blk pod's volumes share.
const volumesFSID = "vhost-user-fs-vol"

// volumeSharer shares a container's host binds with the guest.
type volumeSharer struct {
	s   *Sandbox
	ctx context.Context
	cid string
	// vols are the binds made for the container so far.
	vols []virtiofs.Volume
	// storage is the volumes share an imagefs-blk container mounts.
	storage *pb.Storage
}

// shareBind binds the mount's source into the shared directory and
// returns where the guest finds it.
func (v *volumeSharer) shareBind(m specs.Mount, o virtiofs.VolumeOptions) (string, error) {
	shared, guestDir, st, err := v.s.volumeShare(v.ctx)
	if err != nil {
		return "", err
	}
	vol, err := shared.ShareVolume(v.cid, m.Source, m.Destination, o)
	if err != nil {
		return "", err
	}
	v.vols = append(v.vols, vol)
	if st != nil {
		v.storage = st
	}
	return guestDir + vol.Name, nil
}

// memoryEmptyDir reports whether src is a Kubernetes emptyDir of medium
// Memory, as Kata recognises one: a .../kubernetes.io~empty-dir/<name>
// that is a tmpfs mount point. Its group (fsGroup) comes along.
func (v *volumeSharer) memoryEmptyDir(src string) (uint32, bool) {
	src = filepath.Clean(src)
	if filepath.Base(filepath.Dir(src)) != "kubernetes.io~empty-dir" {
		return 0, false
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(src, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		return 0, false
	}
	mps, err := mount.Under(src)
	if err != nil || len(mps) == 0 || mps[0] != src {
		return 0, false
	}
	var st syscall.Stat_t
	if err := syscall.Stat(src, &st); err != nil {
		return 0, false
	}
	return st.Gid, true
}

// undo removes the binds made so far, for a container that failed.
func (v *volumeSharer) undo() error {
	var errs []error
	for _, vol := range v.vols {
		if err := v.s.shared.UnshareVolume(vol); err != nil {
			errs = append(errs, err)
		}
	}
	v.vols = nil
	return errors.Join(errs...)
}

// volumeShare returns the shared directory volumes are bound into, the
// guest directory it appears under and, on imagefs-blk, the storage a
// container using it mounts. An imagefs-blk pod's virtiofsd is started
// and hot-plugged here, at its first container with volumes.
func (s *Sandbox) volumeShare(ctx context.Context) (*virtiofs.SharedDir, string, *pb.Storage, error) {
	switch s.Decision.Backend {
	case config.SharedFSVirtioFS, config.SharedFS9P:
		return s.shared, virtiofs.GuestSharedMount, nil, nil
	case config.SharedFSImagefsBlk:
	default:
		return nil, "", nil, fmt.Errorf("backend %s has no shared directory to share host paths through", s.Decision.Backend)
	}
	s.volMu.Lock()
	defer s.volMu.Unlock()
	if s.volumesGuestDir == "" {
		if err := s.hotplugVolumesFS(ctx); err != nil {
			return nil, "", nil, err
		}
		s.volumesGuestDir = guestVolumesMount
	}
	st := &pb.Storage{Driver: "virtio-fs", Source: sharedTag, Fstype: "virtiofs", MountPoint: s.volumesGuestDir}
	return s.shared, s.volumesGuestDir, st, nil
}

// hotplugVolumesFS starts the virtiofsd of an imagefs-blk pod's volumes
// and plugs its device into the running VM. On error nothing of it is
// left.
func (s *Sandbox) hotplugVolumesFS(ctx context.Context) (err error) {
	sock, err := s.startDaemon(ctx, s.daemon, s.daemonErr)
	defer func() {
		if err != nil {
			err = errors.Join(err, s.stopVolumesFS(ctx))
		}
	}()
	if err != nil {
		return err
	}
	// No DAX window: a hot-plugged device's BAR must fit the bridge's
	// window, which a cache of guest-RAM size does not.
	dev := hypervisor.VhostUserFS{ID: volumesFSID, SocketPath: sock, Tag: sharedTag, QueueSize: s.cfg.QEMU().VirtioFSQueueSize}
	s.volFS, err = s.vm.HotplugVhostUserFS(ctx, dev)
	if err != nil {
		s.volFS = nil
		return s.Explain(fmt.Errorf("hot-plug the volumes' virtio-fs device: %w", err))
	}
	s.watch(func() (<-chan struct{}, func() error) { return s.vfsd.Done(), s.vfsd.Err })
	log.G(ctx).WithField("sandbox", s.ID).Infof("volumes: virtiofsd (pid %d) started and %s hot-plugged at PCI path %s", s.vfsd.Pid(), volumesFSID, s.volFS.Slot.Path)
	return nil
}

// stopVolumesFS stops a volumes virtiofsd whose device never made it
// into the VM and removes its shared directory.
func (s *Sandbox) stopVolumesFS(ctx context.Context) error {
	var errs []error
	if s.vfsd != nil {
		if err := s.vfsd.Stop(ctx); err != nil {
			errs = append(errs, err)
		}
		s.vfsd = nil
	}
	if s.shared != nil {
		if err := s.shared.Cleanup(); err != nil {
			errs = append(errs, err)
		}
		s.shared = nil
	}
	return errors.Join(errs...)
}

// containerMounts turns a container's OCI mounts into the agent's, sharing
// its host binds; it returns the storages they need and the sharer, whose
// binds RemoveContainer (or undo, on error) removes.
func (s *Sandbox) containerMounts(ctx context.Context, cid string, oci *specs.Spec) ([]*pb.Mount, []*pb.Storage, *volumeSharer, error) {
	v := &volumeSharer{s: s, ctx: ctx, cid: cid}
	if oci == nil {
		return nil, nil, v, nil
	}
	mounts, storages, err := guestMounts(oci.Mounts, v)
	if err != nil {
		return nil, nil, nil, errors.Join(fmt.Errorf("container %s: %w", cid, err), v.undo())
	}
	if v.storage != nil {
		// The share is mounted before the binds of it are made.
		storages = append([]*pb.Storage{v.storage}, storages...)
	}
	return mounts, storages, v, nil
}

// keepVolumes records a created container's binds for RemoveContainer.
func (s *Sandbox) keepVolumes(cid string, v *volumeSharer) {
	if len(v.vols) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.volumes[cid] = append(s.volumes[cid], v.vols...)
}

// removeVolumes removes a container's binds from the shared directory.
func (s *Sandbox) removeVolumes(cid string) error {
	s.mu.Lock()
	vols := s.volumes[cid]
	delete(s.volumes, cid)
	s.mu.Unlock()
	var errs []error
	for _, vol := range vols {
		if err := s.shared.UnshareVolume(vol); err != nil {
			errs = append(errs, fmt.Errorf("container %s: %w", cid, err))
		}
	}
	return errors.Join(errs...)
}

// mountName names an OCI mount in errors.
func mountName(m specs.Mount) string {
	var b strings.Builder
	fmt.Fprintf(&b, "mount %s", m.Destination)
	if m.Type != "" {
		fmt.Fprintf(&b, " (type %s", m.Type)
	} else {
		b.WriteString(" (no type")
	}
	if m.Source != "" {
		fmt.Fprintf(&b, ", source %s", m.Source)
	}
	b.WriteString(")")
	return b.String()
}
