package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

// The CRI keeps its images and containers in this containerd namespace.
const criNamespace = "k8s.io"

const (
	criPauseImage   = "kata-fsx.test/pause:latest"
	criBusyboxImage = "kata-fsx.test/busybox:latest"
	criRuntime      = "kata-fsx"
)

// criEnv is a private containerd whose CRI plugin knows the kata-fsx
// runtime handler, reached through the CRI's gRPC services.
type criEnv struct {
	*containerdEnv
	conn   *grpc.ClientConn
	rt     runtimeapi.RuntimeServiceClient
	img    runtimeapi.ImageServiceClient
	logDir string
	exited chan struct{}

	mu          sync.Mutex
	shimSockets map[string]bool // the pods' shim sockets, checked at the end
}

// trackShim records the shim socket containerd uses for the pod.
func (c *criEnv) trackShim(podID string) error {
	b, err := os.ReadFile(filepath.Join(c.dir, "state", "io.containerd.runtime.v2.task", criNamespace, podID, "address"))
	if err != nil {
		return fmt.Errorf("pod %s: shim address: %w", podID, err)
	}
	sock, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "unix://")
	if !ok || !strings.HasPrefix(sock, "/") {
		return fmt.Errorf("pod %s: shim address %q is not a unix socket path", podID, b)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.shimSockets[sock] = true
	return nil
}

// newCRIEnv starts containerd with the kata-fsx runtime handler, a locally
// imported pause image as the sandbox image and an empty CNI configuration:
// the pods use the host network, which needs no CNI plugin.
func newCRIEnv(t *testing.T) *criEnv {
	return newCRIEnvWith(t, criOptions{})
}

// newCRIEnvWith is newCRIEnv whose containerd has o's settings.
func newCRIEnvWith(t *testing.T, o criOptions) *criEnv {
	v := containerdUnderTest(t)
	kataExtra := `enable_annotations = ["shared_fs"]`
	if o.KataConfig != "" {
		kataExtra += "\n" + o.KataConfig
	}
	e := newEnv(t, kataExtra)
	short := shortenEnv(t, e)
	shim, err := buildShim()
	if err != nil {
		t.Fatal(err)
	}
	ce := &containerdEnv{env: e, sock: filepath.Join(e.dir, "containerd.sock"), log: &bytes.Buffer{}, logMu: &sync.Mutex{}, version: v}
	for _, d := range []string{"cni/net.d", "cni/bin", "opt", "logs"} {
		if err := os.MkdirAll(filepath.Join(e.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := containerdConfig{dir: e.dir, sock: ce.sock, kataConfig: e.config, cri: true, opts: o}.render(v)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(e.dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	if o.BeforeStart != nil {
		o.BeforeStart(e)
	}
	cmd := exec.Command(containerdBin("containerd"), "--config", cfgPath)
	cmd.Env = append(append(os.Environ(), containerdPATH(filepath.Dir(shim))), o.Env...)
	cmd.Stdout = lockedWriter{ce.logMu, ce.log}
	cmd.Stderr = lockedWriter{ce.logMu, ce.log}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ce.cmd = cmd
	c := &criEnv{containerdEnv: ce, logDir: filepath.Join(e.dir, "logs"), exited: make(chan struct{}), shimSockets: map[string]bool{}}
	go func() { cmd.Wait(); close(c.exited) }()
	// Registered after newEnv's leftover check, so it runs first.
	t.Cleanup(func() {
		c.cleanup(t)
		short()
		if pids := processesMentioning(ce.sock); len(pids) > 0 {
			t.Errorf("processes of the pods survived containerd's stop: %v", pids)
		}
		// Only this containerd's shim sockets: tests running beside this
		// one own the others in the shared directory.
		c.mu.Lock()
		defer c.mu.Unlock()
		for s := range c.shimSockets {
			if _, err := os.Lstat(s); err == nil {
				t.Errorf("shim socket left behind: %s", s)
				os.Remove(s)
			}
		}
	})

	conn, err := grpc.NewClient("unix://"+ce.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c.conn = conn
	c.rt = runtimeapi.NewRuntimeServiceClient(conn)
	c.img = runtimeapi.NewImageServiceClient(conn)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for {
		_, err := c.rt.Version(ctx, &runtimeapi.VersionRequest{})
		if err == nil {
			break
		}
		if status.Code(err) == codes.Unimplemented {
			t.Fatalf("containerd serves no CRI: %v\n%s", err, ce.logTail(4000))
		}
		select {
		case <-c.exited:
			t.Fatalf("containerd exited:\n%s", ce.logTail(4000))
		case <-ctx.Done():
			t.Fatalf("CRI did not come up: %v\n%s", err, ce.logTail(4000))
		case <-time.After(200 * time.Millisecond):
		}
	}
	c.importImages(ctx, t)
	return c
}

// shortenEnv moves the env's world, pod state included, to a short
// directory: a CRI pod id is 64 characters, and the pod's sockets under
// state_dir/<id>/ must stay within the 107 bytes of a unix socket path,
// which a t.TempDir() path does not leave room for. The returned function
// checks the state directory and removes the short directory; it must run
// once the pods and containerd are gone.
func shortenEnv(t *testing.T, e *env) func() {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "kc")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(e.config)
	if err != nil {
		t.Fatal(err)
	}
	oldState := fmt.Sprintf("state_dir = %q", e.stateDir)
	if !bytes.Contains(cfg, []byte(oldState)) {
		t.Fatalf("%s has no %s", e.config, oldState)
	}
	e.dir, e.stateDir = dir, filepath.Join(dir, "run")
	cfg = bytes.Replace(cfg, []byte(oldState), []byte(fmt.Sprintf("state_dir = %q", e.stateDir)), 1)
	if err := os.WriteFile(e.config, cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return func() {
		entries, _ := os.ReadDir(e.stateDir)
		for _, en := range entries {
			if en.Name() != "accel.json" {
				t.Errorf("state left behind: %s", filepath.Join(e.stateDir, en.Name()))
			}
		}
		// Never remove through a mount: report it and keep the directory.
		if m, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(m, []byte(dir+"/")) {
			t.Errorf("mounts left under %s; not removing it", dir)
			return
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	}
}

// cleanup takes down whatever pods a failed test left, then containerd.
func (c *criEnv) cleanup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if c.rt != nil {
		if l, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err == nil {
			for _, p := range l.Items {
				t.Logf("removing pod %s left by the test", p.Id)
				c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id})
				c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id})
			}
		}
		c.conn.Close()
	}
	// The shims exit once their last task is deleted; containerd stopping
	// first would orphan them by design.
	for ctx.Err() == nil && len(pidsOf(c.sock, "containerd-shim-kata-fsx")) > 0 {
		time.Sleep(100 * time.Millisecond)
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
	case <-time.After(20 * time.Second):
		t.Errorf("containerd ignored SIGTERM for 20s")
		c.cmd.Process.Kill()
		<-c.exited
	}
	if t.Failed() || os.Getenv("KATA_FSX_SHOW_CONTAINERD_LOG") != "" {
		t.Logf("containerd log (tail):\n%s", c.logTail(16000))
	}
}

// ctrK8s runs ctr in the CRI's namespace.
func (c *criEnv) ctrK8s(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, containerdBin("ctr"), append([]string{"-a", c.sock, "-n", criNamespace}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w", strings.Join(args, " "), err)
	}
	return string(out), nil
}

// importImages imports the pause and busybox images into the CRI's
// namespace and waits until the CRI's image service lists them.
func (c *criEnv) importImages(ctx context.Context, t *testing.T) {
	t.Helper()
	root := busyboxRootfs(t)
	// The pause process only has to live until the CRI kills it (with
	// SIGKILL in containerd 1.6).
	pause := "#!/bin/sh\nexec sleep inf\n"
	if err := os.WriteFile(filepath.Join(root, "pause"), []byte(pause), 0o755); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(t.TempDir(), "images.tar")
	err := registrytest.WriteDockerArchive(archive, root, []registrytest.ArchiveImage{
		{Name: criPauseImage, Config: map[string]any{"Env": []string{"PATH=/bin"}, "Entrypoint": []string{"/pause"}}},
		{Name: criBusyboxImage, Config: map[string]any{"Env": []string{"PATH=/bin"}, "Cmd": []string{"/bin/sh"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := c.ctrK8s(ctx, "images", "import", archive); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, name := range []string{criPauseImage, criBusyboxImage} {
		for {
			st, err := c.img.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: name}})
			if err == nil && st.Image != nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("the CRI never listed the imported image %s: %v", name, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// criLogLine is one line of the CRI container log format:
// "<RFC3339Nano time> <stdout|stderr> <P|F> <content>".
var criLogLine = regexp.MustCompile(`^(\S+) (stdout|stderr) (P|F) (.*)$`)

// parseCRILog returns the stdout and stderr a CRI log file holds, with
// partial (P) lines joined to the full (F) line that ends them.
func parseCRILog(data []byte) (stdout, stderr string, err error) {
	var out, errOut strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		m := criLogLine.FindStringSubmatch(sc.Text())
		if m == nil {
			return "", "", fmt.Errorf("CRI log line %d is not in the CRI format: %q", n, sc.Text())
		}
		if _, err := time.Parse(time.RFC3339Nano, m[1]); err != nil {
			return "", "", fmt.Errorf("CRI log line %d: timestamp: %w", n, err)
		}
		w := &out
		if m[2] == "stderr" {
			w = &errOut
		}
		w.WriteString(m[4])
		if m[3] == "F" {
			w.WriteByte('\n')
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", fmt.Errorf("CRI log: %w", err)
	}
	return out.String(), errOut.String(), nil
}
