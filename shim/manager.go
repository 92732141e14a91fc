// Package shim is kata-fsx's containerd shim v2, in containerd's language
// only: the start and delete commands that containerd runs (the manager),
// the Task API service (v2 and v3) over ttrpc, task and exec processes
// with their stdio, and events. Everything about the VM is package
// sandbox's: one sandbox per shim, booted by the pod's first container.
package shim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"syscall"
	"time"

	apitypes "github.com/containerd/containerd/api/types"

	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/fifo"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/sandbox/rootfs"
)

// RuntimeType is the containerd runtime type this shim answers to.
const RuntimeType = "io.containerd.kata-fsx.v2"

// socketDir holds the shims' ttrpc sockets, where containerd's own shims keep theirs.
const socketDir = "/run/containerd/s"

// EnvSocketDir, set in containerd's environment, moves the shim sockets
// elsewhere: tests give each private containerd its own directory.
const EnvSocketDir = "KATA_FSX_SHIM_SOCKET_DIR"

// signalTeardown bounds the teardown a SIGTERM or SIGINT starts: the VM
// gets the agent's goodbye and QEMU's quit within it, then is killed.
const signalTeardown = 8 * time.Second

func shimSocketDir() string {
	if d := os.Getenv(EnvSocketDir); d != "" {
		return d
	}
	return socketDir
}

// Annotations containerd's CRI plugin (and CRI-O) put on every container of a pod.
const (
	annContainerType      = "io.kubernetes.cri.container-type"
	annContainerTypeCRIO  = "io.kubernetes.cri-o.ContainerType"
	annSandboxID          = "io.kubernetes.cri.sandbox-id"
	annSandboxIDCRIO      = "io.kubernetes.cri-o.SandboxID"
	containerTypeSandbox  = "sandbox"
	containerTypeWorkload = "container"
)

// listenerFd is the fd the start command hands the server its socket on.
const listenerFd = 3

// hostMountsFd is the fd the start command hands the server the host's
// mount namespace on (its own, which is containerd's), so the server,
// in a mount namespace of its own, can still read host paths as the host
// sees them now.
const hostMountsFd = 4

// shimFlags are the flags containerd passes to every shim invocation.
type shimFlags struct {
	namespace     string
	address       string
	publishBinary string
	id            string
	bundle        string
	debug         bool
	action        string
}

func parseShimFlags(args []string, stderr io.Writer) (*shimFlags, error) {
	f := &shimFlags{}
	fs := flag.NewFlagSet("containerd-shim-kata-fsx-v2", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.namespace, "namespace", "", "namespace of the task")
	fs.StringVar(&f.address, "address", "", "containerd's grpc address")
	fs.StringVar(&f.publishBinary, "publish-binary", "", "containerd binary (unused: events go over ttrpc)")
	fs.StringVar(&f.id, "id", "", "id of the task")
	fs.StringVar(&f.bundle, "bundle", "", "bundle directory (default: the working directory)")
	fs.BoolVar(&f.debug, "debug", false, "debug logging")
	version := fs.Bool("v", false, "print the version")
	info := fs.Bool("info", false, "write the runtime's RuntimeInfo (protobuf) to stdout, as containerd 2.x's runtime introspection asks")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *version {
		f.action = "version"
		return f, nil
	}
	if *info {
		f.action = "info"
		return f, nil
	}
	if fs.NArg() != 1 {
		return nil, fmt.Errorf("want exactly one action (start, delete), got %q", fs.Args())
	}
	f.action = fs.Arg(0)
	if f.bundle == "" {
		wd, err := os.Getwd()
		if err != nil {
			return nil, fmt.Errorf("bundle: %w", err)
		}
		f.bundle = wd
	}
	if f.namespace == "" || f.id == "" {
		return nil, errors.New("-namespace and -id are required")
	}
	if err := sandbox.ValidID(f.id); err != nil {
		return nil, err
	}
	return f, nil
}

// Version is kata-fsx's release, set at link time by the Makefile.
var Version = "0.0.0-dev"

// ShimMain is the containerd-shim-kata-fsx-v2 binary: the `start` and
// `delete` commands containerd runs, and the long-lived server `start`
// spawns. defaultConfig is the last configuration file fallback.
// shimGCPercent is the serving shim's GOGC unless the environment sets one.
const shimGCPercent = 50

func ShimMain(args []string, stdout, stderr io.Writer, defaultConfig string) int {
	f, err := parseShimFlags(args, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2: %v\n", err)
		return 2
	}
	ctx := context.Background()
	switch f.action {
	case "version":
		fmt.Fprintf(stdout, "containerd-shim-kata-fsx-v2 %s (runtime %s)\n", Version, RuntimeType)
		return 0
	case "info":
		// containerd writes the runtime's options on stdin; kata-fsx's
		// info does not depend on them (its configuration is read when a
		// pod is created), as Kata's shim ignores them.
		feat, err := runtimeFeatures()
		if err != nil {
			fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2 -info: %v\n", err)
			return 1
		}
		b, err := proto.Marshal(&apitypes.RuntimeInfo{Name: RuntimeType, Version: &apitypes.RuntimeVersion{Version: Version}, Features: feat})
		if err != nil {
			fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2 -info: %v\n", err)
			return 1
		}
		stdout.Write(b)
		return 0
	case "start":
		addr, err := startShim(ctx, f)
		if err != nil {
			fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2 start: %v\n", err)
			return 1
		}
		// containerd reads this line as the shim's address, or (2.x)
		// as the bootstrap parameters that select Task API v3.
		fmt.Fprint(stdout, startResponse(ctx, f.address, addr))
		return 0
	case "delete":
		resp, err := deleteShim(ctx, f, stderr)
		if err != nil {
			fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2 delete: %v\n", err)
		}
		b, merr := proto.Marshal(resp)
		if merr != nil {
			fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2 delete: %v\n", merr)
			return 1
		}
		stdout.Write(b)
		if err != nil {
			return 1
		}
		return 0
	case "serve":
		if os.Getenv("GOGC") == "" {
			// One shim runs per pod and mostly idles: a smaller heap goal
			// (2 MiB rather than Go's 4 MiB minimum) keeps garbage out of
			// the private memory every pod costs the node, for little CPU.
			debug.SetGCPercent(shimGCPercent)
		}
		if err := serveShim(f, defaultConfig); err != nil {
			log.L.WithError(err).Error("shim server failed")
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "containerd-shim-kata-fsx-v2: unknown action %q\n", f.action)
	return 2
}

// podGroup is the pod a container belongs to: its sandbox id for a CRI
// workload container, else its own id (a sandbox, or a plain `ctr run`).
func podGroup(id string, annotations map[string]string) string {
	typ := annotations[annContainerType]
	if typ == "" {
		typ = annotations[annContainerTypeCRIO]
	}
	sb := annotations[annSandboxID]
	if sb == "" {
		sb = annotations[annSandboxIDCRIO]
	}
	if typ == containerTypeWorkload && sb != "" {
		return sb
	}
	return id
}

// socketPath is the pod's shim socket; the hash keeps it short and
// distinct per containerd instance and namespace.
func socketPath(containerdAddress, namespace, group string) string {
	d := sha256.Sum256([]byte("kata-fsx\x00" + containerdAddress + "\x00" + namespace + "\x00" + group))
	return filepath.Join(shimSocketDir(), hex.EncodeToString(d[:]))
}

// readBundleSpec reads the OCI spec containerd wrote into the bundle.
func readBundleSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("parse %s/config.json: %w", bundle, err)
	}
	return &s, nil
}

// startShim finds or spawns the server of the container's pod and returns its address.
func startShim(ctx context.Context, f *shimFlags) (string, error) {
	spec, err := readBundleSpec(f.bundle)
	if err != nil {
		return "", err
	}
	group := podGroup(f.id, spec.Annotations)
	sock := socketPath(f.address, f.namespace, group)
	addr := "unix://" + sock
	if group != f.id {
		// A workload container joins its pod's running shim.
		if c, err := net.DialTimeout("unix", sock, 2*time.Second); err == nil {
			c.Close()
			return addr, atomicfile.WriteFile(filepath.Join(f.bundle, "address"), []byte(addr), 0o600)
		}
		return "", fmt.Errorf("container %s: the shim of pod %s is not running at %s", f.id, group, sock)
	}
	if err := os.MkdirAll(shimSocketDir(), 0o711); err != nil {
		return "", fmt.Errorf("socket directory: %w", err)
	}
	if c, err := net.DialTimeout("unix", sock, time.Second); err == nil {
		c.Close()
		return "", fmt.Errorf("pod %s already has a shim at %s", group, sock)
	}
	_ = os.Remove(sock) // stale: its server is gone
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return "", fmt.Errorf("listen %s: %w", sock, err)
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // the server owns the socket from here
	defer ul.Close()
	if err := os.Chmod(sock, 0o600); err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("chmod %s: %w", sock, err)
	}
	lf, err := ul.File()
	if err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("listener fd: %w", err)
	}
	defer lf.Close()
	self, err := os.Executable()
	if err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("own executable: %w", err)
	}
	args := []string{"-namespace", f.namespace, "-address", f.address, "-publish-binary", f.publishBinary, "-id", f.id, "-bundle", f.bundle}
	if f.debug {
		args = append(args, "-debug")
	}
	hostMounts, err := os.Open("/proc/self/ns/mnt")
	if err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("own mount namespace: %w", err)
	}
	defer hostMounts.Close()
	cmd := exec.Command(self, append(args, "serve")...)
	cmd.Dir = f.bundle
	cmd.Env = os.Environ()
	cmd.ExtraFiles = []*os.File{lf, hostMounts}
	// Its own session: containerd's signals and exit must not reach the
	// pod. Its own mount namespace: the share's binds (container rootfs,
	// volumes) live there, out of the host's mount table, where a host
	// directory that a bind copied could not be removed while the pod
	// runs, and where nothing of them outlives the shim and its VM.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWNS}
	if err := cmd.Start(); err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("spawn shim server: %w", err)
	}
	pid := cmd.Process.Pid
	_ = cmd.Process.Release()
	if err := atomicfile.WriteFile(filepath.Join(f.bundle, "shim.pid"), []byte(fmt.Sprint(pid)), 0o600); err != nil {
		syscall.Kill(pid, syscall.SIGKILL)
		os.Remove(sock)
		return "", err
	}
	if err := atomicfile.WriteFile(filepath.Join(f.bundle, "address"), []byte(addr), 0o600); err != nil {
		syscall.Kill(pid, syscall.SIGKILL)
		os.Remove(sock)
		return "", err
	}
	return addr, nil
}

// serveShim is the long-lived server: it serves the Task API on the
// socket `start` handed over until Shutdown.
func serveShim(f *shimFlags, defaultConfig string) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	setupLogging(ctx, f)
	lf := os.NewFile(listenerFd, "shim-socket")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		return fmt.Errorf("socket from start: %w", err)
	}
	// The host's namespace must not reach QEMU or virtiofsd, which face
	// the guest: start passed the descriptor without close-on-exec.
	unix.CloseOnExec(hostMountsFd)
	hostMounts, err := mount.NamespaceOf(os.NewFile(hostMountsFd, "host-mount-namespace"))
	if err != nil {
		return fmt.Errorf("the host's mount namespace from start: %w", err)
	}
	defer hostMounts.Close()
	if err := enterOwnMounts(hostMounts); err != nil {
		return err
	}
	spec, err := readBundleSpec(f.bundle)
	if err != nil {
		return err
	}
	group := podGroup(f.id, spec.Annotations)
	sock := socketPath(f.address, f.namespace, group)
	defer os.Remove(sock)

	ev := newForwarder(ctx, f.namespace, os.Getenv("TTRPC_ADDRESS"))
	svc := newService(ctx, serviceOptions{namespace: f.namespace, group: group, events: ev, defaultConfig: defaultConfig, hostMounts: hostMounts})
	srv, err := ttrpc.NewServer()
	if err != nil {
		return fmt.Errorf("ttrpc server: %w", err)
	}
	taskapi.RegisterTaskService(srv, svc)
	registerTaskV3(srv, svc)
	// SIGTERM or SIGINT (an operator, or systemd stopping the pod's
	// scope, with or without containerd) tears the pod down as Shutdown
	// would instead of leaving the VM and the mounts behind; SIGKILL
	// cannot be caught, and QEMU and virtiofsd die with the shim through
	// their parent-death signal, leaving the directory to `shim delete`.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, unix.SIGTERM, unix.SIGINT)
	defer signal.Stop(sigs)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	go svc.watchOrphan(orphanGrace)
	log.G(ctx).WithField("pod", group).Infof("kata-fsx shim serving on %s", sock)
	select {
	case <-svc.Done():
	case sig := <-sigs:
		log.G(ctx).WithField("pod", group).Warnf("%v: tearing the pod down", sig)
		tctx, tcancel := context.WithTimeout(context.Background(), signalTeardown)
		svc.stopAll(tctx)
		tcancel()
	case err := <-served:
		if err != nil && !errors.Is(err, ttrpc.ErrServerClosed) {
			log.G(ctx).WithError(err).Error("ttrpc server stopped")
		}
	}
	// Let the Shutdown reply reach containerd before the socket closes.
	sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
	if err := srv.Shutdown(sctx); err != nil {
		log.G(ctx).WithError(err).Warn("ttrpc server shutdown")
	}
	scancel()
	svc.stopAll(context.Background())
	ev.Close()
	return nil
}

// setupLogging sends logs into the "log" fifo containerd opened in the
// bundle, which it copies into its own log.
func setupLogging(ctx context.Context, f *shimFlags) {
	if f.debug {
		_ = log.SetLevel("debug")
	}
	octx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	w, err := fifo.OpenFifo(octx, filepath.Join(f.bundle, "log"), unix.O_WRONLY, 0o700)
	if err != nil {
		log.L.Logger.SetOutput(io.Discard)
		return
	}
	log.L.Logger.SetOutput(w)
}

// deleteShim cleans up after a pod whose shim died: the pod's leftover
// processes, mounts and state, and the container's rootfs mount.
func deleteShim(ctx context.Context, f *shimFlags, warn io.Writer) (*taskapi.DeleteResponse, error) {
	resp := &taskapi.DeleteResponse{ExitedAt: timestamppb.Now(), ExitStatus: 128 + uint32(syscall.SIGKILL)}
	var errs []error
	st, err := readBundleState(f.bundle)
	switch {
	case errors.Is(err, os.ErrNotExist):
		// Create never got far enough to record anything, but the shim
		// may have made its socket: remove it unless a server answers.
		sock := socketPath(f.address, f.namespace, f.id)
		if c, err := net.DialTimeout("unix", sock, time.Second); err == nil {
			c.Close()
		} else {
			os.Remove(sock)
		}
	case err != nil:
		errs = append(errs, err)
	default:
		if st.OwnsSandbox && st.SandboxDir != "" {
			sock := socketPath(f.address, f.namespace, f.id)
			if c, err := net.DialTimeout("unix", sock, time.Second); err == nil {
				// The server still runs: it owns the pod and tears it down itself.
				c.Close()
				fmt.Fprintf(warn, "pod %s: its shim still serves %s; leaving the pod to it\n", st.SandboxID, sock)
			} else {
				errs = append(errs, sandbox.CleanupDir(st.SandboxDir))
				os.Remove(sock)
			}
		}
	}
	if err := rootfs.Unmount(filepath.Join(f.bundle, "rootfs")); err != nil {
		errs = append(errs, err)
	}
	return resp, errors.Join(errs...)
}

// bundleState is what the server records in the bundle for `delete`.
type bundleState struct {
	SandboxID   string `json:"sandbox_id"`
	SandboxDir  string `json:"sandbox_dir"`
	OwnsSandbox bool   `json:"owns_sandbox"`
}

const bundleStateFile = "kata-fsx.json"

func writeBundleState(bundle string, st bundleState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(bundle, bundleStateFile), b, 0o600)
}

func readBundleState(bundle string) (*bundleState, error) {
	b, err := os.ReadFile(filepath.Join(bundle, bundleStateFile))
	if err != nil {
		return nil, err
	}
	var st bundleState
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("%s: %w", bundleStateFile, err)
	}
	return &st, nil
}

// configFromOptions loads the configuration the Create request's runtime
// options point at (containerd's ConfigPath), else the usual lookup.
func configFromOptions(path, defaultConfig string) (*config.Config, error) {
	c, err := config.Load(path, defaultConfig)
	if err != nil {
		return nil, fmt.Errorf("load configuration: %w", err)
	}
	return c, nil
}
