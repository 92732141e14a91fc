package sandbox

import (
	"context"
	"fmt"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// shareBackend shares each container's rootfs directory, mounted on the
// host, through the sandbox's shared directory: virtio-fs (virtiofsd) or
// virtio-9p (QEMU's own server). Its daemon and directory are set up
// before the boot and never change after it.
type shareBackend struct {
	fsShare
	ninep bool // virtio-9p rather than virtio-fs
}

func (b *shareBackend) Name() string {
	if b.ninep {
		return config.SharedFS9P
	}
	return config.SharedFSVirtioFS
}

func (b *shareBackend) BuildsRootfs() bool { return false }

func (b *shareBackend) prepare(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig, spec Spec) ([]*pb.Storage, error) {
	shm := shmStorage()
	if !b.ninep {
		st, err := b.startVirtioFS(ctx, h, vmc)
		if err != nil {
			return nil, err
		}
		return []*pb.Storage{st, shm}, nil
	}
	q := b.s.cfg.QEMU()
	var err error
	if b.shared, err = virtiofs.NewSharedDir(b.s.Dir); err != nil {
		return nil, err
	}
	vmc.Devices = append(vmc.Devices, &hypervisor.Virtio9P{ID: "virtio-9p-0", Path: b.shared.Root, MountTag: sharedTag})
	st := &pb.Storage{Driver: "9p", Source: sharedTag, Fstype: "9p", MountPoint: virtiofs.GuestSharedMount,
		Options: []string{"trans=virtio", "version=9p2000.L", fmt.Sprintf("msize=%d", q.Msize9p), "cache=mmap"}}
	return []*pb.Storage{st, shm}, nil
}

func (b *shareBackend) sharedMemory() bool { return false }

func (b *shareBackend) addRootfs(ctx context.Context, c ContainerSpec, lazy *LazyRootfs) (*pb.Storage, string, func() error, error) {
	// Shared writable even for a read-only root: the agent makes the
	// mount points of the container's mounts (a CRI sandbox's
	// /etc/resolv.conf) in the rootfs before it makes the root
	// read-only in the guest, as runc and Kata's agent do. The binds
	// stay nosuid and nodev, and only the rootfs itself is writable.
	root, err := b.shared.BindRootfs(c.ID, c.RootfsDir, false)
	if err != nil {
		return nil, "", nil, err
	}
	return nil, root, nil, nil
}

func (b *shareBackend) removeRootfs(cid string, running bool) error {
	if b.shared == nil {
		return nil
	}
	return b.shared.Unbind(cid)
}

func (b *shareBackend) volumeShare(ctx context.Context) (*virtiofs.SharedDir, string, *pb.Storage, error) {
	return b.shared, virtiofs.GuestSharedMount, nil, nil
}

func (b *shareBackend) unshareVolumes(vols []virtiofs.Volume) error { return b.unshare(vols) }

func (b *shareBackend) started(cid string) {}

func (b *shareBackend) rootfsServer() string {
	if b.ninep {
		return roleQEMU
	}
	return roleVirtiofsd
}

func (b *shareBackend) virtiofsd() *virtiofs.Process { return b.vfsd }

func (b *shareBackend) collectMetrics(set *metrics.Set) { collectFirstLazy(set, b.s) }

func (b *shareBackend) stop(ctx context.Context) []error {
	var errs []error
	if err := b.stopDaemon(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := b.cleanup(); err != nil {
		errs = append(errs, err)
	}
	return errs
}
