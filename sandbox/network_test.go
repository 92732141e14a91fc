package sandbox

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func netSandbox(t *testing.T, model string) *Sandbox {
	t.Helper()
	cfg := config.Default()
	cfg.KataFSX.StateDir = t.TempDir()
	cfg.Runtime.InterNetworkingModel = model
	s, err := newSandbox(context.Background(), "pod-net", config.Decision{Config: cfg, Backend: config.SharedFSVirtioFS})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// A pod gets NICs only with a namespace path and the tcfilter model.
func TestSetupNetworkWhenNoNIC(t *testing.T) {
	for _, tc := range []struct{ model, path string }{
		{"tcfilter", ""},
		{"none", "/var/run/netns/kfsx-never-opened"},
	} {
		s := netSandbox(t, tc.model)
		vmc := &hypervisor.VMConfig{VCPUs: 1}
		if err := s.setupNetwork(context.Background(), Spec{ID: s.ID, NetNSPath: tc.path}, vmc); err != nil {
			t.Errorf("model %q path %q: %v", tc.model, tc.path, err)
		}
		if len(vmc.NICs) != 0 || s.net != nil {
			t.Errorf("model %q path %q: NICs %v, want none", tc.model, tc.path, vmc.NICs)
		}
	}
	s := netSandbox(t, "tcfilter")
	err := s.setupNetwork(context.Background(), Spec{ID: s.ID, NetNSPath: "/var/run/netns/kfsx-no-such-ns"}, &hypervisor.VMConfig{VCPUs: 1})
	if err == nil || !strings.Contains(err.Error(), "/var/run/netns/kfsx-no-such-ns") {
		t.Errorf("a missing namespace: %v, want an error naming it", err)
	}
}

// The NICs match the namespace's interfaces, and Teardown leaves it as it was.
func TestSetupNetworkNICs(t *testing.T) {
	testenv.Root(t, "network namespaces")
	testenv.Tool(t, "ip", "iproute2")
	ns := fmt.Sprintf("kfsx-sb-%d-%d", os.Getpid(), time.Now().UnixNano()%100000)
	for _, args := range [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"},
		{"-n", ns, "link", "set", "eth0", "address", "0a:58:0a:00:00:02"},
		{"-n", ns, "link", "set", "eth1", "address", "0a:58:0a:00:00:03"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v %s", args, err, out)
		}
		if args[0] == "netns" {
			t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		}
	}
	s := netSandbox(t, "default")
	vmc := &hypervisor.VMConfig{VCPUs: 2}
	if err := s.setupNetwork(context.Background(), Spec{ID: s.ID, NetNSPath: "/var/run/netns/" + ns}, vmc); err != nil {
		t.Fatal(err)
	}
	if len(vmc.NICs) != 2 {
		t.Fatalf("NICs %v, want one per veth", vmc.NICs)
	}
	macs := map[string]bool{}
	for i, n := range vmc.NICs {
		macs[n.MAC.String()] = true
		if n.ID != fmt.Sprintf("nic%d", i) || n.MAC.String() != s.net.Interfaces[i].HardwareAddr.String() || len(n.TapFiles) != 2 {
			t.Errorf("NIC %d: id %s mac %s %d queues; want nic%d, its interface's MAC and a queue per vCPU", i, n.ID, n.MAC, len(n.TapFiles), i)
		}
	}
	if !macs["0a:58:0a:00:00:02"] || !macs["0a:58:0a:00:00:03"] {
		t.Errorf("NIC MACs %v, want the two veths'", macs)
	}
	if err := s.teardownNetwork(); err != nil {
		t.Fatal(err)
	}
	if out, _ := exec.Command("ip", "-n", ns, "-o", "link").CombinedOutput(); strings.Contains(string(out), "_kata") {
		t.Errorf("taps left:\n%s", out)
	}
}

func TestIPAddressMessage(t *testing.T) {
	_, n4, _ := net.ParseCIDR("10.1.2.3/24")
	a := ipAddress(net.ParseIP("10.1.2.3"), n4.Mask)
	if a.Family != pb.IPFamily_v4 || a.Address != "10.1.2.3" || a.Mask != "24" {
		t.Errorf("IPv4: %v", a)
	}
	_, n6, _ := net.ParseCIDR("fd00::5/64")
	a = ipAddress(net.ParseIP("fd00::5"), n6.Mask)
	if a.Family != pb.IPFamily_v6 || a.Address != "fd00::5" || a.Mask != "64" {
		t.Errorf("IPv6: %v", a)
	}
	if a = ipAddress(net.ParseIP("10.1.2.9"), nil); a.Mask != "" {
		t.Errorf("a neighbour's address has no mask: %v", a)
	}
}
