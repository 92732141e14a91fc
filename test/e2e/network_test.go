package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// The network tests keep their traffic inside namespaces (and, for CNI, a
// bridge) they create: a pod's peer is a namespace of the test's, never
// the host's network.

// netTool runs a command of iproute2 or busybox on the host and fails the
// test when it fails.
func netTool(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// peeredNetNS makes a pod namespace whose eth0 (MTU 1400, prefix.2/24,
// default route via prefix.1) is a veth to peer0 (prefix.1/24) in a peer
// namespace, as a CNI plugin would wire a pod, and removes both at the end.
func peeredNetNS(t *testing.T, prefix string) (pod, peer string) {
	t.Helper()
	testenv.Root(t, "network namespaces")
	id := fmt.Sprintf("kfsx-e2e-%d", os.Getpid())
	pod, peer = id+"-pod", id+"-peer"
	t.Cleanup(func() {
		if l, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(l), id) {
			t.Errorf("network namespaces left behind:\n%s", l)
		}
	})
	netTool(t, "ip", "netns", "add", pod)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", pod).Run() })
	netTool(t, "ip", "netns", "add", peer)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", peer).Run() })
	netTool(t, "ip", "-n", pod, "link", "add", "eth0", "mtu", "1400", "type", "veth", "peer", "name", "peer0", "mtu", "1400", "netns", peer)
	netTool(t, "ip", "-n", pod, "addr", "add", prefix+".2/24", "dev", "eth0")
	netTool(t, "ip", "-n", pod, "link", "set", "eth0", "up")
	netTool(t, "ip", "-n", pod, "link", "set", "lo", "up")
	netTool(t, "ip", "-n", pod, "route", "add", "default", "via", prefix+".1")
	netTool(t, "ip", "-n", peer, "addr", "add", prefix+".1/24", "dev", "peer0")
	netTool(t, "ip", "-n", peer, "link", "set", "peer0", "up")
	netTool(t, "ip", "-n", peer, "link", "set", "lo", "up")
	return pod, peer
}

// serveIn runs busybox httpd in namespace ns on port, serving body as
// /index.html, until the test ends.
func serveIn(t *testing.T, ns, port, body string) {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "index.html"), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, "busybox", "httpd", "-f", "-p", port, "-h", dir)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
}

// httpGet is a shell command fetching http://host:port/ with busybox nc
// (busybox wget of Debian's busybox-static crashes on this host) and
// printing the body only.
func httpGet(host, port string) string {
	return fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 5 %s %s | sed '1,/^\r*$/d'`, host, port)
}

// fetchFrom polls http://host:port/ from namespace ns ("" for the test's
// own) until it answers or ctx ends, and returns the last answer and error.
func fetchFrom(ctx context.Context, ns, host, port string) (string, error) {
	var out []byte
	var err error
	for ctx.Err() == nil {
		args := []string{"busybox", "sh", "-c", httpGet(host, port)}
		if ns != "" {
			args = append([]string{"ip", "netns", "exec", ns}, args...)
		}
		out, err = exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err == nil && len(out) > 0 {
			return string(out), nil
		}
		time.Sleep(500 * time.Millisecond)
	}
	return string(out), fmt.Errorf("http://%s:%s/ from %q: %v (%w)", host, port, ns, err, ctx.Err())
}

// tcfilterState describes what of Kata's tcfilter wiring namespace ns
// holds: its taps and the ingress filters of dev.
func tcfilterState(t *testing.T, ns, dev string) (taps, filters string) {
	t.Helper()
	var tl []string
	for _, l := range strings.Split(netTool(t, "ip", "-n", ns, "-o", "link", "show"), "\n") {
		if strings.Contains(l, "_kata") {
			tl = append(tl, strings.TrimSpace(l))
		}
	}
	return strings.Join(tl, "\n"), strings.TrimSpace(netTool(t, "tc", "-n", ns, "filter", "show", "dev", dev, "ingress"))
}

// waitUnwired waits until namespace ns has no tap and dev no ingress
// filter, and fails the test with what is left if that does not come.
func waitUnwired(ctx context.Context, t *testing.T, ns, dev string) {
	t.Helper()
	var taps, filters string
	for ctx.Err() == nil {
		taps, filters = tcfilterState(t, ns, dev)
		qdisc := strings.TrimSpace(netTool(t, "tc", "-n", ns, "qdisc", "show", "dev", dev, "ingress"))
		if taps == "" && filters == "" && qdisc == "" {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Errorf("namespace %s after the pod: taps %q, %s ingress filters %q", ns, taps, dev, filters)
}

// TestNetworkCtrWithNS: `ctr run --with-ns network:PATH` on a namespace
// wired to a peer namespace: the pod has the namespace's interface (its
// MAC, MTU, address, default route and static neighbour), reaches a
// server in the peer and serves one the peer reaches at the pod's
// address; the taps and filters are gone once the task is deleted. With
// internetworking_model = "none" the same namespace gives the pod no NIC.
func TestNetworkCtrWithNS(t *testing.T) {
	ce := newContainerdEnv(t)
	pod, peer := peeredNetNS(t, "10.253.41")
	netTool(t, "ip", "-n", pod, "neigh", "add", "10.253.41.77", "lladdr", "02:00:00:00:41:77", "dev", "eth0", "nud", "permanent")
	netTool(t, "ip", "-n", pod, "addr", "add", "fd00:253:41::2/64", "dev", "eth0", "nodad")
	mac := strings.TrimSpace(netTool(t, "ip", "netns", "exec", pod, "cat", "/sys/class/net/eth0/address"))
	serveIn(t, peer, "8081", "from-peer\n")
	nsPath := "/var/run/netns/" + pod

	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	id := "net-ctr"
	if r := ce.ctr(ctx, ce.runArgs("-d", "--with-ns", "network:"+nsPath, ce.image, id,
		"/bin/sh", "-c", `mkdir -p /www && echo from-pod > /www/index.html && exec httpd -f -p 8080 -h /www`)...); r.code != 0 {
		t.Fatalf("ctr run -d --with-ns: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
		t.Fatalf("task %s is %q, want RUNNING\n%s", id, st, ce.logTail(4000))
	}

	taps, filters := tcfilterState(t, pod, "eth0")
	if !strings.Contains(taps, "tap0_kata") || !strings.Contains(filters, "Egress Redirect to device tap0_kata") {
		t.Errorf("while the pod runs: taps %q, eth0 ingress filters %q; want tap0_kata and a redirect to it", taps, filters)
	}
	if _, f := tcfilterState(t, pod, "tap0_kata"); !strings.Contains(f, "Egress Redirect to device eth0") {
		t.Errorf("tap0_kata ingress filters %q: want a redirect to eth0", f)
	}
	if !strings.Contains(ce.logTail(1<<20), "network: 1 interface(s) of "+nsPath+" through tcfilter; /dev/vhost-net") {
		t.Errorf("the shim did not log the pod's network and whether vhost-net serves it")
	}

	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "look", id, "/bin/sh", "-c",
		`cat /sys/class/net/eth0/address /sys/class/net/eth0/mtu; ip -o addr show dev eth0; ip route; cat /proc/net/arp`)
	if r.code != 0 {
		t.Fatalf("exec: %d %s%s", r.code, r.stdout, r.stderr)
	}
	t.Logf("the guest's network:\n%s", r.stdout)
	for _, want := range []string{mac + "\n1400\n", "inet 10.253.41.2/24", "inet6 fd00:253:41::2/64", "default via 10.253.41.1 dev eth0", "10.253.41.77"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("guest network: %q missing", want)
		}
	}
	if !strings.Contains(r.stdout, "02:00:00:00:41:77") {
		t.Errorf("guest ARP table lacks the namespace's permanent neighbour 10.253.41.77")
	}

	r = ce.ctr(ctx, "tasks", "exec", "--exec-id", "reach", id, "/bin/sh", "-c", httpGet("10.253.41.1", "8081"))
	if r.code != 0 || r.stdout != "from-peer\n" {
		t.Errorf("the pod fetching from the peer: exit %d %q %s", r.code, r.stdout, r.stderr)
	}
	fctx, fcancel := context.WithTimeout(ctx, time.Minute)
	got, err := fetchFrom(fctx, peer, "10.253.41.2", "8080")
	fcancel()
	if err != nil || got != "from-pod\n" {
		t.Errorf("the peer fetching from the pod: %q, %v", got, err)
	}

	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
	ce.waitTaskStatus(ctx, id, "STOPPED")
	if r := ce.ctr(ctx, "tasks", "delete", id); r.code != 0 {
		t.Errorf("ctr tasks delete: %d %s", r.code, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Errorf("ctr containers delete: %d %s", r.code, r.stderr)
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	waitUnwired(wctx, t, pod, "eth0")
	wcancel()

	// A pod whose VM does not start after its namespace was wired is
	// unwired by the failed start's cleanup.
	t.Run("failed boot", func(t *testing.T) {
		b, err := os.ReadFile(ce.config)
		if err != nil {
			t.Fatal(err)
		}
		bad := filepath.Join(t.TempDir(), "configuration.toml")
		cfg := regexp.MustCompile(`(?m)^initrd = .*$`).ReplaceAll(b, []byte(`initrd = "/nonexistent/kata-fsx-initrd.img"`))
		if err := os.WriteFile(bad, cfg, 0o644); err != nil {
			t.Fatal(err)
		}
		r := ce.ctr(ctx, "run", "--rm", "--runtime", "io.containerd.kata-fsx.v2", "--runtime-config-path", bad,
			"--with-ns", "network:"+nsPath, ce.image, "net-fail", "/bin/true")
		if r.code == 0 {
			t.Fatalf("ctr run with a missing initrd succeeded")
		}
		wired := regexp.MustCompile(`network: 1 interface\(s\) of ` + regexp.QuoteMeta(nsPath) + `.*sandbox=net-fail`)
		if !wired.MatchString(ce.logTail(1 << 20)) {
			t.Errorf("the failed pod never wired the namespace: the test shows nothing")
		}
		if !strings.Contains(r.stderr, "start QEMU") {
			t.Errorf("ctr run failed for another reason than QEMU's start: %s", r.stderr)
		}
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		waitUnwired(wctx, t, pod, "eth0")
		wcancel()
		ce.ctr(ctx, "containers", "delete", "net-fail")
	})

	// A VM with two vCPUs gets a two-queue tap and a multi-queue NIC, as Kata's.
	t.Run("two queues", func(t *testing.T) {
		b, err := os.ReadFile(ce.config)
		if err != nil {
			t.Fatal(err)
		}
		two := filepath.Join(t.TempDir(), "configuration.toml")
		cfg := strings.Replace(string(b), "[hypervisor.qemu]\n", "[hypervisor.qemu]\ndefault_vcpus = 2\n", 1)
		if err := os.WriteFile(two, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		r := ce.ctr(ctx, "run", "--rm", "--runtime", "io.containerd.kata-fsx.v2", "--runtime-config-path", two,
			"--with-ns", "network:"+nsPath, ce.image, "net-mq", "/bin/sh", "-c", "ls /sys/class/net/eth0/queues; "+httpGet("10.253.41.1", "8081"))
		if r.code != 0 {
			t.Fatalf("ctr run: %d %s%s", r.code, r.stdout, r.stderr)
		}
		if got := strings.Fields(r.stdout); len(got) != 5 || strings.Join(got[:4], " ") != "rx-0 rx-1 tx-0 tx-1" || got[4] != "from-peer" {
			t.Errorf("guest eth0 queues and fetch from the peer: %q, want rx-0 rx-1 tx-0 tx-1 and from-peer", r.stdout)
		}
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		waitUnwired(wctx, t, pod, "eth0")
		wcancel()
	})

	t.Run("internetworking_model none", func(t *testing.T) {
		b, err := os.ReadFile(ce.config)
		if err != nil {
			t.Fatal(err)
		}
		none := filepath.Join(t.TempDir(), "configuration.toml")
		if err := os.WriteFile(none, append(b, "\n[runtime]\ninternetworking_model = \"none\"\n"...), 0o644); err != nil {
			t.Fatal(err)
		}
		r := ce.ctr(ctx, "run", "--rm", "--runtime", "io.containerd.kata-fsx.v2", "--runtime-config-path", none,
			"--with-ns", "network:"+nsPath, ce.image, "net-none", "/bin/sh", "-c", "ls /sys/class/net")
		if r.code != 0 {
			t.Fatalf("ctr run: %d %s%s", r.code, r.stdout, r.stderr)
		}
		if strings.Fields(r.stdout)[0] != "lo" || len(strings.Fields(r.stdout)) != 1 {
			t.Errorf("guest interfaces %q with internetworking_model = none: want lo only", r.stdout)
		}
		if taps, filters := tcfilterState(t, pod, "eth0"); taps != "" || filters != "" {
			t.Errorf("internetworking_model = none wired the namespace: taps %q filters %q", taps, filters)
		}
	})
}

// cniBridgeNet sets up the CNI network of c's CRI plugin from
// deploy/cni/10-kata-fsx-bridge.conflist with the test's own bridge,
// subnet and IPAM directory, and Debian's plugins linked into its bin_dir.
// It returns the bridge's name; the bridge is removed (and its removal
// checked) at the end of the test, after the pods and containerd.
func cniBridgeNet(t *testing.T, dir, subnet string) string {
	t.Helper()
	const plugins = "/usr/lib/cni"
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat(filepath.Join(plugins, p)); err != nil {
			testenv.Missing(t, "CNI plugin %s (apt-get install containernetworking-plugins): %v", p, err)
		}
		if err := os.Symlink(filepath.Join(plugins, p), filepath.Join(dir, "cni", "bin", p)); err != nil {
			t.Fatal(err)
		}
	}
	br := fmt.Sprintf("kfsxbr%d", os.Getpid()%100000)
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "cni", "10-kata-fsx-bridge.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	var conf map[string]any
	if err := json.Unmarshal(b, &conf); err != nil {
		t.Fatalf("deploy/cni/10-kata-fsx-bridge.conflist: %v", err)
	}
	// The deploy file's bridge plugin, confined: no NAT or port mapping
	// rules on the host, a subnet and a bridge of the test's own.
	bridge := conf["plugins"].([]any)[0].(map[string]any)
	bridge["bridge"], bridge["ipMasq"] = br, false
	ipam := bridge["ipam"].(map[string]any)
	ipam["ranges"] = []any{[]any{map[string]any{"subnet": subnet}}}
	ipam["dataDir"] = filepath.Join(dir, "cni", "ipam")
	conf["plugins"] = []any{bridge}
	conf["name"] = "kata-fsx-e2e"
	out, _ := json.MarshalIndent(conf, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "cni", "net.d", "10-kata-fsx-e2e.conflist"), out, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", br).Run()
		if out, err := exec.Command("ip", "-o", "link", "show", br).CombinedOutput(); err == nil {
			t.Errorf("bridge %s left behind: %s", br, out)
		}
	})
	return br
}

// crictlOut runs crictl and returns its stdout; crictl warns on stderr,
// which the error carries.
func (c *criEnv) crictlOut(ctx context.Context, t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--runtime-endpoint", "unix://" + c.sock, "--image-endpoint", "unix://" + c.sock, "--timeout", "2m"}, args...)
	cmd := exec.CommandContext(ctx, crictl(t), full...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("crictl %s: %w\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// crictlJSON runs crictl and decodes its JSON output into v.
func (c *criEnv) crictlJSON(ctx context.Context, t *testing.T, v any, args ...string) {
	t.Helper()
	out, err := c.crictlOut(ctx, t, args...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("crictl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// writeJSON writes v as a crictl config file in dir.
func writeJSON(t *testing.T, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// cniPod is a pod of TestNetworkCRIWithCNI.
type cniPod struct {
	name, backend      string
	podJSON, ctrJSON   string
	id, ctr, ip, netns string
}

// TestNetworkCRIWithCNI drives pods through crictl as the kubelet would,
// with containerd's CRI plugin running Debian's CNI bridge and host-local
// plugins: two pods at once, one per backend, each gets its address on the
// bridge's subnet, a server in each is reached from the other pod and from
// the test's own namespace, and each pod's /etc/resolv.conf and /etc/hosts
// are the files the CRI made. After the pods, their namespaces are gone,
// the bridge has no port and the IPAM no address, and no tap is left.
func TestNetworkCRIWithCNI(t *testing.T) {
	testenv.Root(t, "CNI")
	crictl(t)
	const subnet, gw = "10.254.61.0/24", "10.254.61.1"
	c := newCRIEnv(t)
	br := cniBridgeNet(t, c.dir, subnet)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// The CRI plugin picks the configuration up from conf_dir.
	for {
		var info struct {
			Status struct {
				Conditions []struct {
					Type   string `json:"type"`
					Status bool   `json:"status"`
				} `json:"conditions"`
			} `json:"status"`
		}
		c.crictlJSON(ctx, t, &info, "info")
		ready := false
		for _, cd := range info.Status.Conditions {
			ready = ready || cd.Type == "NetworkReady" && cd.Status
		}
		if ready {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the CRI never reported NetworkReady with the CNI configuration\n%s", c.logTail(4000))
		}
		time.Sleep(500 * time.Millisecond)
	}

	cfgDir := t.TempDir()
	pods := []*cniPod{{name: "net-virtiofs", backend: "virtio-fs"}, {name: "net-imagefsblk", backend: "imagefs-blk"}}
	for _, p := range pods {
		cfg := c.podConfig(p.name, p.backend)
		cfg.Linux.SecurityContext.NamespaceOptions = &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD}
		cfg.DnsConfig = &runtimeapi.DNSConfig{Servers: []string{"10.254.61.53"}, Searches: []string{p.name + ".kata-fsx.test"}, Options: []string{"ndots:3"}}
		if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
			t.Fatal(err)
		}
		p.podJSON = writeJSON(t, cfgDir, p.name+"-pod.json", cfg)
		p.ctrJSON = writeJSON(t, cfgDir, p.name+"-ctr.json", &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "web"},
			Image:    &runtimeapi.ImageSpec{Image: criBusyboxImage},
			Command:  []string{"/bin/sh", "-c", "mkdir -p /www && echo from-" + p.name + " > /www/index.html && exec httpd -f -p 8080 -h /www"},
			LogPath:  "web.log",
		})
	}
	// Both pods boot at once.
	errs := make(chan error, len(pods))
	for _, p := range pods {
		go func() {
			out, err := c.crictlOut(ctx, t, "runp", "--runtime", criRuntime, p.podJSON)
			if err != nil {
				errs <- fmt.Errorf("crictl runp %s: %v\n%s", p.name, err, out)
				return
			}
			p.id = strings.TrimSpace(out)
			errs <- c.trackShim(p.id)
		}()
	}
	for range pods {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	_, ipnet, _ := net.ParseCIDR(subnet)
	for _, p := range pods {
		out, err := c.crictlOut(ctx, t, "create", p.id, p.ctrJSON, p.podJSON)
		if err != nil {
			t.Fatalf("crictl create %s: %v\n%s", p.name, err, out)
		}
		p.ctr = strings.TrimSpace(out)
		if out, err := c.crictlOut(ctx, t, "start", p.ctr); err != nil {
			t.Fatalf("crictl start %s: %v\n%s", p.name, err, out)
		}
		var insp struct {
			Status struct {
				Network struct {
					IP string `json:"ip"`
				} `json:"network"`
			} `json:"status"`
			Info struct {
				RuntimeSpec struct {
					Linux struct {
						Namespaces []struct{ Type, Path string } `json:"namespaces"`
					} `json:"linux"`
				} `json:"runtimeSpec"`
			} `json:"info"`
		}
		c.crictlJSON(ctx, t, &insp, "inspectp", "-o", "json", p.id)
		p.ip = insp.Status.Network.IP
		for _, ns := range insp.Info.RuntimeSpec.Linux.Namespaces {
			if ns.Type == "network" {
				p.netns = ns.Path
			}
		}
		if ip := net.ParseIP(p.ip); ip == nil || !ipnet.Contains(ip) || p.ip == gw {
			t.Fatalf("pod %s: IP %q, want one of %s", p.name, p.ip, subnet)
		}
		if p.netns == "" {
			t.Fatalf("pod %s: no network namespace path in its sandbox spec", p.name)
		}
		t.Logf("pod %s (%s): %s in %s", p.name, p.backend, p.ip, p.netns)
		if !strings.Contains(c.logTail(1<<24), "network: 1 interface(s) of "+p.netns+" through tcfilter") {
			t.Errorf("pod %s: the shim did not wire %s", p.name, p.netns)
		}
		// The CNI's interface is the guest's, with the pod's address.
		out, err = c.crictlOut(ctx, t, "exec", "-s", p.ctr, "/bin/sh", "-c", "ip -o -4 addr show dev eth0")
		if err != nil || !strings.Contains(out, "inet "+p.ip+"/24") {
			t.Errorf("pod %s: guest eth0 %q (%v), want %s/24", p.name, out, err, p.ip)
		}
	}
	if q := pidsOf(c.stateDir, "qemu-system"); len(q) != 2 {
		t.Errorf("want the two pods' QEMUs side by side, found %v", q)
	}

	t.Run("reach", func(t *testing.T) {
		for i, p := range pods {
			other := pods[1-i]
			fctx, fcancel := context.WithTimeout(ctx, time.Minute)
			got, err := fetchFrom(fctx, "", p.ip, "8080")
			fcancel()
			if err != nil || got != "from-"+p.name+"\n" {
				t.Errorf("the test's namespace fetching from pod %s at %s: %q, %v", p.name, p.ip, got, err)
			}
			out, err := c.crictlOut(ctx, t, "exec", "-s", other.ctr, "/bin/sh", "-c", httpGet(p.ip, "8080"))
			// crictl exec -s ends what it prints with newlines of its own.
			if err != nil || strings.TrimSpace(out) != "from-"+p.name {
				t.Errorf("pod %s fetching from pod %s at %s: %q, %v", other.name, p.name, p.ip, out, err)
			}
		}
	})

	// containerd's CRI port-forward dials localhost:PORT in the pod's
	// namespace on the host; the shim's forwarder listens there for the
	// guest's ports. A server started after the pod is forwarded too.
	t.Run("port-forward", func(t *testing.T) {
		for _, p := range pods {
			if got := c.portForwardGet(ctx, t, p.id, 8080); got != "from-"+p.name+"\n" {
				t.Errorf("pod %s: through crictl port-forward to 8080: %q, want from-%s", p.name, got, p.name)
			}
			late := "mkdir -p /late && echo late-" + p.name + " > /late/index.html && httpd -p 8081 -h /late"
			if out, err := c.crictlOut(ctx, t, "exec", "-s", p.ctr, "/bin/sh", "-c", late); err != nil {
				t.Fatalf("pod %s: start a second server: %v\n%s", p.name, err, out)
			}
			if got := c.portForwardGet(ctx, t, p.id, 8081); got != "late-"+p.name+"\n" {
				t.Errorf("pod %s: through crictl port-forward to 8081, a server started later: %q, want late-%s", p.name, got, p.name)
			}
		}
	})

	// Host bind mounts of the pod's files: what CRI wrote is what the
	// container reads.
	t.Run("CRI files", func(t *testing.T) {
		for _, p := range pods {
			for _, f := range []string{"resolv.conf", "hosts"} {
				want, err := os.ReadFile(filepath.Join(c.dir, "root", "io.containerd.grpc.v1.cri", "sandboxes", p.id, f))
				if err != nil {
					t.Fatalf("the CRI's %s of pod %s: %v", f, p.name, err)
				}
				got, err := c.crictlOut(ctx, t, "exec", "-s", p.ctr, "/bin/sh", "-c", "cat /etc/"+f+" 2>&1; exit 0")
				if err != nil || strings.TrimSpace(got) != strings.TrimSpace(string(want)) {
					t.Errorf("pod %s: /etc/%s in the container is %q (%v), want the CRI's file %q", p.name, f, got, err, want)
				}
			}
		}
	})

	for _, p := range pods {
		if out, err := c.crictlRun(ctx, t, "stopp", p.id); err != nil {
			t.Errorf("crictl stopp %s: %v\n%s", p.name, err, out)
		}
		if out, err := c.crictlRun(ctx, t, "rmp", p.id); err != nil {
			t.Errorf("crictl rmp %s: %v\n%s", p.name, err, out)
		}
	}
	if left := lingering(ctx, c.sock); len(left) > 0 {
		t.Errorf("shim, QEMU or virtiofsd still running after the pods' removal: %v", left)
	}
	for _, p := range pods {
		if _, err := os.Stat(p.netns); err == nil {
			t.Errorf("pod %s: network namespace %s left behind", p.name, p.netns)
		}
	}
	if out := netTool(t, "ip", "-o", "link", "show", "master", br); strings.TrimSpace(out) != "" {
		t.Errorf("bridge %s still has ports:\n%s", br, out)
	}
	if out := netTool(t, "ip", "-o", "link", "show"); strings.Contains(out, "_kata") {
		t.Errorf("taps in the test's namespace:\n%s", out)
	}
	if ents, err := os.ReadDir(filepath.Join(c.dir, "cni", "ipam", "kata-fsx-e2e")); err == nil {
		for _, e := range ents {
			if net.ParseIP(e.Name()) != nil {
				t.Errorf("host-local still holds %s", e.Name())
			}
		}
	}
}

// forwardingRe is what crictl port-forward prints once it listens.
var forwardingRe = regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)`)

// portForwardGet runs crictl port-forward to the pod's port and GETs /
// through it, and returns the body. crictl (client-go) ends the session at
// the first connection the runtime cannot make, so a GET sent before the
// runtime forwards the port is retried with a new session, up to 2 minutes.
func (c *criEnv) portForwardGet(ctx context.Context, t *testing.T, podID string, port int) string {
	t.Helper()
	var last string
	err := testenv.Wait(2*time.Minute, func() (bool, error) {
		body, err := c.portForwardOnce(ctx, t, podID, port)
		if err != nil {
			last = err.Error()
			return false, err
		}
		last = body
		return true, nil
	})
	if err != nil {
		t.Fatalf("GET / through crictl port-forward %s %d: %v\n%s", podID, port, err, c.logTail(3000))
	}
	return last
}

// portForwardOnce is one crictl port-forward session and one GET through it.
func (c *criEnv) portForwardOnce(ctx context.Context, t *testing.T, podID string, port int) (string, error) {
	pctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(pctx, crictl(t), "--runtime-endpoint", "unix://"+c.sock, "--image-endpoint", "unix://"+c.sock,
		"port-forward", podID, fmt.Sprintf("0:%d", port))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	defer func() {
		cancel()
		_ = cmd.Wait()
	}()
	local := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := forwardingRe.FindStringSubmatch(sc.Text()); m != nil && m[2] == strconv.Itoa(port) {
				local <- m[1]
				break
			}
		}
		close(local)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	lport, ok := <-local
	if !ok {
		return "", fmt.Errorf("crictl port-forward printed no \"Forwarding from\" line: %s", stderr.String())
	}
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, "http://127.0.0.1:"+lport+"/", nil)
	if err != nil {
		return "", err
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return "", fmt.Errorf("%w (crictl: %s)", err, strings.TrimSpace(stderr.String()))
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %s, body %q, %v", resp.Status, body, err)
	}
	return string(body), nil
}
