package hypervisor

import (
	"errors"
	"net"
	"os"
	"sort"
	"strings"
	"testing"
)

func openFiles(t *testing.T, n int) []*os.File {
	t.Helper()
	var fs []*os.File
	for range n {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		fs = append(fs, f)
	}
	return fs
}

func netVM() *VMConfig {
	vm := baseVM()
	vm.Caps.Devices = append(vm.Caps.Devices, "virtio-net-pci")
	sort.Strings(vm.Caps.Devices)
	return vm
}

func testMAC(t *testing.T, s string) net.HardwareAddr {
	t.Helper()
	m, err := net.ParseMAC(s)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestNICArgsUserspace(t *testing.T) {
	vm := netVM()
	vm.Devices = []Device{fsDev()}
	taps := openFiles(t, 1)
	vm.NICs = []*NIC{{ID: "eth0", MAC: testMAC(t, "0a:58:0a:f4:00:05"), TapFiles: taps}}
	p, err := Build(vm)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range [][2]string{
		{"-netdev", "tap,id=net-eth0,fds=3"},
		// After the bridge (0x2), the agent's serial (0x3) and fs0 (0x4).
		{"-device", "virtio-net-pci,id=eth0,netdev=net-eth0,mac=0a:58:0a:f4:00:05,disable-modern=false,romfile=,bus=pcie.0,addr=0x5"},
	} {
		if !hasArg(p.Args, want[0], want[1]) {
			t.Errorf("args lack %s %s:\n%s", want[0], want[1], strings.Join(p.Args, "\n"))
		}
	}
	if strings.Contains(strings.Join(p.Args, " "), "vhost=on") {
		t.Error("vhost=on without vhost fds")
	}
	if len(p.ExtraFiles) != 1 || p.ExtraFiles[0] != taps[0] {
		t.Errorf("extra files %v, want the tap fd as fd 3", p.ExtraFiles)
	}
	if got := p.PCIPaths["eth0"]; got != "05" {
		t.Errorf("PCI path of eth0: %q, want 05", got)
	}
}

// Fd numbers continue after the agent's vhost fd, each NIC's taps then its vhost fds.
func TestNICArgsMultiQueueVhost(t *testing.T) {
	vm := netVM()
	agentFD := openFiles(t, 1)[0]
	vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 77, VhostFD: agentFD}
	taps, vhost, taps2 := openFiles(t, 2), openFiles(t, 2), openFiles(t, 1)
	vm.NICs = []*NIC{
		{ID: "eth0", MAC: testMAC(t, "0a:58:0a:f4:00:05"), TapFiles: taps, VhostFiles: vhost},
		{ID: "eth1", MAC: testMAC(t, "0a:58:0a:f4:00:06"), TapFiles: taps2},
	}
	p, err := Build(vm)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range [][2]string{
		{"-netdev", "tap,id=net-eth0,fds=4:5,vhost=on,vhostfds=6:7"},
		{"-device", "virtio-net-pci,id=eth0,netdev=net-eth0,mac=0a:58:0a:f4:00:05,disable-modern=false,mq=on,vectors=6,romfile=,bus=pcie.0,addr=0x4"},
		{"-netdev", "tap,id=net-eth1,fds=8"},
		{"-device", "virtio-net-pci,id=eth1,netdev=net-eth1,mac=0a:58:0a:f4:00:06,disable-modern=false,romfile=,bus=pcie.0,addr=0x5"},
	} {
		if !hasArg(p.Args, want[0], want[1]) {
			t.Errorf("args lack %s %s:\n%s", want[0], want[1], strings.Join(p.Args, "\n"))
		}
	}
	want := []*os.File{agentFD, taps[0], taps[1], vhost[0], vhost[1], taps2[0]}
	if len(p.ExtraFiles) != len(want) {
		t.Fatalf("extra files %v, want %v", p.ExtraFiles, want)
	}
	for i := range want {
		if p.ExtraFiles[i] != want[i] {
			t.Errorf("fd %d is not the expected file", 3+i)
		}
	}
}

func TestNICRefusals(t *testing.T) {
	mac := testMAC(t, "0a:58:0a:f4:00:05")
	for name, tc := range map[string]struct {
		mod  func(vm *VMConfig)
		want string
	}{
		"no tap fds":      {func(vm *VMConfig) { vm.NICs = []*NIC{{ID: "eth0", MAC: mac}} }, "NIC eth0: no tap fds"},
		"nil NIC":         {func(vm *VMConfig) { vm.NICs = []*NIC{nil} }, "NIC 0 is nil"},
		"vhost per queue": {func(vm *VMConfig) { vm.NICs[0].VhostFiles = openFiles(t, 2) }, "2 vhost fds for 1 queues"},
		"multicast MAC":   {func(vm *VMConfig) { vm.NICs[0].MAC = testMAC(t, "01:00:5e:00:00:01") }, "want a unicast Ethernet address"},
		"no MAC":          {func(vm *VMConfig) { vm.NICs[0].MAC = nil }, "want a unicast Ethernet address"},
		"bad id":          {func(vm *VMConfig) { vm.NICs[0].ID = "0eth" }, `NIC id "0eth"`},
		"id of a device":  {func(vm *VMConfig) { vm.Devices = []Device{fsDev()}; vm.NICs[0].ID = "fs0" }, `NIC id "fs0" is used twice`},
		"QEMU without it": {func(vm *VMConfig) { vm.Caps = testCaps(false) }, "device virtio-net-pci is not supported"},
		"two of one netdev": {func(vm *VMConfig) {
			vm.NICs = append(vm.NICs, &NIC{ID: "eth0", MAC: mac, TapFiles: vm.NICs[0].TapFiles})
		}, `NIC id "eth0" is used twice`},
	} {
		t.Run(name, func(t *testing.T) {
			vm := netVM()
			vm.NICs = []*NIC{{ID: "eth0", MAC: mac, TapFiles: openFiles(t, 1)}}
			tc.mod(vm)
			_, err := Build(vm)
			if err == nil || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an invalid-configuration error with %q", err, tc.want)
			}
		})
	}
}
