package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// sharedTag is the mount tag of the shared directory, Kata's.
const sharedTag = "kataShared"

// SandboxSpec is what is known about a pod before its VM boots.
type SandboxSpec struct {
	ID          string
	Config      *config.Config // as loaded; annotations are applied here
	Annotations map[string]string
	// Rootfs describes the first container's rootfs, which the policy looks at.
	Rootfs      config.Rootfs
	HostVolumes []string
	Hostname    string
	// Backend, when set, overrides the policy (kata-fsx run --backend).
	Backend string
	// RootfsIndex, when set, is the first container's rootfs already
	// indexed (an OCI image); otherwise imagefs-blk indexes Rootfs.Layers.
	RootfsIndex *index.Index
	// RootfsBlockFile is the first container's rootfs as a raw ext4 image
	// file, for BackendVirtioBlk.
	RootfsBlockFile string
}

// BackendVirtioBlk serves a prebuilt raw ext4 image file as the first
// container's rootfs behind QEMU's own virtio-blk-pci, the way Kata hands
// a block-device rootfs to the guest. The policy never picks it: it is
// what `kata-fsx run --backend virtio-blk` and the benchmarks' ceiling use.
const BackendVirtioBlk = "virtio-blk"

// rootBlkID is the QEMU id of a BackendVirtioBlk rootfs disk.
const rootBlkID = "rootfs-blk-0"

// Sandbox is a running pod VM with its filesystem backend and agent connection.
type Sandbox struct {
	ID       string
	Dir      string
	Decision config.Decision

	cfg    *config.Config
	vm     *hypervisor.VM
	vfsd   *virtiofs.Process
	shared *virtiofs.SharedDir
	agent  *agent.Client
	// life is the sandbox's lifetime, for what runs beyond one request
	// (the disks' vhost-user servers); Stop ends it.
	life     context.Context
	lifeStop context.CancelFunc

	mu sync.Mutex // guards the fields below
	// disks are the imagefs-blk disks by container id, with the QEMU
	// device each is plugged in as.
	disks map[string]*podDisk
	// rootBlkFor is the container whose rootfs is the BackendVirtioBlk disk.
	rootBlkFor string
	diskSeq    int  // numbers disks, their sockets and QEMU ids
	stopping   bool // Stop began: no new disk may be registered

	failOnce sync.Once
	failed   chan struct{}
	failErr  error

	stopOnce sync.Once
	stopErr  error
	watchers sync.WaitGroup
	done     chan struct{} // closed by Stop so watchers exit
}

// ErrSandboxFailed is wrapped by errors caused by the death of the VM or of
// a backend daemon while the pod runs.
var ErrSandboxFailed = errors.New("sandbox failed")

// validSandboxID keeps ids usable as directory names and QEMU ids.
func validSandboxID(id string) error {
	if id == "" || len(id) > 64 || strings.ContainsAny(id, "/\x00 ,") || id == "." || id == ".." {
		return fmt.Errorf("invalid sandbox id %q", id)
	}
	return nil
}

// NewSandbox decides the pod's backend, prepares it, boots the VM, connects
// to the agent and creates the sandbox in the guest. On error nothing is
// left behind.
func NewSandbox(ctx context.Context, spec SandboxSpec) (_ *Sandbox, err error) {
	if err := validSandboxID(spec.ID); err != nil {
		return nil, err
	}
	d, err := config.Decide(spec.Config, config.Pod{Annotations: spec.Annotations, Rootfs: spec.Rootfs, HostVolumes: spec.HostVolumes})
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	if spec.Backend != "" {
		d.Backend, d.Reason = spec.Backend, "requested explicitly (--backend "+spec.Backend+")"
	}
	cfg := d.Config
	s := &Sandbox{
		ID: spec.ID, Decision: d, cfg: cfg,
		Dir:    filepath.Join(cfg.KataFSX.StateDir, spec.ID),
		failed: make(chan struct{}), done: make(chan struct{}),
		disks: map[string]*podDisk{},
	}
	s.life, s.lifeStop = context.WithCancel(context.WithoutCancel(ctx))
	log.G(ctx).WithField("sandbox", spec.ID).Infof("backend %s: %s", d.Backend, d.Reason)
	defer func() {
		if err != nil {
			_ = s.Stop(context.Background())
		}
	}()
	host, err := probe(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := config.Validate(cfg, host.facts); err != nil {
		return nil, fmt.Errorf("sandbox %s: configuration: %w", spec.ID, err)
	}
	if err := hypervisor.MakeVMDir(s.Dir); err != nil {
		return nil, err
	}
	q := cfg.QEMU()
	vmc := &hypervisor.VMConfig{
		Name: "sandbox-" + spec.ID,
		// QEMU's directory is its own: the hypervisor removes it whole on
		// stop, and it must never hold the shared/ mounts.
		Dir:          filepath.Join(s.Dir, "vm"),
		QEMUPath:     q.Path,
		Caps:         host.caps,
		MachineType:  q.MachineType,
		Accel:        host.accel,
		VCPUs:        uint32(q.DefaultVCPUs),
		MemoryMiB:    uint64(q.DefaultMemory),
		Kernel:       q.Kernel,
		Initrd:       q.Initrd,
		KernelParams: strings.Fields(q.KernelParams),
		Debug:        q.EnableDebug || cfg.AgentKata().EnableDebug,
		ConsoleLog:   filepath.Join(s.Dir, "console.log"),
		HotplugSlots: 8,
	}
	if cfg.NeedsSharedMemory() || d.Backend == config.SharedFSImagefsBlk {
		vmc.SharedMemory = hypervisor.SharedMemoryFile
		if q.FileMemBackend != "" {
			vmc.MemPath = q.FileMemBackend
		}
	}
	var transport agent.Transport
	if host.vsock {
		return nil, fmt.Errorf("sandbox %s: vsock agent transport is not wired yet; set kata_fsx.agent_transport = \"virtio-serial\"", spec.ID)
	}
	sock := filepath.Join(s.Dir, "agent.sock")
	vmc.Agent = hypervisor.AgentChannel{Transport: hypervisor.AgentSerial, SocketPath: sock}
	transport = agent.SerialTransport{Path: sock}

	storages, err := s.prepareBackend(ctx, host, vmc, spec)
	if err != nil {
		return nil, err
	}
	s.vm, err = hypervisor.Start(ctx, vmc)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: start QEMU: %w", spec.ID, err)
	}
	s.watch(func() (<-chan struct{}, func() error) { return s.vm.Exited(), s.vm.Wait })
	timeout := time.Duration(cfg.AgentKata().DialTimeout) * time.Second
	dialCtx, cancel := context.WithCancel(ctx)
	go func() {
		// A pod that dies while we dial fails the dial at once, not after dial_timeout.
		select {
		case <-s.failed:
			cancel()
		case <-dialCtx.Done():
		}
	}()
	s.agent, err = agent.Dial(dialCtx, transport, timeout)
	cancel()
	if err != nil {
		return nil, s.explain(fmt.Errorf("sandbox %s: guest agent: %w%s", spec.ID, err, s.consoleTail()))
	}
	req := &pb.CreateSandboxRequest{Hostname: spec.Hostname, SandboxId: spec.ID, Storages: storages, SandboxPidns: false}
	for _, m := range cfg.AgentKata().KernelModules {
		f := strings.Fields(m)
		if len(f) > 0 {
			req.KernelModules = append(req.KernelModules, &pb.KernelModule{Name: f[0], Parameters: f[1:]})
		}
	}
	if err := s.agent.CreateSandbox(ctx, req); err != nil {
		return nil, s.explain(fmt.Errorf("sandbox %s: agent CreateSandbox: %w", spec.ID, err))
	}
	return s, nil
}

// prepareBackend starts what the chosen backend needs on the host, adds
// its device to the VM and returns the storages the agent mounts.
func (s *Sandbox) prepareBackend(ctx context.Context, host *hostProbe, vmc *hypervisor.VMConfig, spec SandboxSpec) ([]*pb.Storage, error) {
	q := s.cfg.QEMU()
	shm := &pb.Storage{Driver: "ephemeral", Source: "shm", Fstype: "tmpfs", MountPoint: guestSandboxShm, Options: []string{"noexec", "nosuid", "nodev", "mode=1777", "size=67108864"}}
	switch s.Decision.Backend {
	case config.SharedFSImagefsBlk:
		d, err := s.createDisk(ctx, spec.ID, spec.Rootfs, spec.RootfsIndex)
		if err != nil {
			return nil, err
		}
		b := s.cfg.KataFSX.ImagefsBlk
		vmc.Devices = append(vmc.Devices, &hypervisor.VhostUserBlk{ID: d.deviceID, SocketPath: d.Socket, NumQueues: b.NumQueues, QueueSize: b.QueueSize})
		storages := []*pb.Storage{shm}
		if s.Decision.VolumesViaVirtioFS {
			st, err := s.startVirtioFS(ctx, host, vmc)
			if err != nil {
				return nil, err
			}
			storages = append(storages, st)
		}
		return storages, nil
	case config.SharedFSVirtioFS:
		st, err := s.startVirtioFS(ctx, host, vmc)
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
func (s *Sandbox) startVirtioFS(ctx context.Context, host *hostProbe, vmc *hypervisor.VMConfig) (*pb.Storage, error) {
	q := s.cfg.QEMU()
	var err error
	if s.shared, err = virtiofs.NewSharedDir(s.Dir); err != nil {
		return nil, err
	}
	if host.daemon == nil {
		return nil, fmt.Errorf("sandbox %s: virtiofsd %s: %w", s.ID, q.VirtioFSDaemon, host.daemonErr)
	}
	sock := filepath.Join(s.Dir, "vhost-fs.sock")
	s.vfsd, err = virtiofs.Start(ctx, virtiofs.Options{Daemon: host.daemon, SharedDir: s.shared.Root, Cache: q.VirtioFSCache, ExtraArgs: q.VirtioFSExtraArgs}, sock)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", s.ID, err)
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

// watch fails the sandbox when a component it depends on exits.
func (s *Sandbox) watch(component func() (<-chan struct{}, func() error)) {
	exited, why := component()
	s.watchers.Add(1)
	go func() {
		defer s.watchers.Done()
		select {
		case <-exited:
			err := why()
			if err == nil {
				err = errors.New("exited")
			}
			s.fail(err)
		case <-s.done:
		}
	}()
}

func (s *Sandbox) fail(err error) {
	s.failOnce.Do(func() {
		s.failErr = fmt.Errorf("%w: %s: %w", ErrSandboxFailed, s.ID, err)
		close(s.failed)
	})
}

// Failed is closed when the VM or a backend daemon died under the pod.
func (s *Sandbox) Failed() <-chan struct{} { return s.failed }

// Err says why the sandbox failed; nil while it has not.
func (s *Sandbox) Err() error {
	select {
	case <-s.failed:
		return s.failErr
	default:
		return nil
	}
}

// explain prefers the root cause (a dead daemon or VM) over the symptom.
func (s *Sandbox) explain(err error) error {
	select {
	case <-s.failed:
		return fmt.Errorf("%w (%w)", s.failErr, err)
	default:
		return err
	}
}

// consoleTail returns the end of the guest console log, for errors about a
// guest that never answered.
func (s *Sandbox) consoleTail() string {
	f, err := os.Open(filepath.Join(s.Dir, "console.log"))
	if err != nil {
		return ""
	}
	defer f.Close()
	const keep = 2048
	if fi, err := f.Stat(); err == nil && fi.Size() > keep {
		f.Seek(fi.Size()-keep, io.SeekStart)
	}
	b, _ := io.ReadAll(io.LimitReader(f, keep))
	if len(b) == 0 {
		return "; the guest console is empty"
	}
	return "; guest console (last lines):\n" + string(b)
}

// releaseAgent closes the sandbox's agent connection so another client
// (kata-fsx exec) can take the channel; Stop then skips DestroySandbox and
// quits QEMU.
func (s *Sandbox) releaseAgent() {
	if s.agent != nil {
		s.agent.Close()
		s.agent = nil
	}
}

// Agent returns the connection to the guest agent.
func (s *Sandbox) Agent() *agent.Client { return s.agent }

// ContainerSpec is one container of a sandbox.
type ContainerSpec struct {
	ID string
	// RootfsDir is the container's rootfs on the host, already mounted
	// (virtio-fs and virtio-9p share it).
	RootfsDir string
	// Rootfs is what imagefs-blk builds the disk of a container created
	// after boot from.
	Rootfs config.Rootfs
	OCI    *specs.Spec
}

// CreateContainer shares the container's rootfs with the guest (on
// imagefs-blk, hot-plugging its disk when the VM already runs) and creates
// it in the agent. On error the container's disk is gone again.
func (s *Sandbox) CreateContainer(ctx context.Context, c ContainerSpec) (err error) {
	readonly := c.OCI != nil && c.OCI.Root != nil && c.OCI.Root.Readonly
	// The spec is checked before anything is built or plugged for it.
	spec, err := agentSpec(c.OCI, "", readonly)
	if err != nil {
		return fmt.Errorf("container %s: %w", c.ID, err)
	}
	var storages []*pb.Storage
	switch s.Decision.Backend {
	case config.SharedFSImagefsBlk:
		d, derr := s.containerDisk(ctx, c.ID, c.Rootfs)
		if derr != nil {
			return derr
		}
		defer func() {
			if err != nil {
				if uerr := s.unplugDisk(c.ID); uerr != nil {
					err = errors.Join(err, uerr)
				}
			}
		}()
		var st *pb.Storage
		st, spec.Root.Path = s.blkStorage(d, c.ID)
		storages = append(storages, st)
	case config.SharedFSVirtioFS, config.SharedFS9P:
		if spec.Root.Path, err = s.shared.BindRootfs(c.ID, c.RootfsDir, readonly); err != nil {
			return err
		}
	case BackendVirtioBlk:
		if c.ID != s.rootBlkFor {
			return fmt.Errorf("container %s: backend %s serves only the rootfs of the sandbox's first container (%s)", c.ID, BackendVirtioBlk, s.rootBlkFor)
		}
		path, ok := s.vm.Plan().PCIPaths[rootBlkID]
		if !ok {
			return fmt.Errorf("container %s: device %s has no PCI path", c.ID, rootBlkID)
		}
		mp := virtiofs.GuestSharedMount + c.ID
		storages = append(storages, &pb.Storage{Driver: "blk", Source: string(path), Fstype: "ext4", MountPoint: mp})
		spec.Root.Path = mp
	default:
		return fmt.Errorf("container %s: backend %s is not wired yet", c.ID, s.Decision.Backend)
	}
	if err := s.agent.CreateContainer(ctx, &pb.CreateContainerRequest{ContainerId: c.ID, ExecId: c.ID, OCI: spec, Storages: storages}); err != nil {
		return s.explain(fmt.Errorf("container %s: agent CreateContainer: %w", c.ID, err))
	}
	return nil
}

// RemoveContainer removes a container from the guest and releases its
// rootfs share on the host: a hot-plugged imagefs-blk disk is unplugged
// and deleted; the first container's disk, cold-plugged on the root bus,
// stays until Stop.
func (s *Sandbox) RemoveContainer(ctx context.Context, cid string, timeout time.Duration) error {
	var errs []error
	if s.Err() == nil && s.agent != nil {
		if err := s.agent.RemoveContainer(ctx, cid, timeout); err != nil {
			errs = append(errs, s.explain(fmt.Errorf("container %s: %w", cid, err)))
		}
	}
	if s.shared != nil && (s.Decision.Backend == config.SharedFSVirtioFS || s.Decision.Backend == config.SharedFS9P) {
		if err := s.shared.Unbind(cid); err != nil {
			errs = append(errs, err)
		}
	}
	if s.Decision.Backend == config.SharedFSImagefsBlk && s.Err() == nil && s.vm != nil {
		if err := s.unplugDisk(cid); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Stop tears the sandbox down: the guest (DestroySandbox, then QEMU), the
// backend daemons, mounts, sockets and the sandbox directory. It is safe
// to call more than once and after a failure.
func (s *Sandbox) Stop(ctx context.Context) error {
	s.stopOnce.Do(func() {
		close(s.done)
		s.mu.Lock()
		s.stopping = true
		s.mu.Unlock()
		var errs []error
		if s.agent != nil {
			if s.Err() == nil {
				dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				_ = s.agent.DestroySandbox(dctx) // the VM powers off; QMP quit covers a hung guest
				cancel()
			}
			s.agent.Close()
		}
		if s.vm != nil {
			if err := s.vm.Stop(ctx); err != nil {
				errs = append(errs, fmt.Errorf("stop QEMU: %w", err))
			}
		}
		if s.vfsd != nil {
			_ = s.vfsd.Stop(ctx)
		}
		s.mu.Lock()
		disks := s.disks
		s.disks = map[string]*podDisk{}
		s.mu.Unlock()
		for cid, d := range disks {
			if err := d.remove(); err != nil {
				errs = append(errs, fmt.Errorf("container %s disk: %w", cid, err))
			}
		}
		if s.shared != nil {
			if err := s.shared.Cleanup(); err != nil {
				errs = append(errs, err)
			}
		}
		s.lifeStop()
		s.watchers.Wait()
		if s.Dir != "" {
			if err := removeUnmounted(s.Dir); err != nil {
				errs = append(errs, fmt.Errorf("remove sandbox directory: %w", err))
			}
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}
