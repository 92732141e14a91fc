// Package sandbox is a kata-fsx pod: the VM and its filesystem Backend
// (virtio-fs, virtio-9p, imagefs-blk, or a raw virtio-blk rootfs), the
// devices plugged into it, and the guest agent that runs its containers,
// whose processes it exposes as a Guest. Its life is an explicit State;
// the containerd shim (package shim) and `kata-fsx run` (package cli)
// both drive pods through it and never speak the agent's protocol.
//
// It is larger than the other packages (about 3,500 lines) because the
// backends, the disks and the volumes' share hold the sandbox's lock and
// state and are torn down by its Stop: they stay beside it rather than
// behind an interface wide enough to reach both.
package sandbox

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

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/network"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// sharedTag is the mount tag of the shared directory, Kata's.
const sharedTag = "kataShared"

// Spec is what is known about a pod before its VM boots.
type Spec struct {
	ID          string
	Config      *config.Config // as loaded; annotations are applied here
	Annotations map[string]string
	// Rootfs describes the first container's rootfs, which the policy looks at.
	Rootfs      config.Rootfs
	HostVolumes []string
	Hostname    string
	// Resources are the first container's cgroup resources: they size a
	// lone container's VM under static_sandbox_resource_mgmt.
	Resources *specs.LinuxResources
	// Backend, when set, overrides the policy (kata-fsx run --backend,
	// or the shim for a lazy image's annotation); BackendReason says why,
	// "requested explicitly (--backend ...)" when empty.
	Backend       string
	BackendReason string
	// Decision, when set, is the pod's backend decided already (Decide);
	// New then takes it as it is.
	Decision *config.Decision
	// RootfsIndex, when set, is the first container's rootfs already
	// indexed (an OCI image); otherwise imagefs-blk indexes Rootfs.Layers.
	RootfsIndex *index.Index
	// RootfsLazy, with RootfsIndex, serves the first container's file data
	// from a lazy image's store instead of this host's files; New takes it
	// over: the sandbox closes it when it stops, or New when it fails.
	RootfsLazy LazyRootfs
	// RootfsBlockFile is the first container's rootfs as a raw ext4 image
	// file, for BackendVirtioBlk.
	RootfsBlockFile string
	// NetNSPath is the pod's network namespace (the OCI spec's network
	// namespace path); empty for a pod without one, which gets no NIC.
	NetNSPath string
	// PruneCaches, when set, prunes the node caches to their budgets
	// ([kata_fsx.cache]); the sandbox runs it in the background after it
	// builds a disk. The caller supplies it (node.AutoPrune) so
	// that the sandbox knows nothing of the lazy store and registries
	// whose caches it prunes.
	PruneCaches func(ctx context.Context, cfg *config.Config, logf func(string, ...any)) (ran bool, _ []nodecache.Result, _ error)
	// HostMounts, when set, is the host's mount namespace, in which the
	// containers' bind sources are read: the shim serves a pod from a
	// mount namespace of its own, which the host's later mounts may not
	// reach. Nil reads them in the caller's namespace.
	HostMounts *mount.Namespace
}

// BackendVirtioBlk serves a prebuilt raw ext4 image file as the first
// container's rootfs behind QEMU's own virtio-blk-pci, the way Kata hands
// a block-device rootfs to the guest. The policy never picks it: it is
// what `kata-fsx run --backend virtio-blk` and the benchmarks' ceiling use.
const BackendVirtioBlk = "virtio-blk"

// rootBlkID is the QEMU id of a BackendVirtioBlk rootfs disk.
const rootBlkID = "rootfs-blk-0"

// Sandbox is a pod VM with its filesystem backend and agent connection.
type Sandbox struct {
	ID       string
	Dir      string
	Decision config.Decision

	cfg     *config.Config
	backend Backend
	// hostMounts is where bind sources are read (Spec.HostMounts).
	hostMounts *mount.Namespace
	vm         *hypervisor.VM
	agent      *agent.Client
	// vhostVsock is the open /dev/vhost-vsock that holds the guest's CID
	// (vhost-vsock transport); QEMU has a copy, and Stop closes this one
	// after QEMU is gone.
	vhostVsock *os.File
	// hybridVsock is the in-process vsock device behind a hybrid vsock
	// transport; Stop closes it after QEMU is gone.
	hybridVsock io.Closer
	// net is the pod's network namespace wired to the VM's NICs; nil for none.
	net *network.Network
	// forwarder listens in net for the guest's TCP ports (portforward.go);
	// nil for a pod without a network namespace. Stop ends it first.
	forwarder *portForwarder
	// life is the sandbox's lifetime, for what runs beyond one request
	// (the disks' vhost-user servers); Stop ends it.
	life     context.Context
	lifeStop context.CancelFunc

	// mu guards the fields below. It is the last lock taken and is held
	// only to read or change them, never across a request to the guest
	// or QEMU, a build or a wait: Stop, the watchers and the requests
	// that wait for one another (Stop's second caller, s.watchers) do so
	// with mu released.
	mu      sync.Mutex
	state   State
	failErr error // why the sandbox failed; set on the move to StateFailed
	stopErr error // what Stop could not clean up; set on the move to StateStopped
	// lazy is the first container's lazy image store (Spec.RootfsLazy), closed
	// after the disks that read it.
	lazy LazyRootfs
	// pruneCaches is Spec.PruneCaches.
	pruneCaches func(ctx context.Context, cfg *config.Config, logf func(string, ...any)) (bool, []nodecache.Result, error)
	// volumes are the containers' binds in the shared directory.
	volumes map[string][]virtiofs.Volume
	// metricsSrv serves the pod's metrics (ServeMetrics); Stop closes it.
	metricsSrv *metrics.Server

	failed   chan struct{} // closed on the move to StateFailed
	stopping chan struct{} // closed on the move to StateStopping, so watchers exit
	stopped  chan struct{} // closed on the move to StateStopped
	watchers sync.WaitGroup
}

// ValidID keeps sandbox, container and exec ids usable as directory
// names, socket names and QEMU ids.
func ValidID(id string) error {
	if id == "" || len(id) > 64 || strings.ContainsAny(id, "/\x00 ,") || id == "." || id == ".." {
		return withClass(fmt.Errorf("invalid sandbox id %q", id), errdefs.ErrInvalidArgument)
	}
	return nil
}

// New decides the pod's backend, prepares it, boots the VM, connects to
// the agent and creates the sandbox in the guest; the sandbox it returns
// is ready. On error nothing is left behind.
func New(ctx context.Context, spec Spec) (_ *Sandbox, err error) {
	owned := false // spec.RootfsLazy is the sandbox's to close from newSandbox on
	defer func() {
		if err != nil && !owned && spec.RootfsLazy != nil {
			err = errors.Join(err, spec.RootfsLazy.Close())
		}
	}()
	if err := ValidID(spec.ID); err != nil {
		return nil, err
	}
	d, err := Decide(spec)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	cfg := d.Config
	if cfg.Runtime.StaticSandboxResourceMgmt {
		sz, err := WorkloadSizing(spec.Annotations, spec.Resources)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: static_sandbox_resource_mgmt: %w", spec.ID, err)
		}
		applySizing(cfg.QEMU(), sz)
		log.G(ctx).WithField("sandbox", spec.ID).Infof("static_sandbox_resource_mgmt: %g vCPUs and %d MiB from %s: the VM gets %d vCPUs and %d MiB",
			sz.CPUs, sz.MemoryMiB, sz.From, cfg.QEMU().DefaultVCPUs, cfg.QEMU().DefaultMemory)
	}
	s, err := newSandbox(ctx, spec.ID, d)
	if err != nil {
		return nil, err
	}
	s.lazy, owned = spec.RootfsLazy, true
	s.pruneCaches = spec.PruneCaches
	s.hostMounts = spec.HostMounts
	log.G(ctx).WithField("sandbox", spec.ID).Infof("backend %s: %s", d.Backend, d.Reason)
	for _, k := range cfg.Ignored {
		log.G(ctx).WithField("sandbox", spec.ID).Warnf("%s", k)
	}
	defer func() {
		if err != nil {
			if serr := s.Stop(context.Background()); serr != nil {
				err = errors.Join(err, fmt.Errorf("clean up after the failed start: %w", serr))
			}
		}
	}()
	h, vmc, err := s.plan(ctx, spec)
	if err != nil {
		return nil, err
	}
	if err := hypervisor.MakeVMDir(s.Dir); err != nil {
		return nil, err
	}
	transport, err := s.startAgentChannel(ctx, vmc)
	if err != nil {
		return nil, err
	}
	storages, err := s.backend.prepare(ctx, h, vmc, spec)
	if err != nil {
		return nil, err
	}
	if err := s.setupNetwork(ctx, spec, vmc); err != nil {
		return nil, err
	}
	s.vm, err = hypervisor.Start(ctx, vmc)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: start QEMU: %w", spec.ID, err)
	}
	if err := s.closeNetworkFiles(); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	s.watch(func() (<-chan struct{}, func() error) { return s.vm.Exited(), s.vmExit })
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
		return nil, s.Explain(fmt.Errorf("sandbox %s: guest agent: %w%s", spec.ID, err, s.consoleTail()))
	}
	req := &pb.CreateSandboxRequest{Hostname: spec.Hostname, SandboxId: spec.ID, Storages: storages, SandboxPidns: false}
	for _, m := range cfg.AgentKata().KernelModules {
		f := strings.Fields(m)
		if len(f) > 0 {
			req.KernelModules = append(req.KernelModules, &pb.KernelModule{Name: f[0], Parameters: f[1:]})
		}
	}
	if err := s.configureGuestNetwork(ctx); err != nil {
		return nil, fmt.Errorf("sandbox %s: guest network: %w", spec.ID, err)
	}
	if err := s.agent.CreateSandbox(ctx, req); err != nil {
		return nil, s.Explain(fmt.Errorf("sandbox %s: agent CreateSandbox: %w", spec.ID, err))
	}
	s.startPortForward(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.moveLocked(StateReady); err != nil {
		// Only a failure can have come first: say what died.
		return nil, s.explainLocked(err)
	}
	return s, nil
}

// plan probes the host and turns the configuration into the VM to boot:
// the accelerator and agent transport are the probe's, the same values
// `kata-fsx env` reports for this configuration. It starts nothing: the
// agent channel's resources (a vhost-vsock CID, the hybrid vsock device)
// are startAgentChannel's.
func (s *Sandbox) plan(ctx context.Context, spec Spec) (*host.Host, *hypervisor.VMConfig, error) {
	cfg := s.cfg
	h := host.Probe(ctx, cfg)
	if h.QEMUErr != nil {
		return nil, nil, fmt.Errorf("sandbox %s: %w", spec.ID, h.QEMUErr)
	}
	lg := log.G(ctx).WithField("sandbox", spec.ID)
	if h.Accel == hypervisor.AccelTCG && cfg.KataFSX.Accelerator != config.AccelTCG {
		lg.Warnf("no KVM (%s): the guest runs under TCG, slowly", h.AccelReason)
	}
	if err := config.Validate(cfg, h.Facts()); err != nil {
		return nil, nil, fmt.Errorf("sandbox %s: configuration: %w", spec.ID, err)
	}
	if h.TransportErr != nil {
		return nil, nil, fmt.Errorf("sandbox %s: %w", spec.ID, h.TransportErr)
	}
	lg.Infof("agent transport %s: %s", h.Transport, h.TransportReason)
	q := cfg.QEMU()
	vmc := &hypervisor.VMConfig{
		Name: "sandbox-" + spec.ID,
		// QEMU's directory is its own: the hypervisor removes it whole on
		// stop, and it must never hold the shared/ mounts.
		Dir:          filepath.Join(s.Dir, "vm"),
		QEMUPath:     q.Path,
		Caps:         h.QEMU,
		MachineType:  q.MachineType,
		Accel:        h.Accel,
		VCPUs:        uint32(q.DefaultVCPUs),
		MemoryMiB:    uint64(q.DefaultMemory),
		MemPrealloc:  q.EnableMemPrealloc,
		Kernel:       q.Kernel,
		Initrd:       q.Initrd,
		KernelParams: strings.Fields(q.KernelParams),
		Debug:        q.EnableDebug || cfg.AgentKata().EnableDebug,
		ConsoleLog:   filepath.Join(s.Dir, "console.log"),
		HotplugSlots: 8,
	}
	if q.Image != "" {
		img, err := guestImage(q, h)
		if err != nil {
			return nil, nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
		}
		vmc.Image = img
		if !img.VirtioBlk {
			vmc.MemorySlots, vmc.MaxMemoryMiB = imageMemoryLayout(q, h, img)
		}
	}
	// Hybrid vsock's device is a vhost-user backend like virtio-fs's and
	// imagefs-blk's: it maps guest RAM.
	if cfg.NeedsSharedMemory() || s.backend.sharedMemory() || h.Transport == config.TransportHybridVsock {
		// The probe's choice, which env and check report: a memfd unless
		// file_mem_backend names a directory or memfd_create fails.
		if h.GuestRAM == hypervisor.SharedMemoryOff {
			return nil, nil, fmt.Errorf("sandbox %s: vhost-user devices need shared guest RAM: %s", spec.ID, h.GuestRAMReason)
		}
		vmc.SharedMemory, vmc.MemPath = h.GuestRAM, h.GuestRAMDir
		if err := checkGuestRAM(vmc); err != nil {
			return nil, nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
		}
	}
	switch h.Transport {
	case config.TransportVsock:
		// The guest CID is claimed by startAgentChannel.
		vmc.Agent = hypervisor.AgentChannel{Transport: hypervisor.AgentVsock}
	case config.TransportHybridVsock:
		vmc.Agent = hypervisor.AgentChannel{Transport: hypervisor.AgentHybridVsock, SocketPath: filepath.Join(s.Dir, vsockDir, "vhost.sock")}
	default:
		vmc.Agent = hypervisor.AgentChannel{Transport: hypervisor.AgentSerial, SocketPath: AgentSocket(cfg, spec.ID)}
	}
	return h, vmc, nil
}

// guestImage is the configured guest image as the VM attaches it: sized
// at boot, as Kata sizes its nvdimm.
func guestImage(q *config.QEMU, h *host.Host) (*hypervisor.RootImage, error) {
	fi, err := os.Stat(q.Image)
	if err != nil {
		return nil, fmt.Errorf("guest image (hypervisor.qemu.image): %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("guest image (hypervisor.qemu.image) %s is not a regular file", q.Image)
	}
	return &hypervisor.RootImage{Path: q.Image, Size: uint64(fi.Size()), VirtioBlk: q.DisableImageNvdimm}, nil
}

// kataNVDIMMReserveMiB is the address space Kata adds to maxmem for the
// image's nvdimm (genericMemoryTopology's 1024 MiB).
const kataNVDIMMReserveMiB = 1024

// imageMemoryLayout is Kata's -m for a guest with an image nvdimm:
// memory_slots slots (Kata's default 10) and maxmem = the host's RAM (Kata's
// default_maxmemory = 0) + 1024 MiB. The nvdimm sits in that hot-plug area,
// so maxmem is raised, if need be, until guest RAM plus the image fit.
func imageMemoryLayout(q *config.QEMU, h *host.Host, img *hypervisor.RootImage) (slots uint32, maxMiB uint64) {
	slots = q.MemorySlots
	if slots == 0 {
		slots = 10
	}
	mem := uint64(q.DefaultMemory)
	maxMiB = mem + kataNVDIMMReserveMiB
	if h.MemoryErr == nil && h.Memory.TotalKiB > 0 {
		maxMiB = h.Memory.TotalKiB>>10 + kataNVDIMMReserveMiB
	}
	if need := mem + (img.Size+1<<20-1)>>20; maxMiB < need {
		maxMiB = need
	}
	return slots, maxMiB
}

// DirOf is the directory of sandbox id under configuration c: everything
// the pod has on the host (QEMU's directory, sockets, the shared
// directory's mounts, disks) lives below it. It is known before the
// sandbox exists: a shim records it before the boot, so that a cleanup
// after the shim's death finds what a half-done boot started.
func DirOf(c *config.Config, id string) string {
	return node.LayoutOf(c).Sandbox(id)
}

// AgentSocket is the unix socket QEMU listens on for the virtio-serial
// agent channel of sandbox id under configuration c.
func AgentSocket(c *config.Config, id string) string {
	return filepath.Join(DirOf(c, id), "agent.sock")
}

// newSandbox is a booting sandbox with nothing started yet; its directory
// is under the state directory of the decision's configuration.
func newSandbox(ctx context.Context, id string, d config.Decision) (*Sandbox, error) {
	s := &Sandbox{
		ID: id, Decision: d, cfg: d.Config,
		Dir:    DirOf(d.Config, id),
		state:  StateBooting,
		failed: make(chan struct{}), stopping: make(chan struct{}), stopped: make(chan struct{}),
		volumes: map[string][]virtiofs.Volume{},
	}
	var err error
	if s.backend, err = newBackend(s, d); err != nil {
		return nil, err
	}
	s.life, s.lifeStop = context.WithCancel(context.WithoutCancel(ctx))
	return s, nil
}

// Backend is how the pod's rootfs and volumes reach its guest.
func (s *Sandbox) Backend() Backend { return s.backend }

// State returns where the sandbox is in its life.
func (s *Sandbox) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state
}

// moveLocked makes a checked move to another state; s.mu is held.
func (s *Sandbox) moveLocked(to State) error {
	if !canMove(s.state, to) {
		return &StateError{ID: s.ID, Op: "become " + to.String(), State: s.state}
	}
	s.state = to
	switch to {
	case StateFailed:
		close(s.failed)
	case StateStopping:
		close(s.stopping)
	case StateStopped:
		close(s.stopped)
	}
	return nil
}

// requireLocked refuses op unless the sandbox is in one of the states
// given; s.mu is held.
func (s *Sandbox) requireLocked(op string, states ...State) error {
	for _, st := range states {
		if s.state == st {
			return nil
		}
	}
	return s.explainLocked(&StateError{ID: s.ID, Op: op, State: s.state})
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
		case <-s.stopping:
		}
	}()
}

// fail moves a booting or ready sandbox to StateFailed. A component that
// exits once Stop began is being stopped, not failing: that is ignored.
func (s *Sandbox) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != StateBooting && s.state != StateReady {
		return
	}
	s.failErr = fmt.Errorf("%w: %s: %w", ErrFailed, s.ID, err)
	_ = s.moveLocked(StateFailed) // booting and ready may always fail
}

// Failed is closed when the VM or a backend daemon died under the pod.
func (s *Sandbox) Failed() <-chan struct{} { return s.failed }

// Err says why the sandbox failed; nil while it has not.
func (s *Sandbox) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failErr
}

// Explain prefers the root cause (a dead daemon or VM) over the symptom
// err, which a request to a dead guest reports.
func (s *Sandbox) Explain(err error) error {
	if brokenChannel(err) {
		// The agent's channel breaks the moment QEMU dies, a little before
		// the process watcher has reaped it: give the watcher that moment,
		// so the error names the VM's death rather than a closed channel.
		t := time.NewTimer(explainWait)
		select {
		case <-s.failed:
		case <-s.stopping:
		case <-t.C:
		}
		t.Stop()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.explainLocked(err)
}

func (s *Sandbox) explainLocked(err error) error {
	if s.failErr != nil {
		return fmt.Errorf("%w (%w)", s.failErr, err)
	}
	return err
}

// vmExit says why QEMU ended under a running pod: its status and the end
// of the guest console, where a guest that died (its agent killed, a kernel
// panic) says why.
func (s *Sandbox) vmExit() error {
	err := s.vm.Wait()
	if err == nil {
		err = errors.New("status 0")
	}
	return fmt.Errorf("QEMU exited (%w)%s%s", err, s.consolePanic(), s.consoleTail())
}

// consolePanic finds the guest kernel's last panic message in the console
// log ("; guest kernel panic: ..."), which a backtrace usually pushes out
// of the tail that consoleTail shows.
func (s *Sandbox) consolePanic() string {
	f, err := os.Open(filepath.Join(s.Dir, "console.log"))
	if err != nil {
		return ""
	}
	defer f.Close()
	const scan = 64 << 10
	if fi, err := f.Stat(); err == nil && fi.Size() > scan {
		f.Seek(fi.Size()-scan, io.SeekStart)
	}
	b, _ := io.ReadAll(io.LimitReader(f, scan))
	const mark = "Kernel panic - not syncing: "
	i := strings.LastIndex(string(b), mark)
	if i < 0 {
		return ""
	}
	line, _, _ := strings.Cut(string(b[i+len(mark):]), "\n")
	return "; guest kernel panic: " + strings.TrimSpace(line)
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

// ReleaseAgent closes the sandbox's agent connection so another client
// (kata-fsx exec) can take the channel; Stop then skips DestroySandbox and
// quits QEMU.
func (s *Sandbox) ReleaseAgent() error {
	a := s.agent
	s.agent = nil
	if a == nil {
		return nil
	}
	if err := a.Close(); err != nil {
		return fmt.Errorf("sandbox %s: close the agent connection: %w", s.ID, err)
	}
	return nil
}

// ContainerSpec is one container of a sandbox.
type ContainerSpec struct {
	ID string
	// RootfsDir is the container's rootfs on the host, already mounted
	// (virtio-fs and virtio-9p share it).
	RootfsDir string
	// Rootfs is what imagefs-blk builds the disk of a container created
	// after boot from.
	Rootfs config.Rootfs
	// RootfsIndex and RootfsLazy, when set, are a lazy image the
	// container's imagefs-blk disk is built from and reads its file data
	// through (the kata-fsx snapshotter's remote layers). CreateContainer
	// owns RootfsLazy: it is closed with the disk, or on error.
	RootfsIndex *index.Index
	RootfsLazy  LazyRootfs
	OCI         *specs.Spec
}

// CreateContainer shares the container's rootfs with the guest (on
// imagefs-blk, hot-plugging its disk when the VM already runs) and creates
// it in the agent; the sandbox must be ready. On error the container's
// disk is gone again.
func (s *Sandbox) CreateContainer(ctx context.Context, c ContainerSpec) (err error) {
	lazy := c.RootfsLazy // closed here unless a hot-plugged disk took it over
	defer func() {
		if lazy != nil {
			if cerr := lazy.Close(); cerr != nil {
				err = errors.Join(err, fmt.Errorf("container %s: close the lazy image store: %w", c.ID, cerr))
			}
		}
	}()
	s.mu.Lock()
	err = s.requireLocked("create container "+c.ID, StateReady)
	s.mu.Unlock()
	if err != nil {
		return err
	}
	readonly := c.OCI != nil && c.OCI.Root != nil && c.OCI.Root.Readonly
	// The spec is checked before anything is built or plugged for it.
	spec, err := agentSpec(c.OCI, "", readonly)
	if err != nil {
		return withClass(fmt.Errorf("container %s: %w", c.ID, err), errdefs.ErrInvalidArgument)
	}
	if spec.Linux != nil && s.Decision.Config.Runtime.DisableGuestSeccomp {
		// Kata's disable_guest_seccomp: the profile stays on the host.
		spec.Linux.Seccomp = nil
	}
	// Volumes are shared before the rootfs: a mount that cannot be
	// honoured fails the container before a disk is built for it.
	mounts, storages, vols, err := s.containerMounts(ctx, c.ID, c.OCI)
	if err != nil {
		return err
	}
	spec.Mounts = mounts
	defer func() {
		if err != nil {
			if uerr := vols.undo(); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
	}()
	root, rootPath, undo, err := s.backend.addRootfs(ctx, c, &lazy)
	if err != nil {
		return err
	}
	if undo != nil {
		defer func() {
			if err != nil {
				if uerr := undo(); uerr != nil {
					err = errors.Join(err, uerr)
				}
			}
		}()
	}
	spec.Root.Path = rootPath
	if root != nil {
		// The rootfs first: the agent resolves the root path after mounting.
		storages = append([]*pb.Storage{root}, storages...)
	}
	if err := s.agent.CreateContainer(ctx, &pb.CreateContainerRequest{ContainerId: c.ID, ExecId: c.ID, OCI: spec, Storages: storages, SandboxPidns: c.ID != s.ID && sharesPodPID(c.OCI)}); err != nil {
		return s.Explain(fmt.Errorf("container %s: agent CreateContainer: %w", c.ID, err))
	}
	s.keepVolumes(c.ID, vols)
	return nil
}

// RemoveContainer removes a container from the guest and releases its
// rootfs share on the host: a hot-plugged imagefs-blk disk is unplugged
// and deleted; the first container's disk, cold-plugged on the root bus,
// stays until Stop. Once the sandbox is no longer ready there is no guest
// to ask, and only the host side is released.
func (s *Sandbox) RemoveContainer(ctx context.Context, cid string, timeout time.Duration) error {
	var errs []error
	ready := s.State() == StateReady
	if ready && s.agent != nil {
		if err := s.agent.RemoveContainer(ctx, cid, timeout); err != nil {
			errs = append(errs, s.Explain(fmt.Errorf("container %s: %w", cid, err)))
		}
	}
	if err := s.removeVolumes(cid); err != nil {
		errs = append(errs, err)
	}
	if err := s.backend.removeRootfs(cid, ready && s.vm != nil); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// ContainerStarted tells the sandbox container cid's process runs: for
// the container a lazy rootfs serves, that opens its prefetch trace window
// and starts its background fill.
func (s *Sandbox) ContainerStarted(cid string) {
	if s.lazy != nil && cid == s.ID {
		s.lazy.Started()
	}
	s.backend.started(cid)
}

// Stop tears the sandbox down from any state: the guest (DestroySandbox,
// then QEMU), the backend daemons, disks, mounts, sockets and the sandbox
// directory. It returns every error of the teardown. A second call waits
// for the first and returns its result.
func (s *Sandbox) Stop(ctx context.Context) error {
	s.mu.Lock()
	if s.state == StateStopping || s.state == StateStopped {
		s.mu.Unlock()
		select {
		case <-s.stopped:
		case <-ctx.Done():
			return fmt.Errorf("sandbox %s: wait for the teardown under way: %w", s.ID, ctx.Err())
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.stopErr
	}
	wasFailed := s.state == StateFailed
	_ = s.moveLocked(StateStopping) // every state before stopping may stop
	// No disk can be added from here on; the backend removes the ones there are.
	s.mu.Unlock()

	var errs []error
	if err := s.stopMetrics(); err != nil {
		errs = append(errs, err)
	}
	if s.forwarder != nil {
		s.forwarder.stop()
	}
	if s.agent != nil {
		if !wasFailed {
			dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if err := s.agent.DestroySandbox(dctx); err != nil {
				// Not a leak: QEMU's quit below ends a guest that did not
				// power off, so this is a warning, not a teardown error.
				log.G(ctx).WithField("sandbox", s.ID).WithError(err).Warn("agent DestroySandbox failed; quitting QEMU")
			}
			cancel()
		}
		if err := s.agent.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close the agent connection: %w", err))
		}
	}
	if s.vm != nil {
		if err := s.vm.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("stop QEMU: %w", err))
		}
	}
	// QEMU is gone: nothing uses the taps, nor the agent channel's device or CID.
	if err := s.teardownNetwork(); err != nil {
		errs = append(errs, err)
	}
	if s.hybridVsock != nil {
		if err := s.hybridVsock.Close(); err != nil {
			errs = append(errs, fmt.Errorf("stop the hybrid vsock device: %w", err))
		}
	}
	if s.vhostVsock != nil {
		if err := s.vhostVsock.Close(); err != nil {
			errs = append(errs, fmt.Errorf("release the vhost-vsock guest CID: %w", err))
		}
	}
	errs = append(errs, s.backend.stop(ctx)...)
	// After the disks: nothing reads the lazy store any more.
	if s.lazy != nil {
		if err := s.lazy.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close the lazy image store: %w", err))
		}
	}
	s.lifeStop()
	s.watchers.Wait()
	if s.Dir != "" {
		if err := mount.RemoveUnmounted(s.Dir); err != nil {
			errs = append(errs, fmt.Errorf("remove sandbox directory: %w", err))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopErr = errors.Join(errs...)
	_ = s.moveLocked(StateStopped) // stopping always ends stopped
	return s.stopErr
}
