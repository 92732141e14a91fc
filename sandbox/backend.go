package sandbox

import (
	"context"
	"fmt"
	"path/filepath"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// prepareBackend starts what the chosen backend needs on the host, adds
// its device to the VM and returns the storages the agent mounts.
func (s *Sandbox) prepareBackend(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig, spec Spec) ([]*pb.Storage, error) {
	q := s.cfg.QEMU()
	shm := &pb.Storage{Driver: "ephemeral", Source: "shm", Fstype: "tmpfs", MountPoint: guestSandboxShm, Options: []string{"noexec", "nosuid", "nodev", "mode=1777", "size=67108864"}}
	switch s.Decision.Backend {
	case config.SharedFSImagefsBlk:
		var opener index.Opener
		if spec.RootfsLazy != nil {
			opener = spec.RootfsLazy.Opener()
		}
		d, err := s.createDisk(ctx, spec.ID, spec.Rootfs, spec.RootfsIndex, opener)
		if err != nil {
			return nil, err
		}
		b := s.cfg.KataFSX.ImagefsBlk
		vmc.Devices = append(vmc.Devices, &hypervisor.VhostUserBlk{ID: d.deviceID, SocketPath: d.Socket, NumQueues: b.NumQueues, QueueSize: b.QueueSize})
		storages := []*pb.Storage{shm}
		if s.Decision.VolumesViaVirtioFS {
			st, err := s.startVirtioFS(ctx, h, vmc)
			if err != nil {
				return nil, err
			}
			// The containers' disks are mounted where the share would
			// otherwise go; see guestVolumesMount.
			st.MountPoint = guestVolumesMount
			s.volumesGuestDir = guestVolumesMount
			storages = append(storages, st)
		}
		return storages, nil
	case config.SharedFSVirtioFS:
		st, err := s.startVirtioFS(ctx, h, vmc)
		if err != nil {
			return nil, err
		}
		return []*pb.Storage{st, shm}, nil
	case BackendVirtioBlk:
		if spec.RootfsBlockFile == "" {
			return nil, fmt.Errorf("sandbox %s: backend %s needs a raw image file as the rootfs", s.ID, BackendVirtioBlk)
		}
		cache := "writeback"
		if q.BlockDeviceCacheDirect {
			cache = "none"
		}
		vmc.Devices = append(vmc.Devices, &hypervisor.VirtioBlk{ID: rootBlkID, Path: spec.RootfsBlockFile, Format: "raw", Cache: cache, AIO: q.BlockDeviceAIO})
		s.rootBlkFor = spec.ID
		return []*pb.Storage{shm}, nil
	case config.SharedFS9P:
		var err error
		if s.shared, err = virtiofs.NewSharedDir(s.Dir); err != nil {
			return nil, err
		}
		vmc.Devices = append(vmc.Devices, &hypervisor.Virtio9P{ID: "virtio-9p-0", Path: s.shared.Root, MountTag: sharedTag})
		st := &pb.Storage{Driver: "9p", Source: sharedTag, Fstype: "9p", MountPoint: virtiofs.GuestSharedMount,
			Options: []string{"trans=virtio", "version=9p2000.L", fmt.Sprintf("msize=%d", q.Msize9p), "cache=mmap"}}
		return []*pb.Storage{st, shm}, nil
	}
	return nil, fmt.Errorf("sandbox %s: backend %s is not wired into the sandbox yet", s.ID, s.Decision.Backend)
}

// startVirtioFS runs virtiofsd on the sandbox's shared directory and adds
// the vhost-user-fs device; it returns the storage the agent mounts.
func (s *Sandbox) startVirtioFS(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig) (*pb.Storage, error) {
	q := s.cfg.QEMU()
	sock, err := s.startDaemon(ctx, h.Daemon, h.DaemonErr)
	if err != nil {
		return nil, err
	}
	s.watch(func() (<-chan struct{}, func() error) { return s.vfsd.Done(), s.vfsd.Err })
	vmc.Devices = append(vmc.Devices, &hypervisor.VhostUserFS{ID: "vhost-user-fs-0", SocketPath: sock, Tag: sharedTag,
		QueueSize: q.VirtioFSQueueSize, DAXWindowMiB: uint64(q.VirtioFSCacheSize)})
	st := &pb.Storage{Driver: "virtio-fs", Source: sharedTag, Fstype: "virtiofs", MountPoint: virtiofs.GuestSharedMount}
	if q.VirtioFSCacheSize > 0 {
		st.Options = []string{"dax"}
	}
	return st, nil
}

// startDaemon creates the sandbox's shared directory and runs virtiofsd on
// it; it returns the daemon's vhost-user socket. The caller watches the
// daemon once its device is in the VM.
func (s *Sandbox) startDaemon(ctx context.Context, daemon *virtiofs.Daemon, daemonErr error) (string, error) {
	q := s.cfg.QEMU()
	var err error
	if daemon == nil {
		if daemonErr == nil {
			return "", fmt.Errorf("sandbox %s: backend %s needs virtiofsd: hypervisor.qemu.virtio_fs_daemon is not set", s.ID, s.Decision.Backend)
		}
		return "", fmt.Errorf("sandbox %s: %w", s.ID, daemonErr)
	}
	if s.shared, err = virtiofs.NewSharedDir(s.Dir); err != nil {
		return "", err
	}
	sock := filepath.Join(s.Dir, "vhost-fs.sock")
	s.vfsd, err = virtiofs.Start(ctx, virtiofs.Options{Daemon: daemon, SharedDir: s.shared.Root, Cache: q.VirtioFSCache, ExtraArgs: q.VirtioFSExtraArgs}, sock)
	if err != nil {
		return "", fmt.Errorf("sandbox %s: %w", s.ID, err)
	}
	return sock, nil
}
