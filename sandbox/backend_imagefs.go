package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/containerd/log"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// imagefsBackend builds each container's rootfs into an imagefs-blk disk
// served by this process over vhost-user-blk: the first container's
// cold-plugged at boot, the others' hot-plugged. Host volumes go through a
// virtiofsd of their own (fsShare), started at boot when the policy saw
// volumes, or hot-plugged with the first container that has any.
type imagefsBackend struct {
	// fsShare is the volumes' share; vfsd and shared change only under
	// volMu once the VM runs.
	fsShare
	volumesViaVirtioFS bool
	// daemon is the detected virtiofsd, kept for the volumes' daemon,
	// which may start with the first container that has any.
	daemon    *virtiofs.Daemon
	daemonErr error
	// volMu serialises the start of the volumes share and its teardown;
	// volumesGuestDir is where the guest finds that share ("" until
	// then), volFS its hot-plugged device, and stopped is set by stop so
	// that no share starts after it. Lock order: volMu, then the
	// sandbox's mu. It is held across the start of the volumes'
	// virtiofsd and its hot-plug, waits bounded by the creating request's
	// context, so a second container's volumes wait that long, whatever
	// their own context; no holder of mu waits for volMu (a metrics
	// scrape only tries it).
	volMu           sync.Mutex
	volumesGuestDir string
	volFS           *hypervisor.PluggedFS
	stopped         bool

	// disks are the disks by container id, with the QEMU device each is
	// plugged in as; guarded by the sandbox's mu, with its state, so that
	// no disk is added once Stop collected them.
	disks   map[string]*podDisk
	diskSeq int // numbers disks, their sockets and QEMU ids; under the sandbox's mu
}

func (b *imagefsBackend) Name() string { return config.SharedFSImagefsBlk }

func (b *imagefsBackend) BuildsRootfs() bool { return true }

func (b *imagefsBackend) prepare(ctx context.Context, h *host.Host, vmc *hypervisor.VMConfig, spec Spec) ([]*pb.Storage, error) {
	b.daemon, b.daemonErr = h.Daemon, h.DaemonErr
	var opener index.Opener
	if spec.RootfsLazy != nil {
		opener = spec.RootfsLazy.Opener()
	}
	d, err := b.createDisk(ctx, spec.ID, spec.Rootfs, spec.RootfsIndex, opener)
	if err != nil {
		return nil, err
	}
	c := b.s.cfg.KataFSX.ImagefsBlk
	vmc.Devices = append(vmc.Devices, &hypervisor.VhostUserBlk{ID: d.deviceID, SocketPath: d.Socket, NumQueues: c.NumQueues, QueueSize: c.QueueSize})
	storages := []*pb.Storage{shmStorage()}
	if b.volumesViaVirtioFS {
		st, err := b.startVirtioFS(ctx, h, vmc)
		if err != nil {
			return nil, err
		}
		// The containers' disks are mounted where the share would
		// otherwise go; see guestVolumesMount.
		st.MountPoint = guestVolumesMount
		b.volumesGuestDir = guestVolumesMount
		storages = append(storages, st)
	}
	return storages, nil
}

func (b *imagefsBackend) sharedMemory() bool { return true }

func (b *imagefsBackend) addRootfs(ctx context.Context, c ContainerSpec, lazy *LazyRootfs) (*pb.Storage, string, func() error, error) {
	d, err := b.containerDisk(ctx, c.ID, c.Rootfs, c.RootfsIndex, *lazy)
	if err != nil {
		return nil, "", nil, err
	}
	if d.lazy == *lazy {
		*lazy = nil // the disk reads through it and closes it
	}
	st, root := b.blkStorage(d, c.ID)
	return st, root, func() error { return b.unplugDisk(c.ID) }, nil
}

func (b *imagefsBackend) removeRootfs(cid string, running bool) error {
	if !running {
		return nil
	}
	return b.unplugDisk(cid)
}

// volumeShare starts and hot-plugs the volumes' virtiofsd at the first
// container with volumes, unless the policy started it at boot.
func (b *imagefsBackend) volumeShare(ctx context.Context) (*virtiofs.SharedDir, string, *pb.Storage, error) {
	b.volMu.Lock()
	defer b.volMu.Unlock()
	if b.stopped {
		return nil, "", nil, fmt.Errorf("sandbox %s: volumes: %w", b.s.ID, &StateError{ID: b.s.ID, Op: "share volumes", State: StateStopping})
	}
	if b.volumesGuestDir == "" {
		if err := b.hotplugVolumesFS(ctx); err != nil {
			return nil, "", nil, err
		}
		b.volumesGuestDir = guestVolumesMount
	}
	st := &pb.Storage{Driver: "virtio-fs", Source: sharedTag, Fstype: "virtiofs", MountPoint: b.volumesGuestDir}
	return b.shared, b.volumesGuestDir, st, nil
}

// hotplugVolumesFS starts the volumes' virtiofsd and plugs its device into
// the running VM; volMu is held. On error nothing of it is left.
func (b *imagefsBackend) hotplugVolumesFS(ctx context.Context) (err error) {
	s := b.s
	sock, err := b.startDaemon(ctx, b.daemon, b.daemonErr)
	defer func() {
		if err != nil {
			err = errors.Join(err, b.stopVolumesFS(ctx))
		}
	}()
	if err != nil {
		return err
	}
	// No DAX window: a hot-plugged device's BAR must fit the bridge's
	// window, which a cache of guest-RAM size does not.
	dev := hypervisor.VhostUserFS{ID: volumesFSID, SocketPath: sock, Tag: sharedTag, QueueSize: s.cfg.QEMU().VirtioFSQueueSize}
	b.volFS, err = s.vm.HotplugVhostUserFS(ctx, dev)
	if err != nil {
		b.volFS = nil
		return s.Explain(fmt.Errorf("hot-plug the volumes' virtio-fs device: %w", err))
	}
	vfsd := b.vfsd
	s.watch(func() (<-chan struct{}, func() error) { return vfsd.Done(), vfsd.Err })
	log.G(ctx).WithField("sandbox", s.ID).Infof("volumes: virtiofsd (pid %d) started and %s hot-plugged at PCI path %s", vfsd.Pid(), volumesFSID, b.volFS.Slot.Path)
	return nil
}

// stopVolumesFS stops a volumes virtiofsd whose device never made it
// into the VM and removes its shared directory; volMu is held.
func (b *imagefsBackend) stopVolumesFS(ctx context.Context) error {
	var errs []error
	if b.vfsd != nil {
		if err := b.vfsd.Stop(ctx); err != nil {
			errs = append(errs, err)
		}
		b.vfsd = nil
	}
	if b.shared != nil {
		if err := b.shared.Cleanup(); err != nil {
			errs = append(errs, err)
		}
		b.shared = nil
	}
	return errors.Join(errs...)
}

func (b *imagefsBackend) unshareVolumes(vols []virtiofs.Volume) error {
	if len(vols) == 0 {
		return nil
	}
	b.volMu.Lock()
	defer b.volMu.Unlock()
	if b.shared == nil {
		return nil // stop removed the shared directory, binds and all
	}
	return b.unshare(vols)
}

func (b *imagefsBackend) started(cid string) {
	b.s.mu.Lock()
	var lazy LazyRootfs
	if d := b.disks[cid]; d != nil {
		lazy = d.lazy
	}
	b.s.mu.Unlock()
	if lazy != nil {
		lazy.Started()
	}
}

func (b *imagefsBackend) rootfsServer() string { return roleKataFSX }

// virtiofsd leaves out a volumes' virtiofsd being started: a caller
// during that start does not wait for the hot-plug.
func (b *imagefsBackend) virtiofsd() *virtiofs.Process {
	if !b.volMu.TryLock() {
		return nil
	}
	defer b.volMu.Unlock()
	return b.vfsd
}

// collectMetrics adds per disk (label container) its requests, bytes,
// errors and latency by operation, overlay dirty bytes and build times,
// and per lazy image store its reads by tier.
func (b *imagefsBackend) collectMetrics(set *metrics.Set) {
	s := b.s
	type diskRef struct {
		cid  string
		disk *podDisk
	}
	var disks []diskRef
	s.mu.Lock()
	for cid, d := range b.disks {
		disks = append(disks, diskRef{cid, d})
	}
	s.mu.Unlock()
	sort.Slice(disks, func(i, j int) bool { return disks[i].cid < disks[j].cid })
	for _, d := range disks {
		collectDisk(set, d.cid, d.disk)
	}
	// The first container's store, then each hot-plugged disk's own.
	collectFirstLazy(set, s)
	for _, d := range disks {
		if st, ok := d.disk.lazy.(lazyStatser); ok && d.disk.lazy != s.lazy {
			collectLazy(set, d.cid, st.Stats())
		}
	}
}

// stop stops the volumes' virtiofsd, removes every disk, then the shared
// directory. A volume share being started finishes (or fails, QEMU being
// gone) first, and none starts after.
func (b *imagefsBackend) stop(ctx context.Context) []error {
	b.volMu.Lock()
	defer b.volMu.Unlock()
	b.stopped = true
	var errs []error
	if err := b.stopDaemon(ctx); err != nil {
		errs = append(errs, err)
	}
	b.s.mu.Lock()
	disks := b.disks
	b.disks = map[string]*podDisk{}
	b.s.mu.Unlock()
	for cid, d := range disks {
		if err := d.remove(); err != nil {
			errs = append(errs, fmt.Errorf("container %s disk: %w", cid, err))
		}
	}
	if err := b.cleanup(); err != nil {
		errs = append(errs, err)
	}
	return errs
}
