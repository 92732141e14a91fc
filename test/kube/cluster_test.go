// Package kube runs kata-fsx under a real single-node Kubernetes cluster:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet
// and kube-proxy built by `make kube`, containerd 2.x from `make
// containerd`, Debian's CNI bridge plugin. kata-fsx is installed by its
// DaemonSet (deploy/kubernetes), pods are made with kubectl.
//
// The whole cluster lives in a network namespace of the test's own (its
// loopback, an interface with the node's address, the pods' bridge and
// kube-proxy's rules) and a private directory; every daemon shares the
// host's mount namespace, as on a node.
package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// Settings, from the environment so that make can pass them.
const (
	envKubeDir    = "KATA_FSX_KUBE_DIR"   // make kube's output: <dir>/bin/kubelet, ...
	envContainerd = "KATA_FSX_CONTAINERD" // containerd 2.x: containerd, ctr, containerd-shim-runc-v2
	envGuestDir   = "KATA_FSX_GUEST_DIR"  // the guest kit: vmlinux, initrd.img
)

// The cluster's addresses, inside its own network namespace.
const (
	nodeIP      = "10.254.90.1"
	podSubnet   = "10.254.91.0/24"
	serviceCIDR = "10.254.96.0/24"
	apiService  = "10.254.96.1"
	nodeName    = "kfsx-node"
	adminToken  = "kata-fsx-test-admin-token"
	pauseImage  = "kata-fsx.test/pause:1"
	// BusyboxImage is the workload image the tests' pods run.
	busyboxImage = "kata-fsx.test/busybox:1"
)

// cluster is one running test cluster.
type cluster struct {
	dir string // private directory
	// cgroups are the kubelet's cgroupRoot, one per hierarchy.
	cgroups []string
	// runDir is kata-fsx's run directory: short, as the sandboxes' unix
	// sockets below it must fit sun_path.
	runDir     string
	netns      string // network namespace name
	bin        string // make kube's bin directory
	containerd string // containerd 2.x directory
	kubeconfig string

	// deployManifest is the installer's manifest as applied, for its removal.
	deployManifest string

	mu       sync.Mutex
	procs    []*daemon
	stopping bool
}

// daemon is one of the cluster's processes, restarted when restart is set
// (containerd, which the installer restarts as systemd would).
type daemon struct {
	name    string
	args    []string
	restart bool
	cmd     *exec.Cmd
	exited  chan struct{}
	log     string
	starts  int // how often it was started
	pidFile string
}

func (c *cluster) path(elem ...string) string {
	return filepath.Join(append([]string{c.dir}, elem...)...)
}

// timed runs step and logs how long it took.
func timed(t testing.TB, what string, step func() error) {
	t.Helper()
	start := time.Now()
	if err := step(); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	t.Logf("%s: %s", what, time.Since(start).Round(100*time.Millisecond))
}

func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// startCluster brings the cluster up; t.Cleanup takes it down.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	kubeDir := os.Getenv(envKubeDir)
	if kubeDir == "" {
		t.Skipf("%s unset: the cluster tests run through make test-kube, which builds the cluster (make kube) and sets it", envKubeDir)
	}
	testenv.Root(t, "a Kubernetes node")
	for _, tool := range []string{"ip", "nsenter", "iptables", "busybox"} {
		testenv.Tool(t, tool, "iproute2, util-linux, iptables, busybox-static")
	}
	ctrDir := os.Getenv(envContainerd)
	if ctrDir == "" {
		testenv.Missing(t, "%s unset: the cluster needs containerd 2.x (make containerd)", envContainerd)
	}
	c := &cluster{
		dir:        t.TempDir(),
		netns:      fmt.Sprintf("kfsx-kube-%d", os.Getpid()),
		bin:        filepath.Join(kubeDir, "bin"),
		containerd: ctrDir,
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl"} {
		if _, err := os.Stat(filepath.Join(c.bin, b)); err != nil {
			testenv.Missing(t, "%s: %v (make kube builds it)", b, err)
		}
	}
	c.runDir = fmt.Sprintf("/run/kfsx-kube-%d", os.Getpid())
	t.Cleanup(func() { c.stop(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	timed(t, "network namespace "+c.netns, c.makeNetNS)
	timed(t, "certificates", c.makeCerts)
	timed(t, "etcd", func() error {
		c.start(t, &daemon{name: "etcd", args: []string{filepath.Join(c.bin, "etcd"),
			"--name", "kfsx", "--data-dir", c.path("etcd"),
			"--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
			"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
			"--initial-cluster", "kfsx=http://127.0.0.1:2380", "--log-level", "warn"}})
		return c.waitHTTP(ctx, "http://127.0.0.1:2379/health")
	})
	timed(t, "kube-apiserver", func() error {
		c.start(t, &daemon{name: "kube-apiserver", args: []string{filepath.Join(c.bin, "kube-apiserver"),
			"--etcd-servers", "http://127.0.0.1:2379",
			"--bind-address", "0.0.0.0", "--secure-port", "6443", "--advertise-address", nodeIP,
			"--service-cluster-ip-range", serviceCIDR,
			"--token-auth-file", c.path("pki", "tokens.csv"),
			"--client-ca-file", c.path("pki", "ca.crt"),
			"--tls-cert-file", c.path("pki", "apiserver.crt"), "--tls-private-key-file", c.path("pki", "apiserver.key"),
			"--service-account-key-file", c.path("pki", "sa.pub"),
			"--service-account-signing-key-file", c.path("pki", "sa.key"),
			"--service-account-issuer", "https://kubernetes.default.svc",
			"--authorization-mode", "Node,RBAC", "--allow-privileged=true",
			"--kubelet-preferred-address-types", "InternalIP"}})
		return c.waitReady(ctx, "/readyz")
	})
	timed(t, "kube-controller-manager and kube-scheduler", func() error {
		c.start(t, &daemon{name: "kube-controller-manager", args: []string{filepath.Join(c.bin, "kube-controller-manager"),
			"--kubeconfig", c.kubeconfig, "--authentication-kubeconfig", c.kubeconfig, "--authorization-kubeconfig", c.kubeconfig,
			"--service-account-private-key-file", c.path("pki", "sa.key"), "--root-ca-file", c.path("pki", "ca.crt"),
			"--leader-elect=false", "--bind-address", "127.0.0.1", "--use-service-account-credentials=false"}})
		c.start(t, &daemon{name: "kube-scheduler", args: []string{filepath.Join(c.bin, "kube-scheduler"),
			"--kubeconfig", c.kubeconfig, "--authentication-kubeconfig", c.kubeconfig, "--authorization-kubeconfig", c.kubeconfig,
			"--leader-elect=false", "--bind-address", "127.0.0.1"}})
		// Pods need the namespace's default service account, which the
		// controller manager makes.
		return c.waitFor(ctx, "the default service account", func() error {
			_, err := c.kubectl(ctx, "get", "serviceaccount", "default", "-n", "default")
			return err
		})
	})
	timed(t, "containerd", func() error { return c.startContainerd(ctx, t) })
	timed(t, "kubelet and kube-proxy", func() error {
		if err := c.startKubelet(t); err != nil {
			return err
		}
		c.start(t, &daemon{name: "kube-proxy", args: []string{filepath.Join(c.bin, "kube-proxy"),
			"--kubeconfig", c.kubeconfig, "--hostname-override", nodeName, "--proxy-mode", "iptables",
			"--masquerade-all", "--cluster-cidr", podSubnet, "--conntrack-max-per-core", "0",
			"--conntrack-tcp-timeout-established", "0", "--conntrack-tcp-timeout-close-wait", "0"}})
		return c.waitFor(ctx, "node "+nodeName+" Ready", func() error {
			out, err := c.kubectl(ctx, "get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
			if err != nil {
				return err
			}
			if strings.TrimSpace(out) != "True" {
				return fmt.Errorf("Ready is %q", out)
			}
			return nil
		})
	})
	t.Logf("cluster up in %s (%s)", time.Since(start).Round(100*time.Millisecond), c.dir)
	return c
}

func (c *cluster) makeNetNS() error {
	ctx := context.Background()
	if _, err := run(ctx, "ip", "netns", "add", c.netns); err != nil {
		return err
	}
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		// The node's interface: a veth whose peer stays in the namespace
		// too (this kernel may have no dummy driver).
		{"link", "add", "kfsx0", "type", "veth", "peer", "name", "kfsx1"},
		{"addr", "add", nodeIP + "/24", "dev", "kfsx0"},
		{"link", "set", "kfsx1", "up"},
		{"link", "set", "kfsx0", "up"},
		{"route", "add", "default", "dev", "kfsx0"},
	} {
		if _, err := run(ctx, "ip", append([]string{"-n", c.netns}, args...)...); err != nil {
			return err
		}
	}
	_, err := run(ctx, "ip", "netns", "exec", c.netns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
	return err
}

func (c *cluster) makeCerts() error {
	p, err := newPKI(c.path("pki"))
	if err != nil {
		return err
	}
	ips := []net.IP{net.ParseIP(nodeIP), net.ParseIP("127.0.0.1"), net.ParseIP(apiService)}
	dns := []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost"}
	if err := p.serving("apiserver", ips, dns); err != nil {
		return err
	}
	if err := p.serving("kubelet", []net.IP{net.ParseIP(nodeIP)}, []string{nodeName}); err != nil {
		return err
	}
	if err := p.serviceAccountKey(); err != nil {
		return err
	}
	tokens := adminToken + ",admin,admin,system:masters\n"
	if err := os.WriteFile(p.path("tokens.csv"), []byte(tokens), 0o600); err != nil {
		return err
	}
	c.kubeconfig = c.path("kubeconfig")
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kfsx
  cluster:
    server: https://%s:6443
    certificate-authority: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: kfsx
  context: {cluster: kfsx, user: admin}
current-context: kfsx
`, nodeIP, p.path("ca.crt"), adminToken)
	return os.WriteFile(c.kubeconfig, []byte(kc), 0o600)
}

// start runs d in the cluster's network namespace, its output in
// <dir>/logs/<name>.log.
func (c *cluster) start(t testing.TB, d *daemon) {
	t.Helper()
	if err := os.MkdirAll(c.path("logs"), 0o755); err != nil {
		t.Fatal(err)
	}
	d.log = c.path("logs", d.name+".log")
	c.mu.Lock()
	c.procs = append(c.procs, d)
	c.mu.Unlock()
	if err := c.spawn(d); err != nil {
		t.Fatalf("start %s: %v", d.name, err)
	}
}

func (c *cluster) spawn(d *daemon) error {
	f, err := os.OpenFile(d.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	args := append([]string{"--net=/run/netns/" + c.netns, "--"}, d.args...)
	cmd := exec.Command("nsenter", args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), "PATH="+c.containerd+":"+os.Getenv("PATH"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return err
	}
	exited := make(chan struct{})
	c.mu.Lock()
	d.cmd, d.exited = cmd, exited
	d.starts++
	c.mu.Unlock()
	if d.pidFile != "" {
		// nsenter execs the daemon: the pid is the daemon's.
		if err := os.WriteFile(d.pidFile, []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o644); err != nil {
			return err
		}
	}
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(exited)
		c.mu.Lock()
		again := d.restart && !c.stopping
		c.mu.Unlock()
		if again {
			time.Sleep(time.Second)
			if err := c.spawn(d); err != nil {
				fmt.Fprintf(os.Stderr, "restart %s: %v\n", d.name, err)
			}
		}
	}()
	return nil
}

// starts says how often the daemon named name was started.
func (c *cluster) starts(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, d := range c.procs {
		if d.name == name {
			return d.starts
		}
	}
	return 0
}

func (c *cluster) stop(t testing.TB) {
	c.mu.Lock()
	c.stopping = true
	procs := append([]*daemon(nil), c.procs...)
	c.mu.Unlock()
	// The kubelet and containerd first would leave the pods behind:
	// the tests delete what they made before this runs.
	for i := len(procs) - 1; i >= 0; i-- {
		d := procs[i]
		c.mu.Lock()
		cmd, exited := d.cmd, d.exited
		c.mu.Unlock()
		if cmd == nil || cmd.Process == nil {
			continue
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
	}
	// What the kubelet mounted under its root directory.
	if out, err := exec.Command("sh", "-c", "grep -o ' "+c.dir+"[^ ]*' /proc/self/mounts | sort -r | xargs -r -n1 umount -l").CombinedOutput(); err != nil {
		t.Logf("unmount %s: %v\n%s", c.dir, err, out)
	}
	if err := c.removeCgroups(); err != nil {
		t.Errorf("the kubelet's cgroups are left: %v", err)
	}
	if _, err := run(context.Background(), "ip", "netns", "del", c.netns); err != nil {
		t.Logf("%v", err)
	}
	if err := os.Remove(c.runDir); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Errorf("kata-fsx's run directory is left: %v", err)
	}
	if t.Failed() {
		// The directory goes with the test: keep the logs.
		keep := filepath.Join(os.TempDir(), fmt.Sprintf("kata-fsx-kube-logs-%d", os.Getpid()))
		if out, err := exec.Command("cp", "-r", c.path("logs"), keep).CombinedOutput(); err != nil {
			t.Logf("keep the logs: %v\n%s", err, out)
		}
		for _, d := range procs {
			b, _ := os.ReadFile(d.log)
			var errs []string
			for _, l := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(l, "E") || strings.Contains(l, "level=error") || strings.Contains(l, "level=fatal") || strings.HasPrefix(l, "F") {
					errs = append(errs, l)
				}
			}
			if len(errs) > 20 {
				errs = errs[len(errs)-20:]
			}
			t.Logf("--- %s: last errors (all of its log in %s)\n%s", d.name, keep, strings.Join(errs, "\n"))
		}
	}
}

// kubectl runs kubectl against the cluster and returns its stdout. It
// runs in the cluster's namespace, where the apiserver's address is.
func (c *cluster) kubectl(ctx context.Context, args ...string) (string, error) {
	return c.kubectlIn(ctx, "", args...)
}

// kubectlIn is kubectl with stdin; its error carries kubectl's stderr.
func (c *cluster) kubectlIn(ctx context.Context, stdin string, args ...string) (string, error) {
	full := append([]string{"--net=/run/netns/" + c.netns, "--", filepath.Join(c.bin, "kubectl"), "--kubeconfig", c.kubeconfig}, args...)
	cmd := exec.CommandContext(ctx, "nsenter", full...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

func (c *cluster) waitFor(ctx context.Context, what string, cond func() error) error {
	var last error
	for {
		if last = cond(); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), last)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func (c *cluster) waitHTTP(ctx context.Context, url string) error {
	return c.waitFor(ctx, url, func() error {
		_, err := run(ctx, "nsenter", "--net=/run/netns/"+c.netns, "--", "busybox", "wget", "-q", "-O", "/dev/null", url)
		return err
	})
}

func (c *cluster) waitReady(ctx context.Context, path string) error {
	return c.waitFor(ctx, "the apiserver's "+path, func() error {
		_, err := c.kubectl(ctx, "get", "--raw", path)
		return err
	})
}

// startContainerd writes containerd's configuration (runc as the default
// handler; kata-fsx's handlers are the installer's to add), starts it as a
// daemon that comes back when it exits, and imports the test images.
func (c *cluster) startContainerd(ctx context.Context, t *testing.T) error {
	cni := c.path("cni", "net.d")
	if err := os.MkdirAll(cni, 0o755); err != nil {
		return err
	}
	conf, err := json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0", "name": "kfsx-kube",
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": "kfsxbr0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
			// The default route through the bridge takes a pod's
			// traffic to Service addresses to kube-proxy's rules.
			"ipam": map[string]any{"type": "host-local", "ranges": []any{[]any{map[string]any{"subnet": podSubnet}}},
				"routes": []any{map[string]any{"dst": "0.0.0.0/0"}}, "dataDir": c.path("cni", "ipam")},
		}, map[string]any{"type": "portmap", "capabilities": map[string]any{"portMappings": true}}},
	}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(cni, "10-kfsx.conflist"), conf, 0o644); err != nil {
		return err
	}
	q := strconv.Quote
	rt, images := `plugins."io.containerd.cri.v1.runtime"`, `plugins."io.containerd.cri.v1.images"`
	cfg := strings.Join([]string{
		"version = 3",
		"root = " + q(c.path("containerd", "root")),
		"state = " + q(c.path("containerd", "state")),
		"[grpc]\n  address = " + q(c.sock()),
		`[plugins."io.containerd.internal.v1.opt"]` + "\n  path = " + q(c.path("containerd", "opt")),
		`[plugins."io.containerd.nri.v1.nri"]` + "\n  disable = true",
		`[plugins."io.containerd.grpc.v1.cri"]` + "\n  stream_server_address = \"127.0.0.1\"\n  stream_server_port = \"0\"",
		// A pause's oom_score_adj of -998 needs CAP_SYS_RESOURCE, which
		// the machine the tests run on may not give.
		"[" + rt + "]\n  disable_apparmor = true\n  restrict_oom_score_adj = true",
		"[" + images + ".pinned_images]\n  sandbox = " + q(pauseImage),
		"[" + rt + ".cni]\n  bin_dirs = [\"/usr/lib/cni\"]\n  conf_dir = " + q(cni),
		"[" + rt + ".containerd]\n  default_runtime_name = \"runc\"",
		"[" + rt + ".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"",
		"",
	}, "\n")
	if err := os.MkdirAll(c.path("etc-containerd"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(c.containerdConf(), []byte(cfg), 0o644); err != nil {
		return err
	}
	c.start(t, &daemon{name: "containerd", restart: true, pidFile: c.containerdPidFile(), args: []string{filepath.Join(c.containerd, "containerd"), "--config", c.containerdConf()}})
	if err := c.waitFor(ctx, "containerd", func() error {
		_, err := c.ctr(ctx, "version")
		return err
	}); err != nil {
		return err
	}
	return c.importImages(ctx)
}

func (c *cluster) sock() string           { return c.path("containerd", "containerd.sock") }
func (c *cluster) containerdConf() string { return c.path("etc-containerd", "config.toml") }

// containerdPidFile is beside the configuration, so that the installer,
// which has that directory, can restart containerd as systemd would.
func (c *cluster) containerdPidFile() string { return c.path("etc-containerd", "containerd.pid") }

func (c *cluster) ctr(ctx context.Context, args ...string) (string, error) {
	return run(ctx, filepath.Join(c.containerd, "ctr"), append([]string{"--address", c.sock(), "-n", "k8s.io"}, args...)...)
}

// importImages imports the pause and busybox images: busybox-static with
// its applets, and a pause program that waits for its signal.
func (c *cluster) importImages(ctx context.Context) error {
	root := c.path("images", "busybox")
	if err := os.MkdirAll(filepath.Join(root, "bin"), 0o755); err != nil {
		return err
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("busybox-static: %w", err)
	}
	if _, err := run(ctx, "cp", bb, filepath.Join(root, "bin", "busybox")); err != nil {
		return err
	}
	list, err := run(ctx, bb, "--list")
	if err != nil {
		return err
	}
	for _, a := range strings.Fields(list) {
		if a != "busybox" {
			if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil && !errors.Is(err, os.ErrExist) {
				return err
			}
		}
	}
	for _, d := range []string{"etc", "tmp", "proc", "sys", "dev", "root"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\nnogroup:x:65534:\n"), 0o644); err != nil {
		return err
	}
	pause := "#!/bin/sh\ntrap 'exit 0' TERM INT\nwhile :; do sleep 3600 & wait $!; done\n"
	if err := os.WriteFile(filepath.Join(root, "pause"), []byte(pause), 0o755); err != nil {
		return err
	}
	archive := c.path("images", "images.tar")
	err = registrytest.WriteDockerArchive(archive, root, []registrytest.ArchiveImage{
		{Name: pauseImage, Config: map[string]any{"Env": []string{"PATH=/bin"}, "Entrypoint": []string{"/pause"}}},
		{Name: busyboxImage, Config: map[string]any{"Env": []string{"PATH=/bin"}, "Cmd": []string{"/bin/sh"}}},
	})
	if err != nil {
		return err
	}
	_, err = c.ctr(ctx, "images", "import", archive)
	return err
}

// makeCgroups makes the kubelet's cgroupRoot in every cgroup v1 hierarchy
// (the kubelet wants it there already), with the parent's cpuset; on
// cgroup v2 the unified tree alone.
func (c *cluster) makeCgroups() error {
	hier, err := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	if err != nil {
		return err
	}
	if len(hier) == 0 {
		hier = []string{"/sys/fs/cgroup/cgroup.procs"}
	}
	for _, h := range hier {
		parent := filepath.Dir(h)
		dir := filepath.Join(parent, c.netns)
		if filepath.Base(parent) == "unified" {
			// The kubelet makes its own there; it is removed all the same.
			c.cgroups = append(c.cgroups, dir)
			continue
		}
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		c.cgroups = append(c.cgroups, dir)
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(dir, f), err)
				}
			}
		}
	}
	return nil
}

// removeCgroups removes what is left of the kubelet's cgroups, deepest
// first. A process still in one (a container the kubelet did not get to
// stop before the test ended) is killed first and reported.
func (c *cluster) removeCgroups() error {
	var errs []error
	for _, dir := range c.cgroups {
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
					errs = append(errs, fmt.Errorf("process %d was left in %s", pid, filepath.Dir(p)))
				}
			}
			return nil
		})
	}
	if len(errs) > 0 {
		time.Sleep(time.Second)
	}
	for _, dir := range c.cgroups {
		var dirs []string
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (c *cluster) startKubelet(t *testing.T) error {
	if err := c.makeCgroups(); err != nil {
		return fmt.Errorf("the kubelet's cgroup root: %w", err)
	}
	if err := os.WriteFile(c.path("resolv.conf"), []byte("nameserver 10.254.96.10\nsearch default.svc.cluster.local\n"), 0o644); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: 10250
readOnlyPort: 0
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupRoot: /%s
failSwapOn: false
failCgroupV1: false
resolvConf: %s
syncFrequency: 10s
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
  nodefs.inodesFree: "1%%"
`, nodeIP, c.path("pki", "kubelet.crt"), c.path("pki", "kubelet.key"), c.sock(), c.netns, c.path("resolv.conf"))
	if err := os.WriteFile(c.path("kubelet.yaml"), []byte(cfg), 0o644); err != nil {
		return err
	}
	c.start(t, &daemon{name: "kubelet", args: []string{filepath.Join(c.bin, "kubelet"),
		"--config", c.path("kubelet.yaml"), "--kubeconfig", c.kubeconfig,
		"--root-dir", c.path("kubelet"), "--hostname-override", nodeName, "--node-ip", nodeIP}})
	return nil
}
