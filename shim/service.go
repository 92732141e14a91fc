package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	eventsapi "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/sandbox/rootfs"
)

// ioGrace bounds how long an exited process's output may still drain.
const ioGrace = 5 * time.Second

// stdinDrainTimeout bounds how long CloseIO waits for what is in the stdin
// fifo to reach the guest before closing the process's stdin regardless.
const stdinDrainTimeout = 5 * time.Second

// container is one task: its bundle, its init process and its execs.
type container struct {
	id            string
	bundle        string
	spec          *specs.Spec
	rootfsMounted bool
	init          *process
	execs         map[string]*process
	execSeq       uint64 // numbers exec processes so a reused exec id is new to the agent
	paused        bool   // its cgroup in the guest is frozen (Pause); guarded by service.mu
}

type serviceOptions struct {
	namespace     string
	group         string // the pod's sandbox id
	events        *forwarder
	defaultConfig string
	// hostMounts is the host's mount namespace, which volumes' sources
	// are read in; nil is the server's own (tests that run a service
	// in-process).
	hostMounts *mount.Namespace
}

// service is the containerd Task API of one pod.
type service struct {
	ctx  context.Context // the server's lifetime
	opts serviceOptions

	// bootMu serializes sandbox creation without holding mu across the
	// VM boot, so State and Wait stay answerable meanwhile. Lock order:
	// bootMu, then mu. Only Create takes bootMu, and holds it across the
	// boot and the container's creation, whose waits (the VM, the agent,
	// disk builds and their node cache locks) are bounded by its request's
	// context or the sandbox's and never wait for bootMu: a second Create
	// waits as long as the first one's, whatever its own context says.
	bootMu sync.Mutex

	// mu guards the fields below. It is held only to read or change them
	// (and a process's state, whose mu comes after it), never across a
	// request to the guest, an event send or any other wait, so a request
	// of the pod never waits for another one's I/O.
	mu         sync.Mutex
	sandbox    *sandbox.Sandbox
	sbCancel   context.CancelFunc
	containers map[string]*container
	// creating counts Creates in flight and idleSince is when the server
	// last held a container or ran a Create: what watchOrphan reads.
	creating  int
	idleSince time.Time

	done     chan struct{}
	doneOnce sync.Once
}

var _ taskapi.TaskService = (*service)(nil)

func newService(ctx context.Context, o serviceOptions) *service {
	return &service{ctx: ctx, opts: o, containers: map[string]*container{}, idleSince: time.Now(), done: make(chan struct{})}
}

// Done is closed when the server should exit.
func (s *service) Done() <-chan struct{} { return s.done }

func (s *service) log(id string) *log.Entry {
	return log.G(s.ctx).WithField("pod", s.opts.group).WithField("container", id)
}

func (s *service) lookup(id, execID string) (*container, *process, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.containers[id]
	if !ok {
		return nil, nil, errNotFound("container %s not found", id)
	}
	if execID == "" {
		return c, c.init, nil
	}
	p, ok := c.execs[execID]
	if !ok {
		return nil, nil, errNotFound("exec %s of container %s not found", execID, id)
	}
	return c, p, nil
}

// pid is what the shim reports as a process's pid: guest pids mean
// nothing on the host, so every process of the pod reports the shim.
func (s *service) pid() uint32 { return uint32(os.Getpid()) }

// Create creates a container: the pod's sandbox container boots the VM.
func (s *service) Create(ctx context.Context, r *taskapi.CreateTaskRequest) (_ *taskapi.CreateTaskResponse, err error) {
	defer toGRPC(&err)
	if r.Checkpoint != "" || r.ParentCheckpoint != "" {
		return nil, errUnimplemented("container %s: checkpoint/restore is not supported", r.ID)
	}
	if err := sandbox.ValidID(r.ID); err != nil {
		return nil, errInvalid("%v", err)
	}
	spec, err := readBundleSpec(r.Bundle)
	if err != nil {
		return nil, errInvalid("container %s: %v", r.ID, err)
	}
	if err := checkTerminal(r.Terminal, spec.Process); err != nil {
		return nil, errInvalid("container %s: %v", r.ID, err)
	}
	defer s.beginCreate()()
	s.bootMu.Lock()
	defer s.bootMu.Unlock()
	s.mu.Lock()
	_, exists := s.containers[r.ID]
	s.mu.Unlock()
	if exists {
		return nil, errAlreadyExists("container %s already exists", r.ID)
	}
	c := &container{id: r.ID, bundle: r.Bundle, spec: spec, execs: map[string]*process{},
		init: newProcess(r.ID, "", r.ID, stdio{stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr, terminal: r.Terminal})}
	mounts := make([]config.Mount, 0, len(r.Rootfs))
	for _, m := range r.Rootfs {
		mounts = append(mounts, config.Mount{Type: m.Type, Source: m.Source, Options: m.Options})
	}
	remote, isRemote, err := rootfs.ParseRemote(mounts)
	if err != nil {
		return nil, errInvalid("container %s: %v", r.ID, err)
	}
	policyMounts := mounts
	if isRemote {
		policyMounts = remote.PolicyMounts()
	}
	rootfsDir := bundleRootfs(r.Bundle, spec, len(mounts) > 0)
	rf := config.RootfsFromMounts(policyMounts, rootfsDir)
	defer func() {
		if err != nil && c.rootfsMounted {
			if uerr := rootfs.Unmount(rootfsDir); uerr != nil {
				s.log(r.ID).WithError(uerr).Warn("unmount rootfs after failed create")
			}
		}
	}()

	s.mu.Lock()
	sb := s.sandbox
	s.mu.Unlock()
	owns := false
	if sb == nil {
		if podGroup(r.ID, spec.Annotations) != r.ID || r.ID != s.opts.group {
			return nil, errPrecondition("container %s: pod %s has no sandbox in this shim", r.ID, s.opts.group)
		}
		if sb, err = s.createSandbox(ctx, r, spec, rf, remote); err != nil {
			return nil, err
		}
		owns = true
		defer func() {
			if err != nil {
				s.stopSandbox(context.Background())
			}
		}()
	} else if err := sb.Err(); err != nil {
		return nil, errPrecondition("container %s: %v", r.ID, err)
	} else {
		s.log(r.ID).Infof("container %s joins pod %s (backend %s)", r.ID, sb.ID, sb.Decision.Backend)
	}
	if err := writeBundleState(r.Bundle, bundleState{SandboxID: sb.ID, SandboxDir: sb.Dir, OwnsSandbox: owns}); err != nil {
		return nil, err
	}
	if !sb.Backend().BuildsRootfs() && len(mounts) > 0 {
		if err := rootfs.Mount(ctx, mounts, rootfsDir, s.logf(r.ID)); err != nil {
			return nil, fmt.Errorf("container %s: %w", r.ID, err)
		}
		c.rootfsMounted = true
	}
	cspec := sandbox.ContainerSpec{ID: r.ID, RootfsDir: rootfsDir, Rootfs: rf, OCI: spec}
	if !owns && isRemote && sb.Backend().BuildsRootfs() {
		if cspec.RootfsIndex, cspec.RootfsLazy, err = s.remoteLazyRootfs(ctx, r.ID, sb.Decision.Config, remote); err != nil {
			return nil, err
		}
		if cspec.RootfsLazy != nil {
			cspec.Rootfs = config.Rootfs{Kind: config.RootfsImage, ImageRef: remote.ImageRef()}
		}
	}
	cctx, ccancel := untilFailed(ctx, sb)
	err = sb.CreateContainer(cctx, cspec)
	ccancel()
	if err != nil {
		if !errors.Is(err, sandbox.ErrFailed) {
			err = sb.Explain(err)
		}
		if !owns {
			// Release the rootfs share; the pod and its other containers stay.
			if rerr := sb.RemoveContainer(context.Background(), r.ID, 5*time.Second); rerr != nil {
				err = errors.Join(err, fmt.Errorf("undo: %w", rerr))
			}
		}
		return nil, err
	}
	if err := c.init.startIO(s.ctx, sb.Guest()); err != nil {
		err = fmt.Errorf("container %s: stdio: %w", r.ID, err)
		if rerr := sb.RemoveContainer(context.Background(), r.ID, 5*time.Second); rerr != nil {
			err = errors.Join(err, fmt.Errorf("undo: %w", rerr))
		}
		return nil, err
	}
	s.mu.Lock()
	s.containers[r.ID] = c
	s.mu.Unlock()
	s.opts.events.send(&eventsapi.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: s.pid(),
		IO: &eventsapi.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
	})
	return &taskapi.CreateTaskResponse{Pid: s.pid()}, nil
}

// createSandbox boots the pod VM for its first container. The VM lives
// with the server, not the request, but a request cancelled during the
// boot aborts it.
func (s *service) createSandbox(ctx context.Context, r *taskapi.CreateTaskRequest, spec *specs.Spec, rf config.Rootfs, remote *rootfs.Remote) (*sandbox.Sandbox, error) {
	cfgPath, err := configPathOption(r.Options)
	if err != nil {
		return nil, errInvalid("container %s: %v", r.ID, err)
	}
	cfg, err := configFromOptions(cfgPath, s.opts.defaultConfig)
	if err != nil {
		return nil, errInvalid("container %s: %v", r.ID, err)
	}
	sbCtx, sbCancel := context.WithCancel(s.ctx)
	booted := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			sbCancel()
		case <-booted:
		}
	}()
	hostname := spec.Hostname
	var res *specs.LinuxResources
	if spec.Linux != nil {
		res = spec.Linux.Resources
	}
	sbSpec := sandbox.Spec{ID: r.ID, Config: cfg, Annotations: spec.Annotations, Rootfs: rf, Hostname: hostname, Resources: res, NetNSPath: netNSPath(spec), HostMounts: s.opts.hostMounts}
	if err := s.lazyRootfs(ctx, &sbSpec); err != nil {
		sbCancel()
		return nil, err
	}
	// Decided once, before the rootfs is chosen: the sandbox takes this
	// decision, and its reason, as it is.
	d, err := sandbox.Decide(sbSpec)
	if err != nil {
		sbCancel()
		if remote != nil && sbSpec.RootfsLazy == nil {
			return nil, errInvalid("container %s: %v", r.ID, err)
		}
		return nil, fmt.Errorf("sandbox %s: %w", r.ID, err)
	}
	sbSpec.Decision = &d
	if remote != nil && sbSpec.RootfsLazy == nil {
		if err := s.remoteSandboxRootfs(ctx, &sbSpec, remote, d); err != nil {
			sbCancel()
			return nil, err
		}
	}
	sbSpec.PruneCaches = node.AutoPrune
	// Recorded before the boot starts QEMU, virtiofsd and mounts: if this
	// shim dies during the boot, containerd's `shim delete` finds the
	// sandbox directory here and takes them down.
	if err := writeBundleState(r.Bundle, bundleState{SandboxID: r.ID, SandboxDir: sandbox.DirOf(cfg, r.ID), OwnsSandbox: true}); err != nil {
		sbCancel()
		return nil, err
	}
	sb, err := sandbox.New(sbCtx, sbSpec)
	close(booted)
	if err != nil {
		sbCancel()
		return nil, err
	}
	if sbCtx.Err() != nil {
		err := fmt.Errorf("container %s: create cancelled: %w", r.ID, ctx.Err())
		if serr := sb.Stop(context.Background()); serr != nil {
			err = errors.Join(err, serr)
		}
		sbCancel()
		return nil, err
	}
	s.log(r.ID).Infof("sandbox %s: config %s; backend %s: %s", sb.ID, cfg.Path, sb.Decision.Backend, sb.Decision.Reason)
	// Metrics are for watching the pod, not for running it: a socket that
	// cannot be served is logged, not fatal.
	if err := sb.ServeMetrics(); err != nil {
		s.log(r.ID).WithError(err).Warn("metrics socket not served")
	}
	s.mu.Lock()
	s.sandbox, s.sbCancel = sb, sbCancel
	s.mu.Unlock()
	go s.watchSandbox(sb)
	go s.forwardOOM(sb)
	return sb, nil
}

// watchSandbox ends every process of a pod whose VM died with a failure
// status, so containerd sees the tasks exit.
func (s *service) watchSandbox(sb *sandbox.Sandbox) {
	select {
	case <-sb.Failed():
	case <-s.done:
		return
	}
	s.log(sb.ID).WithError(sb.Err()).Error("pod VM died")
	s.mu.Lock()
	var procs []*process
	for _, c := range s.containers {
		procs = append(procs, c.init)
		for _, p := range c.execs {
			procs = append(procs, p)
		}
	}
	s.mu.Unlock()
	for _, p := range procs {
		if st, _, _ := p.status(); st == procCreated {
			s.exited(p, exitSandboxFailed)
		}
	}
}

// configPathOption reads ConfigPath from containerd's runtime options
// (runtimeoptions.v1.Options); other option types carry no config path.
func configPathOption(a *anypb.Any) (string, error) {
	if a == nil || len(a.Value) == 0 {
		return "", nil
	}
	if !strings.HasSuffix(a.TypeUrl, "runtimeoptions.v1.Options") {
		log.L.Debugf("runtime options of type %s carry no ConfigPath", a.TypeUrl)
		return "", nil
	}
	var o runtimeoptions.Options
	if err := proto.Unmarshal(a.Value, &o); err != nil {
		return "", fmt.Errorf("runtime options: %w", err)
	}
	return o.ConfigPath, nil
}

// Start starts the init process of a container or one of its execs.
func (s *service) Start(ctx context.Context, r *taskapi.StartRequest) (_ *taskapi.StartResponse, err error) {
	defer toGRPC(&err)
	c, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	sb := s.currentSandbox()
	if sb == nil {
		return nil, errPrecondition("container %s: the pod has no sandbox", r.ID)
	}
	if err := sb.Err(); err != nil {
		return nil, errPrecondition("container %s: %v", r.ID, err)
	}
	if err := p.setRunning(); err != nil {
		return nil, errPrecondition("container %s: %v", r.ID, err)
	}
	g := sb.Guest()
	actx, cancel := untilFailed(ctx, sb)
	if r.ExecID == "" {
		err = g.StartContainer(actx, c.id)
	} else {
		err = s.execInGuest(actx, c, p)
	}
	cancel()
	if err != nil {
		err = sb.Explain(err)
		s.exited(p, sandbox.ExitNotExecutable)
		if status.Code(err) == codes.NotFound {
			return nil, errNotFound("%v", err)
		}
		return nil, err
	}
	if r.ExecID != "" {
		if err := p.startIO(s.ctx, g); err != nil {
			_ = g.Signal(context.Background(), c.id, p.agentExecID, syscall.SIGKILL)
			return nil, err
		}
	}
	if size := p.setStartedInGuest(); size != nil {
		// A resize that came before the process existed in the guest.
		if err := g.ResizePty(ctx, c.id, p.agentExecID, size.Height, size.Width); err != nil {
			s.log(c.id).WithError(err).Warnf("%s: resize terminal to %dx%d", describe(c.id, r.ExecID), size.Height, size.Width)
		}
	}
	go s.waitExit(sb, p)
	if r.ExecID == "" {
		sb.ContainerStarted(c.id)
		s.opts.events.send(&eventsapi.TaskStart{ContainerID: c.id, Pid: s.pid()})
	} else {
		s.opts.events.send(&eventsapi.TaskExecStarted{ContainerID: c.id, ExecID: r.ExecID, Pid: s.pid()})
	}
	return &taskapi.StartResponse{Pid: s.pid()}, nil
}

// untilFailed is ctx, also cancelled when the sandbox fails. A guest whose
// virtiofsd died stays up, but its processes hang on the dead share, and
// with them an agent request that starts one: without this, Start would
// wait forever and the process would never be reported exited.
func untilFailed(ctx context.Context, sb *sandbox.Sandbox) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-sb.Failed():
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// execInGuest starts an exec process in the agent from its recorded spec.
func (s *service) execInGuest(ctx context.Context, c *container, p *process) error {
	return s.currentSandbox().Guest().Exec(ctx, c.id, p.agentExecID, p.execSpec)
}

func (s *service) currentSandbox() *sandbox.Sandbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sandbox
}

// waitExit waits for a process in the guest, or for the death of the VM,
// and records and publishes its exit.
func (s *service) waitExit(sb *sandbox.Sandbox, p *process) {
	type result struct {
		code int32
		err  error
	}
	waited := make(chan result, 1)
	go func() {
		code, err := sb.Guest().Wait(s.ctx, p.containerID, p.agentExecID)
		waited <- result{code, err}
	}()
	var code uint32
	select {
	case res := <-waited:
		if res.err != nil {
			s.log(p.containerID).WithError(sb.Explain(res.err)).Errorf("wait for %s", p.agentExecID)
			code = exitSandboxFailed
		} else {
			code = uint32(res.code)
		}
	case <-sb.Failed():
		code = exitSandboxFailed
	case <-s.done:
		code = exitSandboxFailed
	}
	p.finishIO(ioGrace)
	s.exited(p, code)
}

// exited records a process's exit and publishes it once.
func (s *service) exited(p *process, code uint32) {
	if p.io.stdout != "" || p.io.stderr != "" {
		p.closeIO()
	}
	if !p.setExited(code) {
		return
	}
	_, _, at := p.status()
	id := p.execID
	if id == "" {
		id = p.containerID
	}
	s.opts.events.send(&eventsapi.TaskExit{ContainerID: p.containerID, ID: id, Pid: s.pid(), ExitStatus: code, ExitedAt: timestamppb.New(at)})
}

// Delete removes an exec, or a container once its init stopped; the
// pod's last container takes the VM with it.
func (s *service) Delete(ctx context.Context, r *taskapi.DeleteRequest) (_ *taskapi.DeleteResponse, err error) {
	defer toGRPC(&err)
	c, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st, code, at := p.status()
	if st == procRunning {
		return nil, errPrecondition("cannot delete %s: process is running", describe(r.ID, r.ExecID))
	}
	if r.ExecID != "" {
		s.mu.Lock()
		delete(c.execs, r.ExecID)
		s.mu.Unlock()
		return &taskapi.DeleteResponse{Pid: s.pid(), ExitStatus: code, ExitedAt: timestamppb.New(at)}, nil
	}
	if st == procCreated {
		s.exited(p, 0)
		_, code, at = p.status()
	}
	sb := s.currentSandbox()
	var errs []error
	if sb != nil {
		if err := sb.RemoveContainer(ctx, c.id, 10*time.Second); err != nil {
			// The guest side is best effort: the container is gone for containerd either way.
			s.log(c.id).WithError(err).Warn("remove container")
		}
	}
	s.mu.Lock()
	delete(s.containers, c.id)
	last := len(s.containers) == 0
	if last {
		s.idleSince = time.Now()
	}
	s.mu.Unlock()
	if last {
		// Tear the VM down before the rootfs unmount, so virtiofsd lets go of it.
		if err := s.stopSandbox(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if c.rootfsMounted {
		if err := rootfs.Unmount(filepath.Join(c.bundle, "rootfs")); err != nil {
			errs = append(errs, err)
		}
	}
	s.opts.events.send(&eventsapi.TaskDelete{ContainerID: c.id, ID: c.id, Pid: s.pid(), ExitStatus: code, ExitedAt: timestamppb.New(at)})
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("delete %s: %w", c.id, err)
	}
	return &taskapi.DeleteResponse{Pid: s.pid(), ExitStatus: code, ExitedAt: timestamppb.New(at)}, nil
}

func describe(id, execID string) string {
	if execID == "" {
		return "container " + id
	}
	return "exec " + execID + " of container " + id
}

// stopSandbox tears the pod VM down; it is a no-op when there is none.
func (s *service) stopSandbox(ctx context.Context) error {
	s.mu.Lock()
	sb, cancel := s.sandbox, s.sbCancel
	s.sandbox, s.sbCancel = nil, nil
	s.mu.Unlock()
	if sb == nil {
		return nil
	}
	err := sb.Stop(ctx)
	if cancel != nil {
		cancel()
	}
	if err != nil {
		return fmt.Errorf("stop sandbox %s: %w", sb.ID, err)
	}
	s.log(sb.ID).Info("sandbox stopped")
	return nil
}

// stopAll is the server's last word: nothing of the pod may outlive it.
func (s *service) stopAll(ctx context.Context) {
	s.doneOnce.Do(func() { close(s.done) })
	if err := s.stopSandbox(ctx); err != nil {
		log.G(ctx).WithError(err).Error("teardown")
	}
	s.mu.Lock()
	var bundles []string
	for _, c := range s.containers {
		if c.rootfsMounted {
			bundles = append(bundles, c.bundle)
		}
	}
	s.mu.Unlock()
	for _, b := range bundles {
		if err := rootfs.Unmount(filepath.Join(b, "rootfs")); err != nil {
			log.G(ctx).WithError(err).Error("teardown")
		}
	}
}

// Exec adds an exec process to a running container; Start starts it.
func (s *service) Exec(ctx context.Context, r *taskapi.ExecProcessRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	if err := sandbox.ValidID(r.ExecID); err != nil {
		return nil, errInvalid("exec id: %v", err)
	}
	if r.Spec == nil {
		return nil, errInvalid("exec %s: no process spec", r.ExecID)
	}
	var ps specs.Process
	if err := json.Unmarshal(r.Spec.Value, &ps); err != nil {
		return nil, errInvalid("exec %s: process spec: %v", r.ExecID, err)
	}
	if err := checkTerminal(r.Terminal, &ps); err != nil {
		return nil, errInvalid("exec %s: %v", r.ExecID, err)
	}
	execSpec, err := sandbox.NewProcessSpec(&ps)
	if err != nil {
		return nil, errInvalid("exec %s: %v", r.ExecID, err)
	}
	if err := s.addExec(r, execSpec); err != nil {
		return nil, err
	}
	// Sent with mu released: send waits while the event queue is full,
	// and every request of the pod takes mu.
	s.opts.events.send(&eventsapi.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	return &emptypb.Empty{}, nil
}

// addExec records the exec r adds to its running container.
func (s *service) addExec(r *taskapi.ExecProcessRequest, execSpec *sandbox.ProcessSpec) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.containers[r.ID]
	if !ok {
		return errNotFound("container %s not found", r.ID)
	}
	if st, _, _ := c.init.status(); st != procRunning {
		return errPrecondition("container %s is %s: exec needs it running", r.ID, st)
	}
	if _, ok := c.execs[r.ExecID]; ok {
		return errAlreadyExists("exec %s already exists in container %s", r.ExecID, r.ID)
	}
	c.execSeq++
	p := newProcess(r.ID, r.ExecID, fmt.Sprintf("%s.%d", r.ExecID, c.execSeq), stdio{stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr, terminal: r.Terminal})
	c.execs[r.ExecID] = p
	p.execSpec = execSpec
	return nil
}

// State reports a process's state.
func (s *service) State(ctx context.Context, r *taskapi.StateRequest) (_ *taskapi.StateResponse, err error) {
	defer toGRPC(&err)
	c, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st, code, at := p.status()
	resp := &taskapi.StateResponse{
		ID: r.ID, ExecID: r.ExecID, Bundle: c.bundle, Pid: s.pid(),
		Stdin: p.io.stdin, Stdout: p.io.stdout, Stderr: p.io.stderr, Terminal: p.io.terminal,
	}
	switch st {
	case procCreated:
		resp.Status = tasktypes.Status_CREATED
	case procRunning:
		resp.Status = tasktypes.Status_RUNNING
		if s.isPaused(c) {
			resp.Status = tasktypes.Status_PAUSED
		}
	case procStopped:
		resp.Status = tasktypes.Status_STOPPED
		resp.ExitStatus = code
		resp.ExitedAt = timestamppb.New(at)
	}
	return resp, nil
}

// Pids lists the container's processes; guest pids are not visible, so
// each process of the task reports the shim's pid.
func (s *service) Pids(ctx context.Context, r *taskapi.PidsRequest) (_ *taskapi.PidsResponse, err error) {
	defer toGRPC(&err)
	if _, _, err := s.lookup(r.ID, ""); err != nil {
		return nil, err
	}
	return &taskapi.PidsResponse{Processes: []*tasktypes.ProcessInfo{{Pid: s.pid()}}}, nil
}

// Kill signals a process in the guest.
func (s *service) Kill(ctx context.Context, r *taskapi.KillRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	_, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st, _, _ := p.status()
	switch st {
	case procStopped:
		return nil, errNotFound("%s: process already finished", describe(r.ID, r.ExecID))
	case procCreated:
		// Never started: there is nothing in the guest to signal yet.
		s.exited(p, 128+r.Signal)
		return &emptypb.Empty{}, nil
	}
	sb := s.currentSandbox()
	if sb == nil || sb.Err() != nil {
		return &emptypb.Empty{}, nil // the VM is gone: so is the process, its exit follows
	}
	if err := sb.Guest().Signal(ctx, p.containerID, p.agentExecID, syscall.Signal(r.Signal)); err != nil {
		if st, _, _ := p.status(); st == procStopped {
			return nil, errNotFound("%s: process already finished", describe(r.ID, r.ExecID))
		}
		return nil, sb.Explain(err)
	}
	return &emptypb.Empty{}, nil
}

// ResizePty resizes a process's terminal in the guest (the agent's
// TtyWinResize); a process not started yet gets the size when it starts.
func (s *service) ResizePty(ctx context.Context, r *taskapi.ResizePtyRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	_, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if !p.io.terminal {
		return nil, errPrecondition("%s has no terminal to resize: it was created without one (ctr -t, crictl -t give one)", describe(r.ID, r.ExecID))
	}
	if err := checkTerminalSize(r.Height, r.Width); err != nil {
		return nil, errInvalid("%s: %v", describe(r.ID, r.ExecID), err)
	}
	if p.deferResize(r.Height, r.Width) {
		return &emptypb.Empty{}, nil
	}
	if st, _, _ := p.status(); st == procStopped {
		return nil, errNotFound("%s: process already finished", describe(r.ID, r.ExecID))
	}
	sb := s.currentSandbox()
	if sb == nil || sb.Err() != nil {
		return nil, errPrecondition("%s: the pod VM is gone", describe(r.ID, r.ExecID))
	}
	if err := sb.Guest().ResizePty(ctx, p.containerID, p.agentExecID, r.Height, r.Width); err != nil {
		if st, _, _ := p.status(); st == procStopped {
			return nil, errNotFound("%s: process already finished", describe(r.ID, r.ExecID))
		}
		return nil, sb.Explain(err)
	}
	return &emptypb.Empty{}, nil
}

// CloseIO closes a process's stdin in the guest (on a terminal, the agent
// types the terminal's end-of-file character: closing it would hang it up).
func (s *service) CloseIO(ctx context.Context, r *taskapi.CloseIORequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	_, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if !r.Stdin {
		return &emptypb.Empty{}, nil
	}
	sb := s.currentSandbox()
	if sb == nil || sb.Err() != nil {
		return &emptypb.Empty{}, nil
	}
	if st, _, _ := p.status(); st != procRunning {
		return &emptypb.Empty{}, nil
	}
	if p.stdin != nil && !p.stdin.drained(ctx, stdinDrainTimeout) {
		return &emptypb.Empty{}, nil // the pump ended: stdin is closed already
	}
	if err := sb.Guest().CloseStdin(ctx, p.containerID, p.agentExecID); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Wait blocks until a process exits and returns its status.
func (s *service) Wait(ctx context.Context, r *taskapi.WaitRequest) (_ *taskapi.WaitResponse, err error) {
	defer toGRPC(&err)
	_, p, err := s.lookup(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.waitBlock:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	_, code, at := p.status()
	return &taskapi.WaitResponse{ExitStatus: code, ExitedAt: timestamppb.New(at)}, nil
}

// Stats returns the container cgroup's metrics in the guest, as
// containerd's cgroup v2 metrics. The imagefs-blk disk's request counters
// are not put in its Io entries: those are the cgroup's io.stat, keyed
// by the device number the guest gave the disk (which the host does not
// know), and the host's counts include the guest kernel's own I/O
// (journal, readahead, writeback); they are on the metrics socket
// instead (docs/metrics.md).
func (s *service) Stats(ctx context.Context, r *taskapi.StatsRequest) (_ *taskapi.StatsResponse, err error) {
	defer toGRPC(&err)
	c, _, err := s.lookup(r.ID, "")
	if err != nil {
		return nil, err
	}
	sb, err := s.runningSandbox(c.id)
	if err != nil {
		return nil, err
	}
	st, err := sb.Guest().Stats(ctx, c.id)
	if err != nil {
		return nil, sb.Explain(err)
	}
	data, err := marshalMetrics(st)
	if err != nil {
		return nil, err
	}
	return &taskapi.StatsResponse{Stats: data}, nil
}

// Connect tells containerd the shim's pid.
func (s *service) Connect(ctx context.Context, r *taskapi.ConnectRequest) (_ *taskapi.ConnectResponse, err error) {
	defer toGRPC(&err)
	return &taskapi.ConnectResponse{ShimPid: uint32(os.Getpid()), TaskPid: s.pid(), Version: RuntimeType}, nil
}

// Shutdown ends the server once the pod has no containers left.
func (s *service) Shutdown(ctx context.Context, r *taskapi.ShutdownRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	s.mu.Lock()
	n := len(s.containers)
	s.mu.Unlock()
	if n > 0 {
		return &emptypb.Empty{}, nil
	}
	s.doneOnce.Do(func() { close(s.done) })
	return &emptypb.Empty{}, nil
}

// Pause freezes the container's cgroup in the guest: one container of the
// pod, as containerd means it, not the VM.
func (s *service) Pause(ctx context.Context, r *taskapi.PauseRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	return s.setPaused(ctx, r.ID, true)
}

// Resume thaws a paused container.
func (s *service) Resume(ctx context.Context, r *taskapi.ResumeRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	return s.setPaused(ctx, r.ID, false)
}

// Checkpoint is not supported.
func (s *service) Checkpoint(ctx context.Context, r *taskapi.CheckpointTaskRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	return nil, errUnimplemented("checkpoint is not supported by kata-fsx")
}

// Update rewrites the container's cgroup limits in the guest (the VM's
// own size stays as booted).
func (s *service) Update(ctx context.Context, r *taskapi.UpdateTaskRequest) (_ *emptypb.Empty, err error) {
	defer toGRPC(&err)
	c, _, err := s.lookup(r.ID, "")
	if err != nil {
		return nil, err
	}
	res, err := updateResources(r.Resources)
	if err != nil {
		return nil, errInvalid("update %s: %v", r.ID, err)
	}
	sb, err := s.runningSandbox(c.id)
	if err != nil {
		return nil, err
	}
	if err := sb.Guest().Update(ctx, c.id, res); err != nil {
		return nil, sb.Explain(err)
	}
	return &emptypb.Empty{}, nil
}

// bundleRootfs is the host directory of a container's rootfs: where
// containerd's rootfs mounts go (the bundle's rootfs/), or, for a container
// created without any (`ctr run --rootfs`, a spec file naming its own root),
// the spec's root.path as runc reads it: absolute, or relative to the bundle.
func bundleRootfs(bundle string, spec *specs.Spec, hasMounts bool) string {
	if hasMounts || spec.Root == nil || spec.Root.Path == "" {
		return filepath.Join(bundle, "rootfs")
	}
	if filepath.IsAbs(spec.Root.Path) {
		return filepath.Clean(spec.Root.Path)
	}
	return filepath.Join(bundle, spec.Root.Path)
}
