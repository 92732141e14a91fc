package main

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
	"runtime"
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
)

// sharedContainersDir is where Kata's shared directory is mounted; relative
// OCI root paths are taken relative to <dir>/<container id>.
const sharedContainersDir = "/run/kata-containers/shared/containers"

// agent implements grpc.AgentService and grpc.Health for the test guest.
type agent struct {
	// mu guards the fields below. Lock order: mu, then the storage set's,
	// the cgroups' and the hostile mode's mutexes, none of which is held
	// while mu is taken. Its holders wait for mounts, a process's start
	// report and (DestroySandbox) the kills of what runs, at most 5 s each,
	// and for the hostile racer's end; nothing they wait for takes mu.
	mu         sync.Mutex
	sandboxID  string
	storages   []string // sandbox mount points, in mount order
	mounts     storageSet
	containers map[string]*container
	cgroups    *cgroups
	poweroff   chan struct{}
	once       sync.Once

	// modulesDone is closed when the background module loading has ended;
	// modulesErr is its result, readable after that.
	modulesDone chan struct{}
	modulesErr  error

	// hostile, when set, makes this agent a compromised one (hostile.go).
	hostile *hostile
}

type container struct {
	id       string
	spec     *pb.Spec
	rootfs   string
	storages []string
	init     *process
	cgroup   *containerCgroup
	starting atomic.Bool
	execs    map[string]*process
}

// process is a container's init or an exec'd process.
type process struct {
	execID string
	cmd    *exec.Cmd
	// stdin is the write end of the process's stdin pipe, set once at
	// start; os.File serialises concurrent writes and a Close wakes a
	// blocked one, so no lock is held across a write that may block.
	stdin atomic.Pointer[os.File]
	// tty is the terminal of a process with one, set once at start.
	tty     *terminal
	stdout  *outputBuffer
	stderr  *outputBuffer
	started atomic.Bool   // set once cmd has started
	done    chan struct{} // closed after the process is reaped
	status  int32
}

func newAgent() *agent {
	return &agent{containers: map[string]*container{}, cgroups: newCgroups(), poweroff: make(chan struct{}), modulesDone: make(chan struct{})}
}

// waitModules waits for the storage modules, which load while the agent
// already serves.
func (a *agent) waitModules(ctx context.Context) error {
	select {
	case <-a.modulesDone:
		if a.modulesErr != nil {
			return status.Errorf(codes.Internal, "guest kernel modules: %v", a.modulesErr)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// serve runs the ttrpc server on every agent channel until DestroySandbox.
func (a *agent) serve(ctx context.Context) error {
	ls := waitChannels(30 * time.Second)
	if len(ls) == 0 {
		return errors.New("no agent channel: neither virtio-serial port " + serialPortName + " nor a vsock device appeared")
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		return err
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
	log.Printf("powering off")
	powerOff()
	select {}
}

// Check implements grpc.Health.
func (a *agent) Check(context.Context, *pb.CheckRequest) (*pb.HealthCheckResponse, error) {
	return &pb.HealthCheckResponse{Status: pb.HealthCheckResponse_SERVING}, nil
}

// Version implements grpc.Health.
func (a *agent) Version(context.Context, *pb.CheckRequest) (*pb.VersionCheckResponse, error) {
	return &pb.VersionCheckResponse{AgentVersion: "kata-fsx-test-agent", GrpcVersion: "ttrpc"}, nil
}

// CreateSandbox implements grpc.AgentService.
func (a *agent) CreateSandbox(ctx context.Context, req *pb.CreateSandboxRequest) (*emptypb.Empty, error) {
	if err := a.waitModules(ctx); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sandboxID != "" {
		return nil, status.Errorf(codes.AlreadyExists, "sandbox %q already created", a.sandboxID)
	}
	for _, m := range req.GetKernelModules() {
		if err := loadModuleByName(m.GetName()); err != nil {
			return nil, err
		}
	}
	if h := req.GetHostname(); h != "" {
		if err := unix.Sethostname([]byte(h)); err != nil {
			return nil, fmt.Errorf("sethostname: %w", err)
		}
	}
	if err := upLoopback(); err != nil {
		return nil, err
	}
	if dns := req.GetDns(); len(dns) > 0 {
		if err := setupDNS(dns); err != nil {
			return nil, err
		}
	}
	var mounted []string
	for _, s := range req.GetStorages() {
		mp, err := a.mounts.add(ctx, s)
		if err != nil {
			a.mounts.release(mounted)
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
	a.hostile.attack("sandbox")
	a.hostile.race()
	return &emptypb.Empty{}, nil
}

// DestroySandbox implements grpc.AgentService: it kills what still runs,
// unmounts, syncs and powers the VM off once the reply is sent.
func (a *agent) DestroySandbox(ctx context.Context, _ *pb.DestroySandboxRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.hostile.endRace()
	a.hostile.attack("teardown")
	for id, c := range a.containers {
		c.killAll(ctx, 5*time.Second)
		a.cgroups.remove(c.cgroup)
		a.mounts.release(c.storages)
		delete(a.containers, id)
	}
	a.mounts.release(a.storages)
	a.storages = nil
	unix.Sync()
	a.once.Do(func() { close(a.poweroff) })
	return &emptypb.Empty{}, nil
}

// CreateContainer implements grpc.AgentService: it mounts the container's
// storages and prepares its init process; StartContainer runs it.
func (a *agent) CreateContainer(ctx context.Context, req *pb.CreateContainerRequest) (*emptypb.Empty, error) {
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
	if _, err := terminalSize(spec.GetProcess()); err != nil {
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
		mp, err := a.mounts.add(ctx, s)
		if err != nil {
			a.mounts.release(mounted)
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
		a.mounts.release(mounted)
		return nil, status.Errorf(codes.NotFound, "container %s: rootfs %s is not a directory (%v)", id, rootfs, err)
	}
	if _, err := processPrivileges(spec.GetProcess(), spec.GetLinux().GetSeccomp()); err != nil {
		unmountAll(mounted)
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	if prog, skipped, _ := compileSeccomp(spec.GetLinux().GetSeccomp()); prog != nil {
		log.Printf("container %s: seccomp filter of %d instructions; syscalls unknown to this architecture, skipped: %v", id, len(prog.Filter), skipped)
	}
	cg, err := a.cgroups.create(id, spec)
	if err != nil {
		unmountAll(mounted)
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
		init:     newProcess(execID),
		cgroup:   cg,
		execs:    map[string]*process{},
	}
	a.hostile.attack("create")
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

func newProcess(execID string) *process {
	return &process{execID: execID, stdout: newOutputBuffer(), stderr: newOutputBuffer(), done: make(chan struct{})}
}

// StartContainer implements grpc.AgentService. A command that cannot be
// executed in the rootfs is an error naming it (the helper then exits 127).
func (a *agent) StartContainer(ctx context.Context, req *pb.StartContainerRequest) (*emptypb.Empty, error) {
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
	size, err := terminalSize(proc)
	if err != nil {
		return nil, err
	}
	priv, err := processPrivileges(proc, c.spec.GetLinux().GetSeccomp())
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", c.id, err)
	}
	cfg := initConfig{
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
	}
	for _, m := range c.spec.GetMounts() {
		cfg.Mounts = append(cfg.Mounts, mountEntry{Destination: m.GetDestination(), Source: m.GetSource(), Type: m.GetType(), Options: m.GetOptions()})
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
	cmd := &exec.Cmd{
		// Ourselves, wherever we were started from: /init of the
		// initramfs, /sbin/init of the image.
		Path:       "/proc/self/exe",
		Args:       []string{"/init", containerInitArg},
		Env:        []string{initConfigEnv + "=" + string(blob)},
		ExtraFiles: []*os.File{syncW},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: cloneFlags(c.spec),
			Setsid:     true,
			// clone3 straight into the container's cgroup: nothing of the
			// container runs outside its limits.
			UseCgroupFD: true,
			CgroupFD:    c.cgroup.fd,
		},
	}
	if cfg.Terminal {
		err = startInitTerminal(p, cmd)
	} else {
		err = p.start(cmd, func() error { return cmd.Start() })
	}
	syncW.Close()
	if err != nil {
		return nil, fmt.Errorf("container %s: start init: %w", c.id, err)
	}
	msg, _ := io.ReadAll(io.LimitReader(syncR, 64<<10))
	if len(msg) > 0 {
		<-p.done
		return nil, status.Errorf(codes.NotFound, "container %s: %s", c.id, msg)
	}
	log.Printf("container %s started: pid %d %q", c.id, cmd.Process.Pid, cfg.Args)
	return &emptypb.Empty{}, nil
}

// start wires stdio pipes into cmd, runs startFn and reaps in the background.
func (p *process) start(cmd *exec.Cmd, startFn func() error) error {
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		return err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		outR.Close()
		outW.Close()
		return err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdinR, outW, errW
	err = startFn()
	stdinR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		stdinW.Close()
		outR.Close()
		errR.Close()
		return err
	}
	p.cmd = cmd
	p.stdin.Store(stdinW)
	p.started.Store(true)
	outDone, errDone := make(chan struct{}), make(chan struct{})
	stop := make(chan struct{})
	go func() { p.stdout.fill(outR, stop); close(outDone) }()
	go func() { p.stderr.fill(errR, stop); close(errDone) }()
	go func() {
		_ = cmd.Wait()
		// The pipes still hold what the process wrote last: the copiers take
		// them to EOF. Only a descendant that kept a pipe open keeps it from
		// ending; after a grace period the streams are cut, and the copiers
		// still take what is in the pipes then (see fill), so a late timer
		// under load costs nothing but the descendant's later output.
		grace := time.NewTimer(descendantGrace)
		both := make(chan struct{})
		go func() { <-outDone; <-errDone; close(both) }()
		select {
		case <-both:
		case <-grace.C:
			close(stop)
			now := time.Now()
			_ = outR.SetReadDeadline(now)
			_ = errR.SetReadDeadline(now)
			<-both
		}
		grace.Stop()
		outR.Close()
		errR.Close()
		// Nobody reads stdin any more (but a descendant, which gets EOF).
		p.closeStdin()
		p.status = exitStatus(cmd.ProcessState)
		close(p.done)
	}()
	return nil
}

// descendantGrace is how long the streams of an exited process stay open
// for descendants that inherited its stdout or stderr.
const descendantGrace = 2 * time.Second

// closeStdin closes the stdin pipe; a WriteStdin blocked on it fails with
// os.ErrClosed.
func (p *process) closeStdin() {
	if f := p.stdin.Swap(nil); f != nil {
		f.Close()
	}
}

func exitStatus(ps *os.ProcessState) int32 {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int32(ws.Signal())
	}
	return int32(ps.ExitCode())
}

// ExecProcess implements grpc.AgentService. The process joins the container
// init's UTS, PID and mount namespaces: a goroutine locks its OS thread,
// unshares the thread's filesystem attributes (setns into a mount namespace
// needs them private), joins the namespaces, and forks the process from that
// thread, which then dies with the goroutine. The command is looked up inside
// the container, so a missing one is an error naming it.
func (a *agent) ExecProcess(ctx context.Context, req *pb.ExecProcessRequest) (*emptypb.Empty, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.hostile.attack("exec")
	c, ok := a.containers[req.GetContainerId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "container %s not found", req.GetContainerId())
	}
	execID := req.GetExecId()
	if execID == "" || execID == c.init.execID {
		return nil, status.Errorf(codes.InvalidArgument, "container %s: bad exec id %q", c.id, execID)
	}
	if _, dup := c.execs[execID]; dup {
		return nil, status.Errorf(codes.AlreadyExists, "container %s: exec %s exists", c.id, execID)
	}
	if !c.init.running() {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s is not running", c.id)
	}
	if c.cgroup.frozen() {
		// The exec would start frozen, and its start would never report.
		return nil, status.Errorf(codes.FailedPrecondition, "container %s is paused: resume it first", c.id)
	}
	proc := req.GetProcess()
	if proc == nil || len(proc.GetArgs()) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "container %s exec %s: no args", c.id, execID)
	}
	size, err := terminalSize(proc)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "container %s exec %s: %v", c.id, execID, status.Convert(err).Message())
	}
	// An exec gets the container's seccomp profile, as under Kata's agent.
	priv, err := processPrivileges(proc, c.spec.GetLinux().GetSeccomp())
	if err != nil {
		return nil, fmt.Errorf("container %s exec %s: %w", c.id, execID, err)
	}
	xc := &execConfig{Args: proc.GetArgs(), Env: proc.GetEnv(), Cwd: proc.GetCwd(), Privileges: priv}
	syncR, syncW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer syncR.Close()
	p := newProcess(execID)
	cmd := &exec.Cmd{
		// The exec helper (privileges.go), through the container's /proc:
		// the process forks in the container's mount namespace.
		Path:       "/proc/self/exe",
		Args:       []string{"/init", execInitArg},
		ExtraFiles: []*os.File{syncW},
		SysProcAttr: &syscall.SysProcAttr{
			Setsid:      true,
			UseCgroupFD: true,
			CgroupFD:    c.cgroup.fd,
		},
	}
	pid := c.init.cmd.Process.Pid
	if proc.GetTerminal() {
		err = p.startTerminal(cmd, func() (*os.File, error) { return startExecTerminal(pid, cmd, xc, size) })
	} else {
		err = p.start(cmd, func() error { return startInNamespaces(pid, cmd, xc, nil) })
	}
	syncW.Close()
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return nil, status.Errorf(codes.NotFound, "container %s exec %s: %v", c.id, execID, err)
		}
		return nil, fmt.Errorf("container %s exec %s: %w", c.id, execID, err)
	}
	if msg, _ := io.ReadAll(io.LimitReader(syncR, 64<<10)); len(msg) > 0 {
		<-p.done
		return nil, status.Errorf(codes.FailedPrecondition, "container %s exec %s: %s", c.id, execID, msg)
	}
	c.execs[execID] = p
	log.Printf("container %s exec %s started: pid %d %q", c.id, execID, cmd.Process.Pid, cmd.Args)
	return &emptypb.Empty{}, nil
}

// startInNamespaces starts cmd inside the namespaces of process pid; see
// ExecProcess for why a dedicated, never-unlocked OS thread does it.
// prepare, if not nil, runs on that thread once it joined them.
func startInNamespaces(pid int, cmd *exec.Cmd, xc *execConfig, prepare func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread's namespaces no longer match the rest
		// of the agent, so the runtime must discard it when we return.
		errc <- joinAndStart(pid, cmd, xc, prepare)
	}()
	return <-errc
}

func joinAndStart(pid int, cmd *exec.Cmd, xc *execConfig, prepare func() error) error {
	namespaces := []struct {
		name string
		typ  int
	}{{"uts", unix.CLONE_NEWUTS}, {"pid", unix.CLONE_NEWPID}, {"mnt", unix.CLONE_NEWNS}}
	fds := make([]int, 0, len(namespaces))
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	// Open all first: after joining the mount namespace, /proc is the container's.
	for _, ns := range namespaces {
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, ns.name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s namespace of pid %d: %w", ns.name, pid, err)
		}
		fds = append(fds, fd)
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs attributes: %w", err)
	}
	for i, ns := range namespaces {
		if err := unix.Setns(fds[i], ns.typ); err != nil {
			return fmt.Errorf("join %s namespace of pid %d: %w", ns.name, pid, err)
		}
	}
	path, err := lookPath(xc.Args[0], xc.Env)
	if err != nil {
		return err
	}
	xc.Path = path
	// The child resolves /proc/self/exe in the container's procfs (this
	// thread's /proc/self is not in it: it has not joined the PID namespace).
	var st unix.Statfs_t
	if err := unix.Statfs("/proc", &st); err != nil || st.Type != unix.PROC_SUPER_MAGIC {
		return fmt.Errorf("the exec helper starts through the container's /proc/self/exe, and the container has no procfs on /proc (%v)", err)
	}
	blob, err := json.Marshal(xc)
	if err != nil {
		return err
	}
	cmd.Env = []string{initConfigEnv + "=" + string(blob)}
	if prepare != nil {
		if err := prepare(); err != nil {
			return err
		}
	}
	return cmd.Start()
}

func (p *process) running() bool {
	if !p.started.Load() {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// unmountAll unmounts mount points in reverse order, detaching busy ones.
func unmountAll(mps []string) {
	for i := len(mps) - 1; i >= 0; i-- {
		if err := unix.Unmount(mps[i], 0); err != nil {
			if err2 := unix.Unmount(mps[i], unix.MNT_DETACH); err2 != nil {
				log.Printf("unmount %s: %v", mps[i], err)
			}
		}
	}
}

// loadModuleByName loads a module shipped in the initramfs.
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

func loadModuleByName(name string) error {
	b, err := os.ReadFile(modulesList)
	if errors.Is(err, fs.ErrNotExist) {
		// The image's kernel has its drivers built in and ships no
		// modules: a built-in one is there already.
		if _, err := os.Stat(filepath.Join("/sys/module", strings.ReplaceAll(name, "-", "_"))); err == nil {
			return nil
		}
		return status.Errorf(codes.NotFound, "kernel module %s is not built into the guest kernel, and this guest has no loadable modules", name)
	}
	if err != nil {
		return fmt.Errorf("kernel module %s: %w", name, err)
	}
	want := strings.ReplaceAll(name, "-", "_")
	for _, line := range strings.Split(string(b), "\n") {
		base := strings.TrimSuffix(filepath.Base(line), ".ko")
		if strings.ReplaceAll(base, "-", "_") == want {
			return loadModule(line)
		}
	}
	return status.Errorf(codes.NotFound, "kernel module %s is not in the test initramfs", name)
}

// lookup finds a process: an empty exec id or the init's exec id means the
// container's init process.
func (a *agent) lookup(cid, eid string) (*container, *process, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c, ok := a.containers[cid]
	if !ok {
		return nil, nil, status.Errorf(codes.NotFound, "container %s not found", cid)
	}
	if eid == "" || eid == c.init.execID {
		return c, c.init, nil
	}
	p, ok := c.execs[eid]
	if !ok {
		return nil, nil, status.Errorf(codes.NotFound, "container %s: process %s not found", cid, eid)
	}
	return c, p, nil
}

// WaitProcess implements grpc.AgentService.
func (a *agent) WaitProcess(ctx context.Context, req *pb.WaitProcessRequest) (*pb.WaitProcessResponse, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if !p.started.Load() {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: process %s not started", c.id, p.execID)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// Exec'd processes stay in the table until RemoveContainer: the host may
	// still be draining their output when the wait returns.
	return &pb.WaitProcessResponse{Status: p.status}, nil
}

// SignalProcess implements grpc.AgentService.
func (a *agent) SignalProcess(_ context.Context, req *pb.SignalProcessRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	sig := req.GetSignal()
	if sig == 0 || sig > 64 {
		return nil, status.Errorf(codes.InvalidArgument, "bad signal %d", sig)
	}
	if !p.running() {
		return &emptypb.Empty{}, nil
	}
	err = p.cmd.Process.Signal(syscall.Signal(sig))
	if err != nil && !errors.Is(err, os.ErrProcessDone) {
		return nil, fmt.Errorf("container %s: signal %d to %s: %w", c.id, sig, p.execID, err)
	}
	return &emptypb.Empty{}, nil
}

// RemoveContainer implements grpc.AgentService.
func (a *agent) RemoveContainer(ctx context.Context, req *pb.RemoveContainerRequest) (*emptypb.Empty, error) {
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
	a.cgroups.remove(c.cgroup)
	a.mounts.release(c.storages)
	a.mu.Lock()
	delete(a.containers, c.id)
	a.mu.Unlock()
	// Last, so the shim's unbind meets what was planted.
	a.hostile.attack("delete")
	return &emptypb.Empty{}, nil
}

// killAll SIGKILLs the container init (which takes its PID namespace with
// it) and waits for it; false if it is still alive after timeout.
func (c *container) killAll(ctx context.Context, timeout time.Duration) bool {
	procs := []*process{c.init}
	for _, p := range c.execs {
		procs = append(procs, p)
	}
	for _, p := range procs {
		if p.running() {
			_ = p.cmd.Process.Kill()
		}
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	for _, p := range procs {
		if !p.started.Load() {
			continue
		}
		select {
		case <-p.done:
		case <-t.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
	return true
}

func (a *agent) readStream(ctx context.Context, req *pb.ReadStreamRequest, stderr bool) (*pb.ReadStreamResponse, error) {
	_, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	b := p.stdout
	if stderr {
		b = p.stderr
	}
	data, err := b.read(ctx, int(min(req.GetLen(), 1<<20)))
	if err != nil {
		return nil, err
	}
	return &pb.ReadStreamResponse{Data: data}, nil
}

// ReadStdout implements grpc.AgentService; empty data means end of stream.
func (a *agent) ReadStdout(ctx context.Context, req *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	return a.readStream(ctx, req, false)
}

// ReadStderr implements grpc.AgentService; empty data means end of stream.
func (a *agent) ReadStderr(ctx context.Context, req *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error) {
	return a.readStream(ctx, req, true)
}

// WriteStdin implements grpc.AgentService.
func (a *agent) WriteStdin(_ context.Context, req *pb.WriteStreamRequest) (*pb.WriteStreamResponse, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	f := p.stdin.Load()
	if f == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: stdin of %s is closed or not started", c.id, p.execID)
	}
	n, err := f.Write(req.GetData())
	if errors.Is(err, os.ErrClosed) {
		return nil, status.Errorf(codes.FailedPrecondition, "container %s: stdin of %s is closed", c.id, p.execID)
	}
	if err != nil {
		return nil, fmt.Errorf("container %s: write stdin of %s: %w", c.id, p.execID, err)
	}
	return &pb.WriteStreamResponse{Len: uint32(n)}, nil
}

// CloseStdin implements grpc.AgentService.
func (a *agent) CloseStdin(_ context.Context, req *pb.CloseStdinRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if p.started.Load() && p.tty != nil {
		if err := p.endTerminalInput(); err != nil {
			return nil, fmt.Errorf("container %s: close stdin of %s: %w", c.id, p.execID, err)
		}
		return &emptypb.Empty{}, nil
	}
	p.closeStdin()
	return &emptypb.Empty{}, nil
}

// TtyWinResize implements grpc.AgentService: it resizes a process's terminal.
func (a *agent) TtyWinResize(_ context.Context, req *pb.TtyWinResizeRequest) (*emptypb.Empty, error) {
	c, p, err := a.lookup(req.GetContainerId(), req.GetExecId())
	if err != nil {
		return nil, err
	}
	if err := p.resizeTerminal(req.GetRow(), req.GetColumn()); err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, status.Errorf(status.Code(err), "container %s: %s", c.id, status.Convert(err).Message())
		}
		return nil, fmt.Errorf("container %s: %w", c.id, err)
	}
	return &emptypb.Empty{}, nil
}
