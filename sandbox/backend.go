package sandbox

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// Backend is how a pod's container root filesystems and host volumes
// reach its guest, as Kata's FilesystemSharer: a shared directory
// (virtio-fs, virtio-9p), imagefs-blk disks, or a raw virtio-blk image.
// newBackend makes one per sandbox; nothing else looks at the backend's
// name to decide what to do.
type Backend interface {
	// Name is the backend as the policy and --backend spell it.
	Name() string
	// BuildsRootfs reports whether the backend builds each container's
	// rootfs into a disk from its layers (a lazy image's included), so
	// that the rootfs is not mounted on the host.
	BuildsRootfs() bool

	// prepare starts what the backend needs on the host before the VM
	// boots, adds its devices to vmc and returns the storages the agent
	// mounts at CreateSandbox.
	prepare(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig, spec Spec) ([]*pb.Storage, error)
	// sharedMemory reports whether the backend is a vhost-user device
	// that maps guest RAM.
	sharedMemory() bool
	// addRootfs shares container c's rootfs with the guest. It returns the
	// storage the agent mounts first (nil for none), the guest path of the
	// root, and undo, which releases the share when the container's
	// creation fails later (nil for nothing to undo). A lazy store it
	// takes over is set to nil in *lazy.
	addRootfs(ctx context.Context, c ContainerSpec, lazy *LazyRootfs) (st *pb.Storage, root string, undo func() error, err error)
	// removeRootfs releases a removed container's rootfs share; running
	// says whether the VM still runs, for what only the guest can let go.
	removeRootfs(cid string, running bool) error
	// volumeShare returns the shared directory host volumes are bound
	// into, the guest directory it appears under, and the storage a
	// container using it mounts (nil when the sandbox's storages have it).
	volumeShare(ctx context.Context) (*virtiofs.SharedDir, string, *pb.Storage, error)
	// unshareVolumes removes volume binds volumeShare's directory holds.
	unshareVolumes(vols []virtiofs.Volume) error
	// started tells the backend container cid's process runs.
	started(cid string)
	// rootfsServer is the role (ProcessRef.Role) of the host process
	// that reads the rootfs's bytes for the guest.
	rootfsServer() string
	// virtiofsd is the backend's running virtiofsd; nil for none.
	virtiofsd() *virtiofs.Process
	// collectMetrics adds the backend's own series (disks, lazy stores).
	collectMetrics(set *metrics.Set)
	// stop stops the backend's daemons and removes its disks and shared
	// directory; the VM is gone.
	stop(ctx context.Context) []error
}

// shmStorage is the guest's /dev/shm for the sandbox's containers.
func shmStorage() *pb.Storage {
	return &pb.Storage{Driver: "ephemeral", Source: "shm", Fstype: "tmpfs", MountPoint: guestSandboxShm, Options: []string{"noexec", "nosuid", "nodev", "mode=1777", "size=67108864"}}
}

// newBackend is the backend of a sandbox with decision d; it is the only
// place a backend's name picks code.
func newBackend(s *Sandbox, d config.Decision) (Backend, error) {
	switch d.Backend {
	case config.SharedFSVirtioFS:
		return &shareBackend{fsShare: fsShare{s: s}}, nil
	case config.SharedFS9P:
		return &shareBackend{fsShare: fsShare{s: s}, ninep: true}, nil
	case config.SharedFSImagefsBlk:
		return &imagefsBackend{fsShare: fsShare{s: s}, volumesViaVirtioFS: d.VolumesViaVirtioFS, disks: map[string]*podDisk{}}, nil
	case BackendVirtioBlk:
		return &rawBlkBackend{s: s}, nil
	}
	return nil, fmt.Errorf("sandbox %s: backend %s is not wired into the sandbox yet", s.ID, d.Backend)
}

// fsShare is a shared directory on the host and the virtiofsd serving it.
type fsShare struct {
	s      *Sandbox
	vfsd   *virtiofs.Process
	shared *virtiofs.SharedDir
}

// startVirtioFS runs virtiofsd on the sandbox's shared directory and adds
// the vhost-user-fs device; it returns the storage the agent mounts.
func (f *fsShare) startVirtioFS(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig) (*pb.Storage, error) {
	q := f.s.cfg.QEMU()
	sock, err := f.startDaemon(ctx, h.Daemon, h.DaemonErr)
	if err != nil {
		return nil, err
	}
	f.s.watch(func() (<-chan struct{}, func() error) { return f.vfsd.Done(), f.vfsd.Err })
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
func (f *fsShare) startDaemon(ctx context.Context, daemon *virtiofs.Daemon, daemonErr error) (string, error) {
	s := f.s
	q := s.cfg.QEMU()
	var err error
	if daemon == nil {
		if daemonErr == nil {
			return "", fmt.Errorf("sandbox %s: backend %s needs virtiofsd: hypervisor.qemu.virtio_fs_daemon is not set", s.ID, s.Decision.Backend)
		}
		return "", fmt.Errorf("sandbox %s: %w", s.ID, daemonErr)
	}
	if f.shared, err = virtiofs.NewSharedDir(s.Dir); err != nil {
		return "", err
	}
	sock := filepath.Join(s.Dir, "vhost-fs.sock")
	f.vfsd, err = virtiofs.Start(ctx, virtiofs.Options{Daemon: daemon, SharedDir: f.shared.Root, Cache: q.VirtioFSCache, ExtraArgs: q.VirtioFSExtraArgs}, sock)
	if err != nil {
		return "", fmt.Errorf("sandbox %s: %w", s.ID, err)
	}
	return sock, nil
}

// stopDaemon stops the virtiofsd, if one runs.
func (f *fsShare) stopDaemon(ctx context.Context) error {
	if f.vfsd == nil {
		return nil
	}
	if err := f.vfsd.Stop(ctx); err != nil {
		return fmt.Errorf("stop virtiofsd: %w", err)
	}
	return nil
}

// cleanup removes the shared directory, if there is one.
func (f *fsShare) cleanup() error {
	if f.shared == nil {
		return nil
	}
	return f.shared.Cleanup()
}

// unshare removes volume binds from the shared directory.
func (f *fsShare) unshare(vols []virtiofs.Volume) error {
	var errs []error
	for _, vol := range vols {
		if err := f.shared.UnshareVolume(vol); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// collectFirstLazy adds the series of the first container's lazy store.
func collectFirstLazy(set *metrics.Set, s *Sandbox) {
	if st, ok := s.lazy.(lazyStatser); ok {
		collectLazy(set, s.ID, st.Stats())
	}
}
