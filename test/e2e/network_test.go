package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces")
	}
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
		`cat /sys/class/net/eth0/address /sys/class/net/eth0/mtu; ip -o -4 addr show dev eth0; ip route; cat /proc/net/arp`)
	if r.code != 0 {
		t.Fatalf("exec: %d %s%s", r.code, r.stdout, r.stderr)
	}
	t.Logf("the guest's network:\n%s", r.stdout)
	for _, want := range []string{mac + "\n1400\n", "inet 10.253.41.2/24", "default via 10.253.41.1 dev eth0", "10.253.41.77"} {
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
