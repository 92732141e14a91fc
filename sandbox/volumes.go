package sandbox

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
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
func (v *volumeSharer) shareBind(m specs.Mount, o virtiofs.VolumeOptions) (string, bool, error) {
	shared, guestDir, st, err := v.s.backend.volumeShare(v.ctx)
	if err != nil {
		return "", false, err
	}
	o.SourceMounts = v.s.hostMounts
	vol, err := shared.ShareVolume(v.cid, m.Source, m.Destination, o)
	if err != nil {
		return "", false, err
	}
	v.vols = append(v.vols, vol)
	if st != nil {
		v.storage = st
	}
	return guestDir + vol.Name, vol.WritableBelow, nil
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
	err := v.s.backend.unshareVolumes(v.vols)
	v.vols = nil
	return err
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
	if err := s.backend.unshareVolumes(vols); err != nil {
		return fmt.Errorf("container %s: %w", cid, err)
	}
	return nil
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
