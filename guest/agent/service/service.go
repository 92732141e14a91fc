// Package service is the agent's grpc.AgentService and grpc.Health over
// ttrpc: the sandbox (hostname, DNS, storages), its containers (storages,
// cgroup, init process) and their processes, networking and the power-off
// at DestroySandbox. It holds the agent's state; the parts it drives live
// in the sibling packages.
package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/cgroups"
	"github.com/kata-fsx/kata-fsx/guest/agent/initproc"
	"github.com/kata-fsx/kata-fsx/guest/agent/modules"
	"github.com/kata-fsx/kata-fsx/guest/agent/network"
	"github.com/kata-fsx/kata-fsx/guest/agent/process"
	"github.com/kata-fsx/kata-fsx/guest/agent/pty"
	"github.com/kata-fsx/kata-fsx/guest/agent/seccomp"
	"github.com/kata-fsx/kata-fsx/guest/agent/storage"
)

// sharedContainersDir is where Kata's shared directory is mounted; relative
// OCI root paths are taken relative to <dir>/<container id>.
const sharedContainersDir = "/run/kata-containers/shared/containers"

// Agent implements grpc.AgentService and grpc.Health in the guest.
type Agent struct {
	// mu guards the fields below. Lock order: mu, then the storage set's
	// and the cgroups' mutexes, none of which is held while mu is taken.
	// Its holders wait for mounts, a process's start report and
	// (DestroySandbox) the kills of what runs, at most 5 s each; nothing
	// they wait for takes mu.
	mu         sync.Mutex
	sandboxID  string
	storages   []string // sandbox mount points, in mount order
	mounts     storage.Set
	containers map[string]*container
	cgroups    *cgroups.Hierarchy
	poweroff   chan struct{}
	once       sync.Once

	// modules is the background load of the kernel modules that storage
	// and network calls wait for.
	modules *modules.Loading
}

type container struct {
	id       string
	spec     *pb.Spec
	rootfs   string
	storages []string
	init     *process.Process
	cgroup   *cgroups.Cgroup
	starting atomic.Bool
	// startedAt is when the init process exec'd (unix nanoseconds), for
	// signals that arrive during its start-up (awaitHandler).
	startedAt atomic.Int64
	execs     map[string]*process.Process
	// podPID: the container joins the PID namespace of the pod's sandbox
	// container instead of the one its spec asks for.
	podPID bool
}

// ownPIDNamespace says whether the container's init is PID 1 of a PID
// namespace of its own.
func (c *container) ownPIDNamespace() bool {
	return !c.podPID && cloneFlags(c.spec)&unix.CLONE_NEWPID != 0
}

// startFlags are cloneFlags, without a new PID namespace for a container
// that joins its pod's.
func (c *container) startFlags() uintptr {
	if c.podPID {
		return cloneFlags(c.spec) &^ unix.CLONE_NEWPID
	}
	return cloneFlags(c.spec)
}

// podPIDNamespace opens the PID namespace of the pod's sandbox container
// (the container whose id is the sandbox's) for container id to join.
func (a *Agent) podPIDNamespace(id string) (*os.File, error) {
	a.mu.Lock()
	sb, ok := a.containers[a.sandboxID]
	a.mu.Unlock()
	if !ok || !sb.init.Running() {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s shares the pod's PID namespace, and the pod's sandbox container %s is not running", id, a.sandboxID)
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/pid", sb.init.Pid()))
	if err != nil {
		return nil, fmt.Errorf("container %s: the PID namespace of sandbox container %s: %w", id, a.sandboxID, err)
	}
	return f, nil
}

// New returns an agent with no sandbox yet; its storage and network calls
// wait for mods.
func New(mods *modules.Loading) *Agent {
	return &Agent{containers: map[string]*container{}, cgroups: cgroups.New(), poweroff: make(chan struct{}), modules: mods}
}

// waitModules waits for the storage modules, which load while the agent
// already serves.
func (a *Agent) waitModules(ctx context.Context) error {
	select {
	case <-a.modules.Done():
		if err := a.modules.Err(); err != nil {
			return status.Errorf(codes.Internal, "guest kernel modules: %v", err)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Serve serves the agent API with opts on every listener until
// DestroySandbox, and returns once its reply has had the time to leave:
// the caller then powers the VM off.
func (a *Agent) Serve(ctx context.Context, ls []net.Listener, opts ...ttrpc.ServerOpt) error {
	srv, err := ttrpc.NewServer(opts...)
	if err != nil {
		return fmt.Errorf("ttrpc server: %w", err)
	}
	pb.RegisterAgentServiceService(srv, a)
	pb.RegisterHealthService(srv, a)
	for _, l := range ls {
		go func(l net.Listener) {
			if err := srv.Serve(ctx, l); err != nil && !errors.Is(err, ttrpc.ErrServerClosed) {
				log.Printf("serve %s: %v", l.Addr(), err)
			}
		}(l)
	}
	log.Printf("agent ready")
	<-a.poweroff
	// Let the DestroySandbox reply leave before the VM disappears.
	time.Sleep(200 * time.Millisecond)
	return nil
}

// Check implements grpc.Health.
func (a *Agent) Check(context.Context, *pb.CheckRequest) (*pb.HealthCheckResponse, error) {
	return &pb.HealthCheckResponse{Status: pb.HealthCheckResponse_SERVING}, nil
}

// Version implements grpc.Health.
func (a *Agent) Version(context.Context, *pb.CheckRequest) (*pb.VersionCheckResponse, error) {
	return &pb.VersionCheckResponse{AgentVersion: "kata-fsx-agent", GrpcVersion: "ttrpc"}, nil
}

// CreateSandbox implements grpc.AgentService.
func (a *Agent) CreateSandbox(ctx context.Context, req *pb.CreateSandboxRequest) (*emptypb.Empty, error) {
	if err := a.waitModules(ctx); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sandboxID != "" {
		return nil, status.Errorf(codes.AlreadyExists, "sandbox %q already created", a.sandboxID)
	}
	for _, m := range req.GetKernelModules() {
		if err := modules.LoadByName(m.GetName()); err != nil {
			return nil, err
		}
	}
	if h := req.GetHostname(); h != "" {
		if err := unix.Sethostname([]byte(h)); err != nil {
			return nil, fmt.Errorf("sethostname: %w", err)
		}
	}
	if err := network.UpLoopback(); err != nil {
		return nil, err
	}
	if dns := req.GetDns(); len(dns) > 0 {
		if err := setupDNS(dns); err != nil {
			return nil, err
		}
	}
	var mounted []string
	for _, s := range req.GetStorages() {
		mp, err := a.mounts.Add(ctx, s)
		if err != nil {
			a.mounts.Release(mounted)
			return nil, err
		}
		log.Printf("sandbox storage %s %s mounted on %s", s.GetDriver(), s.GetSource(), mp)
		mounted = append(mounted, mp)
	}
	a.storages = mounted
	a.sandboxID = req.GetSandboxId()
	if a.sandboxID == "" {
		a.sandboxID = "sandbox"
	}
	return &emptypb.Empty{}, nil
}

// DestroySandbox implements grpc.AgentService: it kills what still runs,
// unmounts, syncs and powers the VM off once the reply is sent.
func (a *Agent) DestroySandbox(ctx context.Context, _ *pb.DestroySandboxRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, c := range a.containers {
		c.killAll(ctx, 5*time.Second)
		a.cgroups.Remove(c.cgroup)
		a.mounts.Release(c.storages)
		delete(a.containers, id)
	}
	a.mounts.Release(a.storages)
	a.storages = nil
	unix.Sync()
	a.once.Do(func() { close(a.poweroff) })
	return &emptypb.Empty{}, nil
}

// CreateContainer implements grpc.AgentService: it mounts the container's
// storages and prepares its init process; StartContainer runs it.
func (a *Agent) CreateContainer(ctx context.Context, req *pb.CreateContainerRequest) (*emptypb.Empty, error) {
	id := req.GetContainerId()
	spec := req.GetOCI()
	switch {
	case id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == "..":
		return nil, status.Errorf(codes.InvalidArgument, "bad container id %q", id)
	case spec == nil || spec.GetProcess() == nil || len(spec.GetProcess().GetArgs()) == 0:
		return nil, status.Errorf(codes.InvalidArgument, "container %s: OCI spec has no process args", id)
	case spec.GetRoot().GetPath() == "":
		return nil, status.Errorf(codes.InvalidArgument, "container %s: OCI spec has no root path", id)
	}
	if _, err := pty.SizeOf(spec.GetProcess()); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "container %s: %v", id, status.Convert(err).Message())
	}
	if err := a.waitModules(ctx); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sandboxID == "" {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: no sandbox (CreateSandbox first)", id)
	}
	if _, ok := a.containers[id]; ok {
		return nil, status.Errorf(codes.AlreadyExists, "container %s already exists", id)
	}
	var mounted []string
	for _, s := range req.GetStorages() {
		mp, err := a.mounts.Add(ctx, s)
		if err != nil {
			a.mounts.Release(mounted)
			return nil, fmt.Errorf("container %s: %w", id, err)
		}
		log.Printf("container %s storage %s %s mounted on %s", id, s.GetDriver(), s.GetSource(), mp)
		mounted = append(mounted, mp)
	}
	rootfs := spec.GetRoot().GetPath()
	if !filepath.IsAbs(rootfs) {
		rootfs = filepath.Join(sharedContainersDir, id, rootfs)
	}
	if fi, err := os.Stat(rootfs); err != nil || !fi.IsDir() {
		a.mounts.Release(mounted)
		return nil, status.Errorf(codes.NotFound, "container %s: rootfs %s is not a directory (%v)", id, rootfs, err)
	}
	if _, err := initproc.ProcessPrivileges(spec.GetProcess(), spec.GetLinux().GetSeccomp()); err != nil {
		a.mounts.Release(mounted)
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	if prog, skipped, _ := seccomp.Compile(spec.GetLinux().GetSeccomp()); prog != nil {
		log.Printf("container %s: seccomp filter of %d instructions; syscalls unknown to this architecture, skipped: %v", id, len(prog.Filter), skipped)
	}
	cg, err := a.cgroups.Create(id, spec)
	if err != nil {
		a.mounts.Release(mounted)
		return nil, err
	}
	execID := req.GetExecId()
	if execID == "" {
		execID = id
	}
	a.containers[id] = &container{
		id:       id,
		spec:     spec,
		rootfs:   rootfs,
		storages: mounted,
		init:     process.New(execID),
		cgroup:   cg,
		execs:    map[string]*process.Process{},
		podPID:   req.GetSandboxPidns() && id != a.sandboxID,
	}
	return &emptypb.Empty{}, nil
}

// cloneFlags are the namespaces a container's init is started in: always
// its own mount and UTS namespaces, and its own PID namespace unless the
// spec lists namespaces without one. Like Kata's agent, that container then
// shares the agent's PID namespace, as a pod without hostPID isolation would
// share the host's: its processes see (and as root can signal) PID 1.
func cloneFlags(spec *pb.Spec) uintptr {
	flags := uintptr(unix.CLONE_NEWNS | unix.CLONE_NEWUTS)
	nss := spec.GetLinux().GetNamespaces()
	if len(nss) == 0 {
		return flags | unix.CLONE_NEWPID
	}
	for _, ns := range nss {
		if ns.GetType() == "pid" {
			return flags | unix.CLONE_NEWPID
		}
	}
	return flags
}

// StartContainer implements grpc.AgentService. A command that cannot be
// executed in the rootfs is an error naming it (the helper then exits 127).
func (a *Agent) StartContainer(ctx context.Context, req *pb.StartContainerRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	c, ok := a.containers[req.GetContainerId()]
	a.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %s not found", req.GetContainerId())
	}
	p := c.init
	if !c.starting.CompareAndSwap(false, true) {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s already started", c.id)
	}
	proc := c.spec.GetProcess()
	size, err := pty.SizeOf(proc)
	if err != nil {
		return nil, err
	}
	priv, err := initproc.ProcessPrivileges(proc, c.spec.GetLinux().GetSeccomp())
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", c.id, err)
	}
	cfg := initproc.InitConfig{
		Rootfs:   c.rootfs,
		Readonly: c.spec.GetRoot().GetReadonly(),
		Hostname: c.spec.GetHostname(),
		Args:     proc.GetArgs(),
		Env:      proc.GetEnv(),
		Cwd:      proc.GetCwd(),
		Terminal: proc.GetTerminal(),
		Console:  size,
		// The user, capabilities, rlimits, no_new_privs and seccomp filter.
		Privileges: priv,
		Sysctl:     c.spec.GetLinux().GetSysctl(),
		// Paths the container must not read or write (/proc/kcore,
		// /proc/sys, ...): CRI fills them in unless the pod is privileged.
		MaskedPaths:   c.spec.GetLinux().GetMaskedPaths(),
		ReadonlyPaths: c.spec.GetLinux().GetReadonlyPaths(),
	}
	for _, m := range c.spec.GetMounts() {
		cfg.Mounts = append(cfg.Mounts, initproc.Mount{Destination: m.GetDestination(), Source: m.GetSource(), Type: m.GetType(), Options: m.GetOptions()})
	}
	blob, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	syncR, syncW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer syncR.Close()
	var podPID *os.File
	if c.podPID {
		if podPID, err = a.podPIDNamespace(c.id); err != nil {
			syncW.Close()
			return nil, err
		}
		defer podPID.Close()
	}
	cmd := &exec.Cmd{
		// Ourselves, wherever we were started from: /init of the
		// initramfs, /sbin/init of the image.
		Path:       "/proc/self/exe",
		Args:       []string{"/init", initproc.ContainerInitArg},
		Env:        []string{initproc.ConfigEnv + "=" + string(blob)},
		ExtraFiles: []*os.File{syncW},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: c.startFlags(),
			Setsid:     true,
			// clone3 straight into the container's cgroup: nothing of the
			// container runs outside its limits.
			UseCgroupFD: true,
			CgroupFD:    c.cgroup.FD(),
		},
	}
	err = p.StartInit(cmd, cfg.Terminal, podPID)
	syncW.Close()
	if err != nil {
		return nil, fmt.Errorf("container %s: start init: %w", c.id, err)
	}
	msg, _ := io.ReadAll(io.LimitReader(syncR, 64<<10))
	if len(msg) > 0 {
		<-p.Done()
		return nil, status.Errorf(codes.NotFound, "container %s: %s", c.id, msg)
	}
	c.startedAt.Store(time.Now().UnixNano())
	log.Printf("container %s started: pid %d %q", c.id, cmd.Process.Pid, cfg.Args)
	return &emptypb.Empty{}, nil
}

// ExecProcess implements grpc.AgentService. The process joins the container
// init's UTS, PID and mount namespaces: a goroutine locks its OS thread,
// unshares the thread's filesystem attributes (setns into a mount namespace
// needs them private), joins the namespaces, and forks the process from that
// thread, which then dies with the goroutine. The command is looked up inside
// the container, so a missing one is an error naming it.
func (a *Agent) ExecProcess(ctx context.Context, req *pb.ExecProcessRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c, ok := a.containers[req.GetContainerId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %s not found", req.GetContainerId())
	}
	execID := req.GetExecId()
	if execID == "" || execID == c.init.ExecID() {
		return nil, status.Errorf(codes.InvalidArgument, "container %s: bad exec id %q", c.id, execID)
	}
	if _, dup := c.execs[execID]; dup {
		return nil, status.Errorf(codes.AlreadyExists, "container %s: exec %s exists", c.id, execID)
	}
	if !c.init.Running() {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s is not running", c.id)
	}
	if c.cgroup.Frozen() {
		// The exec would start frozen, and its start would never report.
		return nil, status.Errorf(codes.FailedPrecondition, "container %s is paused: resume it first", c.id)
	}
	proc := req.GetProcess()
	if proc == nil || len(proc.GetArgs()) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "container %s exec %s: no args", c.id, execID)
	}
	size, err := pty.SizeOf(proc)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "container %s exec %s: %v", c.id, execID, status.Convert(err).Message())
	}
	// An exec gets the container's seccomp profile, as under Kata's agent.
	priv, err := initproc.ProcessPrivileges(proc, c.spec.GetLinux().GetSeccomp())
	if err != nil {
		return nil, fmt.Errorf("container %s exec %s: %w", c.id, execID, err)
	}
	xc := &initproc.ExecConfig{Args: proc.GetArgs(), Env: proc.GetEnv(), Cwd: proc.GetCwd(), Privileges: priv}
	syncR, syncW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer syncR.Close()
	p := process.New(execID)
	cmd := &exec.Cmd{
		// The exec helper (privileges.go), through the container's /proc:
		// the process forks in the container's mount namespace.
		Path:       "/proc/self/exe",
		Args:       []string{"/init", initproc.ExecInitArg},
		ExtraFiles: []*os.File{syncW},
		SysProcAttr: &syscall.SysProcAttr{
			Setsid:      true,
			UseCgroupFD: true,
			CgroupFD:    c.cgroup.FD(),
		},
	}
	err = p.StartExec(c.init.Pid(), cmd, xc, proc.GetTerminal(), size)
	syncW.Close()
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return nil, status.Errorf(codes.NotFound, "container %s exec %s: %v", c.id, execID, err)
		}
		return nil, fmt.Errorf("container %s exec %s: %w", c.id, execID, err)
	}
	if msg, _ := io.ReadAll(io.LimitReader(syncR, 64<<10)); len(msg) > 0 {
		<-p.Done()
		return nil, status.Errorf(codes.FailedPrecondition, "container %s exec %s: %s", c.id, execID, msg)
	}
	c.execs[execID] = p
	log.Printf("container %s exec %s started: pid %d %q", c.id, execID, cmd.Process.Pid, cmd.Args)
	return &emptypb.Empty{}, nil
}

// sandboxDNS is where the sandbox's resolv.conf is written; it is then
// bound over /etc/resolv.conf, as Kata's agent does, because the guest
// image's /etc is read-only.
const sandboxDNS = "/run/kata-containers/sandbox/resolv.conf"

// setupDNS makes /etc/resolv.conf list the sandbox's DNS lines.
func setupDNS(dns []string) error {
	if err := os.MkdirAll(filepath.Dir(sandboxDNS), 0o755); err != nil {
		return fmt.Errorf("dns: %w", err)
	}
	if err := os.WriteFile(sandboxDNS, []byte(strings.Join(dns, "\n")+"\n"), 0o644); err != nil {
		return fmt.Errorf("dns: %w", err)
	}
	// The bind needs a file to cover; the image ships one, the initramfs
	// can create it.
	if _, err := os.Stat("/etc/resolv.conf"); errors.Is(err, fs.ErrNotExist) {
		if err := os.WriteFile("/etc/resolv.conf", nil, 0o644); err != nil {
			return fmt.Errorf("dns: %w", err)
		}
	}
	if err := unix.Mount(sandboxDNS, "/etc/resolv.conf", "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("dns: bind %s on /etc/resolv.conf: %w", sandboxDNS, err)
	}
	return nil
}

// lookup finds a process: an empty exec id or the init's exec id means the
// container's init process.
func (a *Agent) lookup(cid, eid string) (*container, *process.Process, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c, ok := a.containers[cid]
	if !ok {
		return nil, nil, status.Errorf(codes.NotFound, "container %s not found", cid)
	}
	if eid == "" || eid == c.init.ExecID() {
		return c, c.init, nil
	}
	p, ok := c.execs[eid]
	if !ok {
		return nil, nil, status.Errorf(codes.NotFound, "container %s: process %s not found", cid, eid)
	}
	return c, p, nil
}

// WaitProcess implements grpc.AgentService.
func (a *Agent) WaitProcess(ctx context.Context, req *pb.WaitProcessRequest) (*pb.WaitProcessResponse, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if !p.Started() {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: process %s not started", c.id, p.ExecID())
	}
	select {
	case <-p.Done():
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// Exec'd processes stay in the table until RemoveContainer: the host may
	// still be draining their output when the wait returns.
	return &pb.WaitProcessResponse{Status: p.Status()}, nil
}

// SignalProcess implements grpc.AgentService.
func (a *Agent) SignalProcess(_ context.Context, req *pb.SignalProcessRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	sig := req.GetSignal()
	if sig == 0 || sig > 64 {
		return nil, status.Errorf(codes.InvalidArgument, "bad signal %d", sig)
	}
	if !p.Running() {
		return &emptypb.Empty{}, nil
	}
	if started := c.startedAt.Load(); p == c.init && started != 0 && c.ownPIDNamespace() {
		awaitHandler(p.Pid(), syscall.Signal(sig), time.Unix(0, started), p.Done())
	}
	if err := p.Signal(syscall.Signal(sig)); err != nil {
		return nil, fmt.Errorf("container %s: %w", c.id, err)
	}
	return &emptypb.Empty{}, nil
}

// RemoveContainer implements grpc.AgentService.
func (a *Agent) RemoveContainer(ctx context.Context, req *pb.RemoveContainerRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	c, ok := a.containers[req.GetContainerId()]
	a.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %s not found", req.GetContainerId())
	}
	timeout := time.Duration(req.GetTimeout()) * time.Second
	if timeout == 0 {
		timeout = 24 * time.Hour
	}
	if !c.killAll(ctx, timeout) {
		return nil, status.Errorf(codes.DeadlineExceeded, "container %s: processes still running after %s", c.id, timeout)
	}
	a.cgroups.Remove(c.cgroup)
	a.mounts.Release(c.storages)
	a.mu.Lock()
	delete(a.containers, c.id)
	a.mu.Unlock()
	return &emptypb.Empty{}, nil
}

// killAll SIGKILLs the container init (which takes its PID namespace with
// it) and waits for it; false if it is still alive after timeout.
func (c *container) killAll(ctx context.Context, timeout time.Duration) bool {
	procs := []*process.Process{c.init}
	for _, p := range c.execs {
		procs = append(procs, p)
	}
	for _, p := range procs {
		if p.Running() {
			_ = p.Signal(syscall.SIGKILL)
		}
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	for _, p := range procs {
		if !p.Started() {
			continue
		}
		select {
		case <-p.Done():
		case <-t.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
	return true
}

func (a *Agent) readStream(ctx context.Context, req *pb.ReadStreamRequest, stderr bool) (*pb.ReadStreamResponse, error) {
	_, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	data, err := p.ReadOutput(ctx, stderr, int(min(req.GetLen(), 1<<20)))
	if err != nil {
		return nil, err
	}
	return &pb.ReadStreamResponse{Data: data}, nil
}

// ReadStdout implements grpc.AgentService; empty data means end of stream.
func (a *Agent) ReadStdout(ctx context.Context, req *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	return a.readStream(ctx, req, false)
}

// ReadStderr implements grpc.AgentService; empty data means end of stream.
func (a *Agent) ReadStderr(ctx context.Context, req *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	return a.readStream(ctx, req, true)
}

// WriteStdin implements grpc.AgentService.
func (a *Agent) WriteStdin(_ context.Context, req *pb.WriteStreamRequest) (*pb.WriteStreamResponse, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	f := p.Stdin()
	if f == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: stdin of %s is closed or not started", c.id, p.ExecID())
	}
	n, err := f.Write(req.GetData())
	if errors.Is(err, os.ErrClosed) {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: stdin of %s is closed", c.id, p.ExecID())
	}
	if err != nil {
		return nil, fmt.Errorf("container %s: write stdin of %s: %w", c.id, p.ExecID(), err)
	}
	return &pb.WriteStreamResponse{Len: uint32(n)}, nil
}

// CloseStdin implements grpc.AgentService.
func (a *Agent) CloseStdin(_ context.Context, req *pb.CloseStdinRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if err := p.CloseInput(); err != nil {
		return nil, fmt.Errorf("container %s: close stdin of %s: %w", c.id, p.ExecID(), err)
	}
	return &emptypb.Empty{}, nil
}

// TtyWinResize implements grpc.AgentService: it resizes a process's terminal.
func (a *Agent) TtyWinResize(_ context.Context, req *pb.TtyWinResizeRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if err := p.Resize(req.GetRow(), req.GetColumn()); err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, status.Errorf(status.Code(err), "container %s: %s", c.id, status.Convert(err).Message())
		}
		return nil, fmt.Errorf("container %s: %w", c.id, err)
	}
	return &emptypb.Empty{}, nil
}

// containerCgroupOf looks a container up for a cgroup call.
func (a *Agent) containerCgroupOf(id string) (*cgroups.Cgroup, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c, ok := a.containers[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %s not found", id)
	}
	return c.cgroup, nil
}

// UpdateContainer implements grpc.AgentService: it rewrites the
// container's cgroup limits.
func (a *Agent) UpdateContainer(_ context.Context, req *pb.UpdateContainerRequest) (*emptypb.Empty, error) {
	cg, err := a.containerCgroupOf(req.GetContainerId())
	if err != nil {
		return nil, err
	}
	if err := a.cgroups.Apply(cg, req.GetResources()); err != nil {
		return nil, fmt.Errorf("container %s: update: %w", cg.ID(), err)
	}
	log.Printf("container %s: resources updated", cg.ID())
	return &emptypb.Empty{}, nil
}

// StatsContainer implements grpc.AgentService from the container's cgroup.
func (a *Agent) StatsContainer(_ context.Context, req *pb.StatsContainerRequest) (*pb.StatsContainerResponse, error) {
	cg, err := a.containerCgroupOf(req.GetContainerId())
	if err != nil {
		return nil, err
	}
	st, err := cg.Stats()
	if err != nil {
		return nil, err
	}
	return &pb.StatsContainerResponse{CgroupStats: st}, nil
}

// PauseContainer implements grpc.AgentService by freezing the container's cgroup.
func (a *Agent) PauseContainer(ctx context.Context, req *pb.PauseContainerRequest) (*emptypb.Empty, error) {
	cg, err := a.containerCgroupOf(req.GetContainerId())
	if err != nil {
		return nil, err
	}
	if err := cg.Freeze(ctx, true); err != nil {
		return nil, err
	}
	log.Printf("container %s paused", cg.ID())
	return &emptypb.Empty{}, nil
}

// ResumeContainer implements grpc.AgentService by thawing the container's cgroup.
func (a *Agent) ResumeContainer(ctx context.Context, req *pb.ResumeContainerRequest) (*emptypb.Empty, error) {
	cg, err := a.containerCgroupOf(req.GetContainerId())
	if err != nil {
		return nil, err
	}
	if err := cg.Freeze(ctx, false); err != nil {
		return nil, err
	}
	log.Printf("container %s resumed", cg.ID())
	return &emptypb.Empty{}, nil
}

// GetOOMEvent implements grpc.AgentService: it blocks until a container's
// cgroup sees an OOM kill and names the container.
func (a *Agent) GetOOMEvent(ctx context.Context, _ *pb.GetOOMEventRequest) (*pb.OOMEvent, error) {
	select {
	case id := <-a.cgroups.OOM():
		return &pb.OOMEvent{ContainerId: id}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
