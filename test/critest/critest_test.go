// Package critest runs Kubernetes' CRI conformance suite (cri-tools'
// critest) against a private containerd whose runtime handlers are runc
// and kata-fsx (the default policy and one handler per filesystem
// backend), with look-alike test images served from a loopback registry.
// It writes ginkgo's JUnit report per containerd and handler for
// ./report, which renders docs/conformance.md, and checks that no process,
// mount, tap, network namespace or state directory outlives the run.
package critest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// Settings, all from the environment so that make can pass them.
const (
	envCritest    = "KATA_FSX_CRITEST"            // the critest binary (make critest-bin builds it); unset, the suite skips
	envContainerd = "KATA_FSX_CONTAINERD"         // directory of containerd, ctr and containerd-shim-runc-v2
	envHandlers   = "KATA_FSX_CRITEST_HANDLERS"   // comma-separated subset of the handlers
	envFocus      = "KATA_FSX_CRITEST_FOCUS"      // ginkgo focus regexp
	envSkip       = "KATA_FSX_CRITEST_SKIP"       // ginkgo skip regexp
	envOut        = "KATA_FSX_CRITEST_OUT"        // report directory: <out>/<containerd version>/<handler><suffix>.xml
	envChunk      = "KATA_FSX_CRITEST_CHUNK"      // one of chunks: its focus, and its name in the report's file name
	envKeepGoing  = "KATA_FSX_CRITEST_KEEP_GOING" // 1: failed specs do not fail the test (the table records them)
	envNodes      = "KATA_FSX_CRITEST_NODES"      // ginkgo parallel nodes (critest -parallel; needs the ginkgo CLI beside critest)
	envGuestDir   = "KATA_FSX_GUEST_DIR"
	envAccel      = "KATA_FSX_TEST_ACCEL"
)

// chunks split a handler's run into parts that each stay within the
// e2e lock's time budget under TCG; make critest runs them one by one.
var chunks = map[string]string{
	"pod":       `\[k8s\.io\] (PodSandbox|Runtime info|Idempotence|Networking|Streaming) `,
	"container": `\[k8s\.io\] (Container|Multiple Containers|Image Volume) `,
	"security":  `\[k8s\.io\] (Security Context|AppArmor|SELinux) `,
	"image":     `\[k8s\.io\] (Image Manager|Image Consistency|Image Identifier Consistency|NRI) `,
}

// subnetPrefix is the pods' subnet, a /24 of the test range the e2e
// network tests use, reached only through the run's own bridge.
const subnetPrefix = "10.254.62."

// runMarkerEnv marks every process the run starts (containerd, shims,
// QEMU, virtiofsd inherit it), so leftovers are found by environment.
const runMarkerEnv = "KATA_FSX_CRITEST_RUN"

var repoRoot = func() string {
	d, _ := filepath.Abs("../..")
	return d
}()

// TestCritest starts a registry with the look-alike images and one
// containerd with every handler, then runs critest against each handler
// in turn, checking for leftovers after each.
func TestCritest(t *testing.T) {
	// Opt-in, as the fault and stress suites are: make critest and
	// make critest-ci name the binary; go test ./... skips the suite.
	critest := os.Getenv(envCritest)
	if critest == "" {
		t.Skipf("%s unset: the critest suite runs through make critest or make critest-ci", envCritest)
	}
	testenv.Root(t, "critest (containerd, CNI, pod VMs)")
	if _, err := os.Stat(critest); err != nil {
		testenv.Missing(t, "critest: %v (make critest builds it)", err)
	}
	ctrdDir := os.Getenv(envContainerd)
	if ctrdDir == "" {
		testenv.Missing(t, "%s unset: a directory with containerd 1.7+ (make containerd)", envContainerd)
	}
	v, err := probeVersion(filepath.Join(ctrdDir, "containerd"))
	if err != nil {
		t.Fatal(err)
	}
	hs := selectedHandlers(t)
	focus, suffix := os.Getenv(envFocus), ""
	if c := os.Getenv(envChunk); c != "" {
		f, ok := chunks[c]
		if !ok {
			t.Fatalf("%s: no chunk %q", envChunk, c)
		}
		if focus != "" {
			// Both must match: the chunk's describe, then the focus.
			focus = f + ".*(?:" + focus + ")"
		} else {
			focus = f
		}
		suffix = "-" + c
	}
	kit := os.Getenv(envGuestDir)
	if kit == "" {
		kit = filepath.Join(repoRoot, "build", "guest")
	}
	for _, h := range hs {
		if h.sharedFS == "" {
			continue
		}
		for _, f := range []string{"vmlinux", "initrd.img"} {
			if _, err := os.Stat(filepath.Join(kit, f)); err != nil {
				testenv.Missing(t, "guest kit: %v (make guest, or set %s)", err, envGuestDir)
			}
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		if _, err := os.Stat(filepath.Join("/usr/lib/cni", p)); err != nil {
			testenv.Missing(t, "CNI plugin %s (apt-get install containernetworking-plugins): %v", p, err)
		}
	}
	shimDir := buildShim(t)

	marker := fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
	before := snapshotHost()
	dir, err := os.MkdirTemp("/tmp", "kcr")
	if err != nil {
		t.Fatal(err)
	}
	w := world{dir: dir}
	bridge := "kcr" + filepath.Base(dir)[3:]
	if len(bridge) > 15 {
		bridge = bridge[:15]
	}
	t.Cleanup(func() {
		// Registered first, so it runs last: after containerd stopped.
		for _, l := range leftovers(w, marker, before) {
			t.Errorf("left behind: %s", l)
		}
		exec.Command("ip", "link", "del", bridge).Run()
		if m, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(m, []byte(dir+"/")) {
			t.Errorf("mounts left under %s; not removing it", dir)
			return
		}
		os.RemoveAll(dir)
	})
	for _, d := range []string{"cni/net.d", "cni/bin", "cni/ipam", "opt", "certs.d", "run", "blk"} {
		if err := os.MkdirAll(w.path(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		if err := os.Symlink(filepath.Join("/usr/lib/cni", p), w.path("cni", "bin", p)); err != nil {
			t.Fatal(err)
		}
	}
	cni, err := w.cniConfig(bridge, subnetPrefix+"0/24")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(w.path("cni", "net.d", "10-critest.conflist"), cni, 0o644); err != nil {
		t.Fatal(err)
	}
	accel := os.Getenv(envAccel)
	if accel == "" {
		accel = "auto"
	}
	for _, h := range hs {
		if h.sharedFS == "" {
			continue
		}
		if err := os.WriteFile(w.path("configuration-"+h.name+".toml"), []byte(w.kataConfig(kit, accel, h.sharedFS)), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	reg := registrytest.Start(t, registrytest.Options{})
	start := time.Now()
	pushLookalikes(t, reg)
	t.Logf("look-alike images pushed to %s in %s", reg.Addr, time.Since(start).Round(time.Second))
	writeMirrors(t, w.path("certs.d"), reg)

	cfg := w.containerdConfig(v, hs)
	if err := os.WriteFile(w.path("containerd.toml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	out := os.Getenv(envOut)
	if out == "" {
		out = filepath.Join(repoRoot, "build", "critest")
	}
	out = filepath.Join(out, fmt.Sprintf("%d.%d", v.Major, v.Minor))
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	d := startContainerd(t, w, ctrdDir, shimDir, marker)
	t.Cleanup(func() {
		// Registered after containerd's stop, so it runs before it: the
		// log up to the last pod's removal, kept beside the reports.
		b, _ := os.ReadFile(w.path("containerd.log"))
		os.WriteFile(filepath.Join(out, strings.Join(handlerNames(hs), ",")+suffix+"-containerd.log"), b, 0o644)
	})

	for _, h := range hs {
		t.Run(h.name, func(t *testing.T) {
			report := filepath.Join(out, h.name+suffix+".xml")
			logPath := strings.TrimSuffix(report, ".xml") + ".log"
			args := []string{
				"-runtime-endpoint", "unix://" + w.sock(), "-image-endpoint", "unix://" + w.sock(),
				"-runtime-handler", h.name,
				"-ginkgo.junit-report", report, "-ginkgo.no-color", "-ginkgo.timeout", "3h",
				"-runtime-service-timeout", "10m", "-image-service-timeout", "10m",
			}
			if focus != "" {
				args = append(args, "-ginkgo.focus", focus)
			}
			if s := os.Getenv(envSkip); s != "" {
				args = append(args, "-ginkgo.skip", s)
			}
			env := append(os.Environ(), runMarkerEnv+"="+marker)
			if n := os.Getenv(envNodes); n != "" && n != "1" {
				// critest runs the ginkgo CLI from PATH for its nodes.
				if _, err := os.Stat(filepath.Join(filepath.Dir(critest), "ginkgo")); err != nil {
					testenv.Missing(t, "ginkgo CLI beside critest (make critest-bin builds it): %v", err)
				}
				args = append(args, "-parallel", n)
				env = append(env, "PATH="+filepath.Dir(critest)+":"+os.Getenv("PATH"))
			}
			logf, err := os.Create(logPath)
			if err != nil {
				t.Fatal(err)
			}
			defer logf.Close()
			cmd := exec.Command(critest, args...)
			cmd.Dir = w.dir
			cmd.Stdout, cmd.Stderr = logf, logf
			cmd.Env = env
			start := time.Now()
			runErr := cmd.Run()
			t.Logf("critest on %s, containerd %s: %v in %s; log %s, report %s", h.name, v.Full, runErr, time.Since(start).Round(time.Second), logPath, report)
			if _, err := os.Stat(report); err != nil {
				t.Fatalf("critest wrote no report: %v\n%s", err, tail(logPath, 6000))
			}
			if runErr != nil && os.Getenv(envKeepGoing) != "1" {
				t.Errorf("critest failed: %v\n%s", runErr, tail(logPath, 6000))
			}
			d.removePods(t)
			waitGone(t, w, marker, 2*time.Minute)
			for _, l := range podLeftovers(w, before) {
				t.Errorf("after %s: left behind: %s", h.name, l)
			}
		})
	}
}

func handlerNames(hs []handler) []string {
	var n []string
	for _, h := range hs {
		n = append(n, h.name)
	}
	return n
}

// selectedHandlers is handlers, or the subset KATA_FSX_CRITEST_HANDLERS
// names.
func selectedHandlers(t *testing.T) []handler {
	s := os.Getenv(envHandlers)
	if s == "" {
		return handlers
	}
	var hs []handler
	for _, name := range strings.Split(s, ",") {
		found := false
		for _, h := range handlers {
			if h.name == strings.TrimSpace(name) {
				hs, found = append(hs, h), true
			}
		}
		if !found {
			t.Fatalf("%s: no handler %q", envHandlers, name)
		}
	}
	return hs
}

// buildShim builds the kata-fsx shim into a directory of the test's and
// returns the directory (containerd finds the shim on its PATH).
func buildShim(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", dir, "./cmd/containerd-shim-kata-fsx-v2")
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build shim: %v\n%s", err, out)
	}
	return dir
}

// daemon is the running containerd.
type daemon struct {
	cmd    *exec.Cmd
	log    *os.File
	exited chan struct{}
	rt     runtimeapi.RuntimeServiceClient
	conn   *grpc.ClientConn
}

// startContainerd starts containerd on w's configuration and waits for
// its CRI; the test's cleanup removes what pods remain and stops it.
func startContainerd(t *testing.T, w world, ctrdDir, shimDir, marker string) *daemon {
	t.Helper()
	logf, err := os.Create(w.path("containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(ctrdDir, "containerd"), "--config", w.path("containerd.toml"))
	cmd.Env = append(os.Environ(), "PATH="+shimDir+":"+ctrdDir+":"+os.Getenv("PATH"), runMarkerEnv+"="+marker)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &daemon{cmd: cmd, log: logf, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() { d.stop(t, w) })
	conn, err := grpc.NewClient("unix://"+w.sock(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	d.conn, d.rt = conn, runtimeapi.NewRuntimeServiceClient(conn)
	err = testenv.Wait(2*time.Minute, func() (bool, error) {
		select {
		case <-d.exited:
			return false, fmt.Errorf("containerd exited")
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st, err := d.rt.Status(ctx, &runtimeapi.StatusRequest{})
		if err != nil {
			return false, fmt.Errorf("CRI status: %w", err)
		}
		return networkReady(st), fmt.Errorf("CRI network not ready: %v", st.GetStatus())
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, tail(w.path("containerd.log"), 6000))
	}
	return d
}

func networkReady(st *runtimeapi.StatusResponse) bool {
	for _, c := range st.GetStatus().GetConditions() {
		if c.Type == runtimeapi.NetworkReady && !c.Status {
			return false
		}
	}
	return true
}

// removePods stops and removes the pods critest left (a failed spec's
// cleanup may not have run), so the next handler starts clean.
func (d *daemon) removePods(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	l, err := d.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Errorf("list pods: %v", err)
		return
	}
	for _, p := range l.Items {
		t.Logf("removing pod %s (%s) left by critest", p.Id, p.GetMetadata().GetName())
		if _, err := d.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Errorf("stop pod %s: %v", p.Id, err)
		}
		if _, err := d.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Errorf("remove pod %s: %v", p.Id, err)
		}
	}
}

// stop removes the remaining pods, waits for the shims to exit (they do
// once their last task is gone) and stops containerd.
func (d *daemon) stop(t *testing.T, w world) {
	if d.rt != nil {
		d.removePods(t)
		d.conn.Close()
	}
	// A shim still running after this is reported with the leftovers.
	testenv.Wait(2*time.Minute, func() (bool, error) { return len(shims(w)) == 0, nil })
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(30 * time.Second):
		t.Errorf("containerd ignored SIGTERM for 30s")
		d.cmd.Process.Kill()
		<-d.exited
	}
	d.log.Close()
	if t.Failed() {
		t.Logf("containerd log (tail):\n%s", tail(w.path("containerd.log"), 8000))
	}
}

// tail is the end of a file, for failure messages.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
