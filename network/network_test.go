package network

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// These tests build real namespaces with ip(8) and read them back with
// tc(8) and ip(8), the tools an operator would use, not with the netlink
// library under test.

func needRoot(t *testing.T) {
	t.Helper()
	testenv.Root(t, "creating network namespaces")
	for _, tool := range []string{"ip", "tc"} {
		testenv.Tool(t, tool, "iproute2")
	}
}

func run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// podNetNS makes a pod namespace whose eth0 is a veth to a peer namespace,
// as a CNI plugin would, and removes both at the end of the test.
func podNetNS(t *testing.T) (pod, peer string) {
	t.Helper()
	id := fmt.Sprintf("kfsx-ut-%d-%d", os.Getpid(), time.Now().UnixNano()%100000)
	pod, peer = id+"-pod", id+"-peer"
	run(t, "ip", "netns", "add", pod)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", pod).Run() })
	run(t, "ip", "netns", "add", peer)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", peer).Run() })
	run(t, "ip", "-n", pod, "link", "add", "eth0", "mtu", "1400", "type", "veth", "peer", "name", "peer0", "netns", peer)
	run(t, "ip", "-n", pod, "addr", "add", "10.251.7.2/24", "dev", "eth0")
	run(t, "ip", "-n", pod, "addr", "add", "fd00:251:7::2/64", "dev", "eth0", "nodad")
	run(t, "ip", "-n", pod, "link", "set", "eth0", "up")
	run(t, "ip", "-n", pod, "link", "set", "lo", "up")
	run(t, "ip", "-n", pod, "route", "add", "default", "via", "10.251.7.1")
	run(t, "ip", "-n", pod, "neigh", "add", "10.251.7.9", "lladdr", "02:00:00:00:07:09", "dev", "eth0", "nud", "permanent")
	run(t, "ip", "-n", peer, "addr", "add", "10.251.7.1/24", "dev", "peer0")
	run(t, "ip", "-n", peer, "link", "set", "peer0", "up")
	return pod, peer
}

func TestSetupTeardown(t *testing.T) {
	needRoot(t)
	pod, peer := podNetNS(t)
	link := run(t, "ip", "-n", pod, "-o", "link", "show", "eth0")
	wantMAC := fieldAfter(link, "link/ether")

	n, err := Setup("/var/run/netns/"+pod, Options{})
	if err != nil {
		t.Fatal(err)
	}
	torn := false
	t.Cleanup(func() {
		if !torn {
			n.Teardown()
		}
	})
	if len(n.Interfaces) != 1 {
		t.Fatalf("interfaces: got %d, want eth0 only (lo skipped)", len(n.Interfaces))
	}
	ifc := n.Interfaces[0]
	if ifc.Name != "eth0" || ifc.Type != "veth" || ifc.Tap != "tap0_kata" || ifc.MTU != 1400 || ifc.HardwareAddr.String() != wantMAC {
		t.Errorf("interface: got name %s type %s tap %s mtu %d mac %s; want eth0 veth tap0_kata 1400 %s", ifc.Name, ifc.Type, ifc.Tap, ifc.MTU, ifc.HardwareAddr, wantMAC)
	}
	var addrs []string
	for _, a := range ifc.Addrs {
		addrs = append(addrs, a.String())
	}
	if strings.Join(addrs, " ") != "10.251.7.2/24 fd00:251:7::2/64" {
		t.Errorf("addresses: got %v, want 10.251.7.2/24 and fd00:251:7::2/64 (no link-local)", addrs)
	}
	var def bool
	for _, r := range n.Routes {
		if r.Dst == nil && r.Gw.Equal(net.ParseIP("10.251.7.1")) && r.Device == "eth0" && r.Family == unix.AF_INET {
			def = true
		}
		if r.Dst != nil && r.Dst.String() == "10.251.7.0/24" {
			t.Errorf("route %v: the kernel's subnet route must be left to the guest's kernel", r.Dst)
		}
	}
	if !def {
		t.Errorf("routes %+v: no default route via 10.251.7.1 dev eth0", n.Routes)
	}
	if len(n.Neighbors) != 1 || !n.Neighbors[0].IP.Equal(net.ParseIP("10.251.7.9")) || n.Neighbors[0].HardwareAddr.String() != "02:00:00:00:07:09" {
		t.Errorf("neighbours: got %+v, want the permanent 10.251.7.9 only", n.Neighbors)
	}
	if len(ifc.Files) != 1 {
		t.Fatalf("tap fds: got %d, want 1 queue", len(ifc.Files))
	}
	if n.VhostNet != canOpen("/dev/vhost-net") {
		t.Errorf("vhost-net %v (%s), but /dev/vhost-net opens: %v", n.VhostNet, n.VhostReason, canOpen("/dev/vhost-net"))
	}

	tap := run(t, "ip", "-n", pod, "-d", "-o", "link", "show", "tap0_kata")
	for _, want := range []string{"mtu 1400", "tun type tap", "multi_queue", "vnet_hdr", "UP"} {
		if !strings.Contains(tap, want) {
			t.Errorf("tap0_kata: %q missing in %s", want, tap)
		}
	}
	for dev, to := range map[string]string{"eth0": "tap0_kata", "tap0_kata": "eth0"} {
		if q := run(t, "tc", "-n", pod, "qdisc", "show", "dev", dev, "ingress"); !strings.Contains(q, "qdisc ingress ffff:") {
			t.Errorf("%s: no ingress qdisc: %s", dev, q)
		}
		f := run(t, "tc", "-n", pod, "filter", "show", "dev", dev, "ingress")
		for _, want := range []string{"u32", "match 00000000/00000000", "mirred (Egress Redirect to device " + to + ") stolen"} {
			if !strings.Contains(f, want) {
				t.Errorf("%s ingress filters: %q missing in:\n%s", dev, want, f)
			}
		}
	}

	// A frame from the peer to the pod's address comes out of the tap:
	// the redirect works, not just its configuration.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ping := exec.CommandContext(ctx, "ip", "netns", "exec", peer, "busybox", "ping", "-c", "20", "10.251.7.2")
	if err := ping.Start(); err != nil {
		t.Fatal(err)
	}
	defer ping.Wait()
	defer cancel()
	want := append([]byte{0x08, 0x06}, []byte{0, 1, 8, 0, 6, 4, 0, 1}...) // ARP request for IPv4
	if !readFrame(t, ifc.Files[0], want, net.ParseIP("10.251.7.2").To4(), 8*time.Second) {
		t.Error("no ARP request for 10.251.7.2 from the peer came out of tap0_kata")
	}
	cancel()

	if err := n.Teardown(); err != nil {
		t.Fatal(err)
	}
	torn = true
	assertClean(t, pod)
	if err := n.Teardown(); err != nil {
		t.Errorf("second Teardown: %v", err)
	}
}

// readFrame reads the tap until a frame holding both byte strings arrives.
func readFrame(t *testing.T, f *os.File, a, b []byte, d time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(d)
	buf := make([]byte, 65536)
	for time.Now().Before(deadline) {
		f.SetReadDeadline(deadline)
		n, err := f.Read(buf)
		if err != nil {
			t.Logf("read tap: %v", err)
			return false
		}
		if bytes.Contains(buf[:n], a) && bytes.Contains(buf[:n], b) {
			return true
		}
	}
	return false
}

func canOpen(p string) bool {
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// assertClean fails unless pod's namespace has no tap, ingress qdisc or filter left.
func assertClean(t *testing.T, pod string) {
	t.Helper()
	if out := run(t, "ip", "-n", pod, "-o", "link", "show"); strings.Contains(out, "_kata") {
		t.Errorf("tap left behind:\n%s", out)
	}
	if q := run(t, "tc", "-n", pod, "qdisc", "show", "dev", "eth0", "ingress"); strings.TrimSpace(q) != "" {
		t.Errorf("eth0 ingress qdisc left behind: %s", q)
	}
	if f := run(t, "tc", "-n", pod, "filter", "show", "dev", "eth0", "ingress"); strings.TrimSpace(f) != "" {
		t.Errorf("eth0 filters left behind: %s", f)
	}
}

func fieldAfter(s, key string) string {
	f := strings.Fields(s)
	for i := range f[:len(f)-1] {
		if f[i] == key {
			return f[i+1]
		}
	}
	return ""
}

// A namespace Setup cannot wire is left as it was.
func TestSetupFailureLeavesNothing(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	// After eth0 in index order, so eth0's tap and filters exist when it fails.
	run(t, "ip", "-n", pod, "tuntap", "add", "tun9", "mode", "tun")
	_, err := Setup("/var/run/netns/"+pod, Options{})
	if err == nil || !strings.Contains(err.Error(), `tun9: link type "tuntap" is not supported`) {
		t.Fatalf("Setup with a tun link: got %v, want an error naming tun9 and its type", err)
	}
	assertClean(t, pod)
}

func TestSetupNoNamespace(t *testing.T) {
	_, err := Setup("/var/run/netns/kfsx-no-such-netns", Options{})
	if err == nil || !strings.Contains(err.Error(), "/var/run/netns/kfsx-no-such-netns") {
		t.Fatalf("got %v, want an error naming the namespace path", err)
	}
}

// The namespace removed under a running pod (CNI DEL first) took its taps
// with it: Teardown does not fail for that.
func TestTeardownAfterNamespaceRemoved(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	n, err := Setup("/var/run/netns/"+pod, Options{})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "ip", "-n", pod, "link", "del", "eth0")
	run(t, "ip", "netns", "del", pod)
	if err := n.Teardown(); err != nil {
		t.Fatalf("Teardown after the interface and the namespace's name were removed: %v", err)
	}
}

// Children started with a Pdeathsig (the shim's virtiofsd) survive Setup
// and Teardown: the threads that entered the pod's namespace return to
// the Go scheduler instead of exiting, which would signal the children
// they had forked.
func TestChildrenSurviveNamespaceThreads(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	var children []*exec.Cmd
	for range 16 {
		c := exec.Command("sleep", "120")
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		children = append(children, c)
	}
	for range 20 {
		n, err := Setup("/var/run/netns/"+pod, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if err := n.Teardown(); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range children {
		if err := c.Process.Signal(syscall.Signal(0)); err != nil {
			t.Fatalf("a child with a Pdeathsig died during Setup/Teardown: %v", err)
		}
		var ws syscall.WaitStatus
		if pid, _ := syscall.Wait4(c.Process.Pid, &ws, syscall.WNOHANG, nil); pid != 0 {
			t.Fatalf("a child with a Pdeathsig died during Setup/Teardown: %v", ws)
		}
	}
}

// TestListenInPodNamespace: Listen's socket is in the pod's namespace, so
// a client there (ip netns exec, as containerd's port-forward dials from
// inside it) reaches it on the pod's loopback, and the host's loopback
// does not; after Teardown the namespace can no longer be listened in.
func TestListenInPodNamespace(t *testing.T) {
	needRoot(t)
	testenv.Tool(t, "busybox", "busybox-static")
	pod, _ := podNetNS(t)
	n, err := Setup("/var/run/netns/"+pod, Options{})
	if err != nil {
		t.Fatal(err)
	}
	l, err := n.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("in the pod\n"))
			c.Close()
		}
	}()
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	out := run(t, "ip", "netns", "exec", pod, "busybox", "nc", "127.0.0.1", port)
	if out != "in the pod\n" {
		t.Fatalf("nc in the pod's namespace read %q", out)
	}
	if c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, time.Second); err == nil {
		// Someone else may hold the port on the host's loopback: only our
		// listener's greeting would be the failure.
		c.SetReadDeadline(time.Now().Add(time.Second))
		b, _ := io.ReadAll(io.LimitReader(c, 64))
		c.Close()
		if string(b) == "in the pod\n" {
			t.Fatal("the listener answered on the host's loopback")
		}
	}
	if err := n.Teardown(); err != nil {
		t.Fatal(err)
	}
	if l2, err := n.Listen("127.0.0.1:0"); err == nil {
		l2.Close()
		t.Fatal("Listen after Teardown succeeded")
	}
}
