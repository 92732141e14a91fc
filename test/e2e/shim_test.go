package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

// containerdEnv is a private containerd whose PATH finds the kata-fsx shim.
type containerdEnv struct {
	*env
	sock  string
	image string
	cmd   *exec.Cmd
	log   *bytes.Buffer
	logMu *sync.Mutex
	// version is the containerd it runs (KATA_FSX_CONTAINERD's, else Debian's).
	version containerdVersion
	// What startDaemon needs to start containerd again on the same root
	// and state (a test that kills it restarts it), and the channel
	// closed when the running daemon has exited.
	cfgPath   string
	daemonEnv []string
	sockDir   string
	exited    chan struct{}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func newContainerdEnv(t *testing.T) *containerdEnv {
	return newContainerdEnvFor(t, func() *env { return newEnv(t, `enable_annotations = ["shared_fs"]`) })
}

// newContainerdEnvFor is newContainerdEnv whose pods boot with the
// configuration of the env newEnv makes.
func newContainerdEnvFor(t *testing.T, newEnv func() *env) *containerdEnv {
	return newContainerdEnvWith(t, newEnv, nil, nil)
}

// newContainerdEnvWith is newContainerdEnvFor whose containerd also has
// the proxy snapshotters of proxies (name -> socket), which beforeStart,
// given the env, starts before containerd, as their systemd units order
// them.
func newContainerdEnvWith(t *testing.T, newEnv func() *env, proxies map[string]string, beforeStart func(*env)) *containerdEnv {
	v := containerdUnderTest(t)
	e := newEnv()
	shim, err := buildShim()
	if err != nil {
		t.Fatal(err)
	}
	// A socket directory of our own: /run/containerd/s is shared with
	// every other containerd on the host. Short, for sun_path's 107 bytes.
	sockDir, err := os.MkdirTemp("", "kfs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(sockDir) })
	ce := &containerdEnv{env: e, sock: filepath.Join(e.dir, "containerd.sock"), log: &bytes.Buffer{}, logMu: &sync.Mutex{}, version: v}
	cfg, err := containerdConfig{dir: e.dir, sock: ce.sock, kataConfig: e.config, opts: criOptions{ProxySnapshotters: proxies}}.render(v)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(e.dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	ce.cfgPath = cfgPath
	ce.daemonEnv = append(os.Environ(), containerdPATH(filepath.Dir(shim)), "KATA_FSX_SHIM_SOCKET_DIR="+sockDir)
	ce.sockDir = sockDir
	// Registered after newEnv's leftover check, so it runs first.
	t.Cleanup(func() {
		if ce.cmd == nil {
			return
		}
		// A test that failed half-way leaves tasks: shims outlive
		// containerd by design, so take them down through it first.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, id := range strings.Fields(ce.ctr(ctx, "tasks", "ls", "-q").stdout) {
			ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
			ce.ctr(ctx, "tasks", "delete", "-f", id)
		}
		for _, id := range strings.Fields(ce.ctr(ctx, "containers", "ls", "-q").stdout) {
			ce.ctr(ctx, "containers", "delete", id)
		}
		// Shims outlive the ctr command that deleted their pod by the
		// time they take to exit; give them that before newEnv's leftover
		// check calls them left behind.
		sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
		if left := lingering(sctx, ce.sock); len(left) > 0 {
			t.Logf("shims still running 30 s after their pods: %v", left)
		}
		scancel()
		ce.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-ce.exited:
		case <-time.After(20 * time.Second):
			ce.cmd.Process.Kill()
			<-ce.exited
		}
		if t.Failed() || os.Getenv("KATA_FSX_SHOW_CONTAINERD_LOG") != "" {
			t.Logf("containerd log (tail):\n%s", ce.logTail(12000))
		}
		for s := range socketsIn(sockDir) {
			t.Errorf("shim socket left behind: %s", s)
			os.Remove(s)
		}
	})
	if beforeStart != nil {
		beforeStart(e)
	}
	ce.startDaemon(t)
	// The CRI plugin accepting the runtime's table is what the deploy/ snippet relies on.
	if p := ce.ctr(context.Background(), "plugins", "ls"); !regexp.MustCompile(`(?m)^io\.containerd\.grpc\.v1\s+cri\s+\S+\s+ok`).MatchString(p.stdout) {
		t.Fatalf("CRI plugin did not load with the kata-fsx runtime table:\n%s\n%s", p.stdout, ce.logTail(3000))
	}
	ce.image = ce.importBusybox(t)
	return ce
}

// startDaemon starts containerd with the env's configuration (its root
// and state under the env's directory) and waits until it serves.
func (ce *containerdEnv) startDaemon(t *testing.T) {
	t.Helper()
	cmd := exec.Command(containerdBin("containerd"), "--config", ce.cfgPath)
	cmd.Env = ce.daemonEnv
	cmd.Stdout = lockedWriter{ce.logMu, ce.log}
	cmd.Stderr = lockedWriter{ce.logMu, ce.log}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	ce.cmd, ce.exited = cmd, exited
	deadline := time.Now().Add(30 * time.Second)
	for {
		if out, err := exec.Command(containerdBin("ctr"), "-a", ce.sock, "version").CombinedOutput(); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("containerd did not come up: %v\n%s\n%s", err, out, ce.logTail(4000))
		}
		select {
		case <-exited:
			t.Fatalf("containerd exited:\n%s", ce.logTail(4000))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// shimPid is the pid of the shim server that serves pod id, from the
// shim.pid its start wrote in the bundle.
func (ce *containerdEnv) shimPid(t *testing.T, id string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id, "shim.pid"))
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	if _, err := fmt.Sscan(string(b), &pid); err != nil {
		t.Fatalf("pod %s: shim.pid: %v", id, err)
	}
	return pid
}

func (ce *containerdEnv) logTail(n int) string {
	ce.logMu.Lock()
	defer ce.logMu.Unlock()
	b := ce.log.Bytes()
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func socketsIn(dir string) map[string]bool {
	m := map[string]bool{}
	ents, _ := os.ReadDir(dir)
	for _, en := range ents {
		m[filepath.Join(dir, en.Name())] = true
	}
	return m
}

// ctr runs ctr against the private containerd in namespace "test".
func (ce *containerdEnv) ctr(ctx context.Context, args ...string) result {
	ce.t.Helper()
	return ce.ctrIn(ctx, nil, args...)
}

// ctrIn is ctr with stdin.
func (ce *containerdEnv) ctrIn(ctx context.Context, stdin io.Reader, args ...string) result {
	ce.t.Helper()
	cmd := exec.CommandContext(ctx, containerdBin("ctr"), append([]string{"-a", ce.sock, "-n", "test"}, args...)...)
	cmd.Stdin = stdin
	return runCmd(ce.t, cmd)
}

// importBusybox writes the busybox rootfs as a docker-archive image and
// imports it, so no registry is needed.
func (ce *containerdEnv) importBusybox(t *testing.T) string {
	return ce.importRootfs(t, "kata-fsx.test/busybox:latest", busyboxRootfs(t))
}

// importRootfs imports the directory root as a one-layer image named name.
func (ce *containerdEnv) importRootfs(t *testing.T, name, root string) string {
	layer, err := registrytest.Tar(root)
	if err != nil {
		t.Fatalf("image layer: %v", err)
	}
	diffID := sha256.Sum256(layer)
	imgCfg, _ := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Env": []string{"PATH=/bin"}, "Cmd": []string{"/bin/sh"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
	})
	cfgSum := sha256.Sum256(imgCfg)
	cfgName := hex.EncodeToString(cfgSum[:]) + ".json"
	manifest, _ := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{name}, "Layers": []string{"layer.tar"}}})
	archive := filepath.Join(t.TempDir(), "busybox.tar")
	var out bytes.Buffer
	aw := tar.NewWriter(&out)
	for _, f := range []struct {
		name string
		data []byte
	}{{"layer.tar", layer}, {cfgName, imgCfg}, {"manifest.json", manifest}} {
		if err := aw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		aw.Write(f.data)
	}
	aw.Close()
	if err := os.WriteFile(archive, out.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if r := ce.ctr(ctx, "images", "import", archive); r.code != 0 {
		t.Fatalf("ctr images import: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	return name
}

// runArgs is `ctr run` with the kata-fsx runtime and the test's config.
func (ce *containerdEnv) runArgs(extra ...string) []string {
	return append([]string{"run", "--runtime", "io.containerd.kata-fsx.v2", "--runtime-config-path", ce.config}, extra...)
}

func rootFstype(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[1] == "/" {
			return f[2]
		}
	}
	return ""
}

func TestShimContainerdRun(t *testing.T) {
	ce := newContainerdEnv(t)
	for _, backend := range []struct{ name, fstype string }{{"virtio-fs", "virtiofs"}, {"imagefs-blk", "ext4"}} {
		t.Run(backend.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			id := "run-" + strings.ReplaceAll(backend.name, "-", "")
			r := ce.ctr(ctx, ce.runArgs("--rm", "--annotation", "io.katacontainers.config.hypervisor.shared_fs="+backend.name,
				ce.image, id, "/bin/sh", "-c", `echo hello; grep " / " /proc/mounts; exit 3`)...)
			if r.code != 3 {
				t.Fatalf("ctr run: exit %d, want 3\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
			if !strings.HasPrefix(r.stdout, "hello\n") {
				t.Fatalf("stdout %q", r.stdout)
			}
			if got := rootFstype(r.stdout); got != backend.fstype {
				t.Fatalf("guest / is %q, want %q:\n%s", got, backend.fstype, r.stdout)
			}
			if !strings.Contains(ce.logTail(1<<20), "backend "+backend.name) {
				t.Errorf("the shim did not log its backend choice %s", backend.name)
			}
			// The test's configuration reaches the shim only as ctr's runtime ConfigPath option.
			if !strings.Contains(ce.logTail(1<<20), "config "+ce.config) {
				t.Errorf("the shim did not use the ConfigPath runtime option %s", ce.config)
			}
			if l := ce.ctr(ctx, "containers", "ls", "-q"); strings.Contains(l.stdout, id) {
				t.Errorf("container %s survived --rm: %s", id, l.stdout)
			}
		})
	}
}

// TestShimContainerdCreateRefused: a pod whose annotations the
// configuration does not allow fails Create with Kata's message, and the
// shim leaves nothing behind.
func TestShimContainerdCreateRefused(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r := ce.ctr(ctx, ce.runArgs("--rm", "--annotation", "io.katacontainers.config.hypervisor.virtio_fs_cache=always",
		ce.image, "refused", "/bin/true")...)
	if r.code == 0 || !strings.Contains(r.stderr, "annotation io.katacontainers.config.hypervisor.virtio_fs_cache is not enabled") {
		t.Fatalf("ctr run with a disabled annotation: exit %d stderr %q", r.code, r.stderr)
	}
	ce.ctr(ctx, "containers", "delete", "refused")
	if left := lingering(ctx, ce.sock); len(left) > 0 {
		t.Fatalf("shim still running after a refused create: %v", left)
	}
}

func TestShimContainerdExecKillDelete(t *testing.T) {
	ce := newContainerdEnv(t)
	events := ce.watchEvents(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const id = "longrun"
	if r := ce.ctr(ctx, ce.runArgs("-d", "--annotation", "io.katacontainers.config.hypervisor.shared_fs=virtio-fs",
		ce.image, id, "/bin/sh", "-c", "echo started > /tmp/mark; exec sleep 600")...); r.code != 0 {
		t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	var running bool
	for i := 0; i < 100 && !running; i++ {
		l := ce.ctr(ctx, "tasks", "ls")
		running = strings.Contains(l.stdout, id) && strings.Contains(l.stdout, "RUNNING")
		if !running {
			time.Sleep(100 * time.Millisecond)
		}
	}
	if !running {
		t.Fatalf("task %s not running: %s", id, ce.ctr(ctx, "tasks", "ls").stdout)
	}
	bundle := filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id)
	addr, err := os.ReadFile(filepath.Join(bundle, "address"))
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		strings.TrimPrefix(string(addr), "unix://"): 0o600,
		filepath.Join(ce.stateDir, id):              0o700,
	} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Errorf("%s: %v", path, err)
		} else if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", path, fi.Mode().Perm(), want)
		}
	}
	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "e1", id, "/bin/sh", "-c", "cat /tmp/mark; echo to-stderr >&2; exit 5")
	if r.code != 5 || r.stdout != "started\n" || !strings.Contains(r.stderr, "to-stderr") {
		t.Fatalf("ctr task exec: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	// A second exec with the same id works once the first was deleted.
	if r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "e1", id, "/bin/echo", "again"); r.code != 0 || r.stdout != "again\n" {
		t.Fatalf("second exec: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	// stdin reaches the process, and its end closes the process's stdin.
	if r := ce.ctrIn(ctx, strings.NewReader("piped\nlines\n"), "tasks", "exec", "--exec-id", "e2", id, "/bin/wc", "-l"); r.code != 0 || strings.TrimSpace(r.stdout) != "2" {
		t.Fatalf("exec with stdin: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "e3", id, "/no/such/binary"); r.code == 0 {
		t.Fatalf("exec of a missing binary succeeded: %q %q", r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id); r.code != 0 {
		t.Fatalf("ctr task kill: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	var stopped bool
	for i := 0; i < 300 && !stopped; i++ {
		l := ce.ctr(ctx, "tasks", "ls")
		stopped = strings.Contains(l.stdout, "STOPPED")
		if !stopped {
			time.Sleep(100 * time.Millisecond)
		}
	}
	if !stopped {
		t.Fatalf("task %s did not stop after SIGKILL: %s", id, ce.ctr(ctx, "tasks", "ls").stdout)
	}
	if r := ce.ctr(ctx, "tasks", "delete", id); r.code != 0 {
		t.Fatalf("ctr task delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// containerd received the task events over its ttrpc events service
	// and published them to its subscribers (containerd 2.x logs
	// forwarded events only at trace level, so ask as a client does).
	for _, topic := range []string{"/tasks/create", "/tasks/start", "/tasks/exec-added", "/tasks/exec-started", "/tasks/exit", "/tasks/delete"} {
		if !events.waitFor(topic, id, 10*time.Second) {
			t.Errorf("containerd never published the %s event; ctr events saw:\n%s", topic, events)
		}
	}
	// The shim exits after the pod's last task is deleted.
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if left := lingering(wctx, ce.sock); len(left) > 0 {
		t.Errorf("shim processes still running after delete: %v", left)
	}
}

// startLongRunning starts a detached container that sleeps and waits
// until containerd reports it running.
func (ce *containerdEnv) startLongRunning(ctx context.Context, t *testing.T, id, backend string) {
	t.Helper()
	if r := ce.ctr(ctx, ce.runArgs("-d", "--annotation", "io.katacontainers.config.hypervisor.shared_fs="+backend,
		ce.image, id, "/bin/sleep", "600")...); r.code != 0 {
		t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
		t.Fatalf("task %s is %q, want RUNNING", id, st)
	}
}

// waitTaskStatus polls `ctr task ls` until the task has the status (or is
// gone: ""), and returns the last status seen.
func (ce *containerdEnv) waitTaskStatus(ctx context.Context, id, want string) string {
	var st string
	for ctx.Err() == nil {
		st = ""
		for _, l := range strings.Split(ce.ctr(ctx, "tasks", "ls").stdout, "\n") {
			if f := strings.Fields(l); len(f) >= 3 && f[0] == id {
				st = f[2]
			}
		}
		if st == want {
			return st
		}
		time.Sleep(200 * time.Millisecond)
	}
	return st
}

// pidsOf returns the processes whose command line mentions s and whose
// executable name contains exe.
func pidsOf(s, exe string) []int {
	var out []int
	for _, pid := range processesMentioning(s) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err == nil && strings.Contains(strings.SplitN(string(b), "\x00", 2)[0], exe) {
			out = append(out, pid)
		}
	}
	return out
}

// TestShimContainerdVMDeath kills the pod's QEMU: the task must exit with
// a failure status that containerd reports, and delete must clean up.
func TestShimContainerdVMDeath(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const id = "vmdeath"
	ce.startLongRunning(ctx, t, id, "imagefs-blk")
	qemu := pidsOf(filepath.Join(ce.stateDir, id), "qemu-system")
	if len(qemu) != 1 {
		t.Fatalf("want one QEMU of pod %s, found %v", id, qemu)
	}
	if err := syscall.Kill(qemu[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if st := ce.waitTaskStatus(ctx, id, "STOPPED"); st != "STOPPED" {
		t.Fatalf("task %s is %q after its VM died, want STOPPED", id, st)
	}
	r := ce.ctr(ctx, "tasks", "delete", id)
	if r.code != 0 {
		t.Fatalf("ctr task delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	t.Logf("ctr task delete: %q %q", r.stdout, r.stderr)
	// ctr prints the exit status of a task it deletes when it is non-zero.
	if !strings.Contains(r.stdout+r.stderr, "exit code 255") {
		t.Errorf("delete of a task whose VM died did not report status 255: %q %q", r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestShimContainerdDeadShim kills the shim itself: containerd then runs
// `containerd-shim-kata-fsx-v2 delete`, which must take the orphaned QEMU,
// virtiofsd, mounts and state with it.
func TestShimContainerdDeadShim(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const id = "deadshim"
	events := ce.watchEvents(t)
	ce.startLongRunning(ctx, t, id, "virtio-fs")
	shimPid := ce.shimPid(t, id)
	sandboxDir := filepath.Join(ce.stateDir, id)
	if len(pidsOf(sandboxDir, "qemu-system")) != 1 || len(pidsOf(sandboxDir, "virtiofsd")) == 0 {
		t.Fatalf("pod %s: QEMU or virtiofsd not found", id)
	}
	if err := syscall.Kill(shimPid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// ctr stops listing the task as soon as its shim is gone; containerd's
	// TaskExit for it is published once the delete command finished.
	if st := ce.waitTaskStatus(ctx, id, ""); st != "" {
		t.Fatalf("task %s still listed as %q after its shim died", id, st)
	}
	// (Watched as a client does: containerd 2.x logs forwarded events
	// only at trace level.)
	if !events.waitFor("/tasks/exit", id, time.Minute) {
		t.Fatalf("containerd published no task exit after its shim died; ctr events saw:\n%s", events)
	}
	if !strings.Contains(ce.logTail(1<<22), `msg="cleaning up dead shim"`) {
		t.Fatalf("containerd published the task exit without running the shim's delete")
	}
	if pids := processesMentioning(sandboxDir); len(pids) > 0 {
		t.Fatalf("processes of the dead shim's pod survived its delete: %v", pids)
	}
	if _, err := os.Stat(sandboxDir); !os.IsNotExist(err) {
		t.Fatalf("sandbox directory %s survived the delete (%v)", sandboxDir, err)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestShimContainerdPodJoin starts a second container into a running pod
// the way CRI does (container-type and sandbox-id annotations): it must
// reach the same shim and VM, not boot a new one.
func TestShimContainerdPodJoin(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const pod = "podsandbox"
	ce.startLongRunning(ctx, t, pod, "virtio-fs")
	taskDir := filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test")
	podAddr, err := os.ReadFile(filepath.Join(taskDir, pod, "address"))
	if err != nil {
		t.Fatal(err)
	}
	qemuBefore := pidsOf(ce.dir, "qemu-system")
	r := ce.ctr(ctx, ce.runArgs("--rm",
		"--annotation", "io.kubernetes.cri.container-type=container",
		"--annotation", "io.kubernetes.cri.sandbox-id="+pod,
		ce.image, "worker", "/bin/sh", "-c", `echo second; grep " / " /proc/mounts; cat /proc/1/cmdline | tr '\0' ' '`)...)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "second\n") || rootFstype(r.stdout) != "virtiofs" {
		t.Fatalf("second container: exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(ce.logTail(1<<20), "container worker joins pod "+pod) {
		t.Errorf("the worker was not served by pod %s's shim", pod)
	}
	if q := pidsOf(ce.dir, "qemu-system"); len(q) != 1 || len(qemuBefore) != 1 || q[0] != qemuBefore[0] {
		t.Errorf("QEMU before %v, after %v: the worker must join the pod's VM", qemuBefore, q)
	}
	// The worker's rootfs share is released; the pod keeps running.
	// The shim keeps the share's binds in its own mount namespace.
	m, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", ce.shimPid(t, pod)))
	if err != nil {
		t.Fatalf("the shim's mount table: %v", err)
	}
	if !strings.Contains(string(m), "/"+pod+"/rootfs") {
		t.Errorf("the pod's own rootfs bind is not in its shim's mount table")
	}
	if strings.Contains(string(m), "/worker/rootfs") {
		t.Errorf("worker rootfs still mounted after its delete")
	}
	if st := ce.waitTaskStatus(ctx, pod, "RUNNING"); st != "RUNNING" {
		t.Fatalf("pod task is %q after the worker left", st)
	}
	if b, _ := os.ReadFile(filepath.Join(taskDir, pod, "address")); string(b) != string(podAddr) {
		t.Errorf("pod address changed: %q -> %q", podAddr, b)
	}
	// A worker of a pod that has no shim is refused clearly.
	r = ce.ctr(ctx, ce.runArgs("--rm",
		"--annotation", "io.kubernetes.cri.container-type=container",
		"--annotation", "io.kubernetes.cri.sandbox-id=nosuchpod",
		ce.image, "orphan", "/bin/true")...)
	if r.code == 0 || !strings.Contains(r.stderr, "nosuchpod") {
		t.Errorf("worker of a missing pod: exit %d stderr %q", r.code, r.stderr)
	}
	ce.ctr(ctx, "containers", "delete", "orphan")
	if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", pod); r.code != 0 {
		t.Fatalf("kill: %s", r.stderr)
	}
	ce.waitTaskStatus(ctx, pod, "STOPPED")
	if r := ce.ctr(ctx, "tasks", "delete", pod); r.code != 0 && !strings.Contains(r.stderr, "exit code") {
		t.Fatalf("delete: %d %s", r.code, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", pod); r.code != 0 {
		t.Fatalf("container delete: %s", r.stderr)
	}
}
