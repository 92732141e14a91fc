package sandbox

import (
	"context"
	"fmt"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// rawBlkBackend serves a prebuilt raw ext4 image file as the first
// container's rootfs behind QEMU's virtio-blk-pci (BackendVirtioBlk).
type rawBlkBackend struct {
	s *Sandbox
	// rootBlkFor is the container whose rootfs the disk is; set before the boot.
	rootBlkFor string
}

func (b *rawBlkBackend) Name() string { return BackendVirtioBlk }

func (b *rawBlkBackend) BuildsRootfs() bool { return false }

func (b *rawBlkBackend) prepare(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig, spec Spec) ([]*pb.Storage, error) {
	if spec.RootfsBlockFile == "" {
		return nil, fmt.Errorf("sandbox %s: backend %s needs a raw image file as the rootfs", b.s.ID, BackendVirtioBlk)
	}
	q := b.s.cfg.QEMU()
	cache := "writeback"
	if q.BlockDeviceCacheDirect {
		cache = "none"
	}
	vmc.Devices = append(vmc.Devices, &hypervisor.VirtioBlk{ID: rootBlkID, Path: spec.RootfsBlockFile, Format: "raw", Cache: cache, AIO: q.BlockDeviceAIO})
	b.rootBlkFor = spec.ID
	return []*pb.Storage{shmStorage()}, nil
}

func (b *rawBlkBackend) sharedMemory() bool { return false }

func (b *rawBlkBackend) addRootfs(ctx context.Context, c ContainerSpec, lazy *LazyRootfs) (*pb.Storage, string, func() error, error) {
	if c.ID != b.rootBlkFor {
		return nil, "", nil, fmt.Errorf("container %s: backend %s serves only the rootfs of the sandbox's first container (%s)", c.ID, BackendVirtioBlk, b.rootBlkFor)
	}
	path, ok := b.s.vm.Plan().PCIPaths[rootBlkID]
	if !ok {
		return nil, "", nil, fmt.Errorf("container %s: device %s has no PCI path", c.ID, rootBlkID)
	}
	mp := virtiofs.GuestSharedMount + c.ID
	return &pb.Storage{Driver: "blk", Source: string(path), Fstype: "ext4", MountPoint: mp}, mp, nil, nil
}

func (b *rawBlkBackend) removeRootfs(cid string, running bool) error { return nil }

func (b *rawBlkBackend) volumeShare(ctx context.Context) (*virtiofs.SharedDir, string, *pb.Storage, error) {
	return nil, "", nil, fmt.Errorf("backend %s has no shared directory to share host paths through", BackendVirtioBlk)
}

func (b *rawBlkBackend) unshareVolumes(vols []virtiofs.Volume) error { return nil }

func (b *rawBlkBackend) started(cid string) {}

func (b *rawBlkBackend) rootfsServer() string { return roleQEMU }

func (b *rawBlkBackend) virtiofsd() *virtiofs.Process { return nil }

func (b *rawBlkBackend) collectMetrics(set *metrics.Set) { collectFirstLazy(set, b.s) }

func (b *rawBlkBackend) stop(ctx context.Context) []error { return nil }
