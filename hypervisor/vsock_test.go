package hypervisor

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeVhostVsock stands in for the kernel's vhost-vsock CID table behind
// VHOST_VSOCK_SET_GUEST_CID: CIDs in use answer EADDRINUSE, an injected
// errno answers every call, and every attempt is recorded.
type fakeVhostVsock struct {
	inUse map[uint64]bool
	errno error
	tried []uint64
}

func (f *fakeVhostVsock) setCID(fd uintptr, cid uint64) error {
	f.tried = append(f.tried, cid)
	if f.errno != nil {
		return f.errno
	}
	if f.inUse[cid] {
		return unix.EADDRINUSE
	}
	return nil
}

func fixedRandom(v uint64) func(uint64) (uint64, error) {
	return func(n uint64) (uint64, error) {
		if v >= n {
			panic("fixed random value outside the range asked for")
		}
		return v, nil
	}
}

func TestCIDSearch(t *testing.T) {
	used := func(cids ...uint64) map[uint64]bool {
		m := map[uint64]bool{}
		for _, c := range cids {
			m[c] = true
		}
		return m
	}
	cases := []struct {
		name   string
		max    uint32
		random uint64 // offset of the start from 3
		inUse  map[uint64]bool
		want   uint32
		tried  []uint64
	}{
		{"random start is free", 100, 40, nil, 43, []uint64{43}},
		{"lowest start", 100, 0, nil, 3, []uint64{3}},
		{"highest start", 100, 97, nil, 100, []uint64{100}},
		{"in use: walk up", 100, 40, used(43, 44), 45, []uint64{43, 44, 45}},
		{"top in use: wrap downward", 10, 5, used(8, 9, 10), 7, []uint64{8, 9, 10, 7}},
		{"down to the first CID", 10, 2, used(5, 6, 7, 8, 9, 10, 4), 3, []uint64{5, 6, 7, 8, 9, 10, 4, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeVhostVsock{inUse: tc.inUse}
			s := cidSearch{setCID: f.setCID, random: fixedRandom(tc.random), max: tc.max}
			got, err := s.find(7)
			if err != nil || got != tc.want {
				t.Fatalf("find = %d, %v; want %d", got, err, tc.want)
			}
			if !slices.Equal(f.tried, tc.tried) {
				t.Errorf("tried %v, want %v", f.tried, tc.tried)
			}
		})
	}
}

func TestCIDSearchExhausted(t *testing.T) {
	f := &fakeVhostVsock{inUse: map[uint64]bool{}}
	for c := uint64(3); c <= 10; c++ {
		f.inUse[c] = true
	}
	s := cidSearch{setCID: f.setCID, random: fixedRandom(4), max: 10}
	_, err := s.find(7)
	if err == nil || !errors.Is(err, unix.EADDRINUSE) || !strings.Contains(err.Error(), "from 3 to 10") {
		t.Fatalf("exhausted range: %v", err)
	}
	if !slices.Equal(f.tried, []uint64{7, 8, 9, 10, 6, 5, 4, 3}) {
		t.Errorf("tried %v: want every CID once, up from 7 then down", f.tried)
	}
}

// TestCIDSearchStopsOnOtherErrors: an answer other than "in use" is the
// same for every CID, so the walk stops at the first one.
func TestCIDSearchStopsOnOtherErrors(t *testing.T) {
	f := &fakeVhostVsock{errno: unix.ENOTTY}
	s := cidSearch{setCID: f.setCID, random: fixedRandom(0), max: MaxGuestCID}
	_, err := s.find(7)
	if !errors.Is(err, unix.ENOTTY) || !strings.Contains(err.Error(), "VHOST_VSOCK_SET_GUEST_CID 3") || len(f.tried) != 1 {
		t.Fatalf("err %v after %d attempts", err, len(f.tried))
	}

	s.random = func(uint64) (uint64, error) { return 0, errors.New("no entropy") }
	if _, err := s.find(7); err == nil || !strings.Contains(err.Error(), "no entropy") {
		t.Fatalf("random failure: %v", err)
	}
}

// TestCIDSearchRandomRange: the start is drawn from [3, MaxGuestCID],
// never a reserved CID nor VMADDR_CID_ANY.
func TestCIDSearchRandomRange(t *testing.T) {
	var asked uint64
	f := &fakeVhostVsock{}
	s := defaultCIDSearch()
	s.setCID = f.setCID
	s.random = func(n uint64) (uint64, error) { asked = n; return n - 1, nil }
	got, err := s.find(7)
	if err != nil || got != MaxGuestCID || asked != uint64(MaxGuestCID)-2 {
		t.Fatalf("top of the range: cid %d (%v), random asked for [0, %d)", got, err, asked)
	}
	seen := map[uint32]bool{}
	s = defaultCIDSearch()
	s.setCID = (&fakeVhostVsock{}).setCID
	for range 20 {
		cid, err := s.find(7)
		if err != nil || cid < MinGuestCID || cid > MaxGuestCID {
			t.Fatalf("random cid %d, %v", cid, err)
		}
		seen[cid] = true
	}
	if len(seen) < 15 {
		t.Errorf("20 random starts gave only %d CIDs", len(seen))
	}
}

// TestFindContextIDWithoutDevice: on a host without /dev/vhost-vsock
// (this one) the error names the device.
func TestFindContextIDWithoutDevice(t *testing.T) {
	if _, err := os.Stat(devVhostVsock); err == nil {
		t.Skip("this host has /dev/vhost-vsock")
	}
	f, cid, err := FindContextID()
	if err == nil {
		f.Close()
		t.Fatalf("claimed CID %d without %s", cid, devVhostVsock)
	}
	if !strings.Contains(err.Error(), devVhostVsock) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("error %v", err)
	}
}

func TestAgentVsockVhostFDArgs(t *testing.T) {
	vhost, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer vhost.Close()
	vm := baseVM()
	vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 1234567, VhostFD: vhost}
	p, err := Build(vm)
	if err != nil {
		t.Fatal(err)
	}
	want := "vhost-vsock-pci,id=vsock-1234567,vhostfd=3,guest-cid=1234567,bus=pcie.0,addr=0x3"
	if !hasArg(p.Args, "-device", want) {
		t.Errorf("args lack -device %s:\n%s", want, strings.Join(p.Args, "\n"))
	}
	if len(p.ExtraFiles) != 1 || p.ExtraFiles[0] != vhost {
		t.Errorf("extra files %v, want the vhost fd as fd 3", p.ExtraFiles)
	}
	if _, ok := p.PCIPaths["vsock-1234567"]; !ok {
		t.Errorf("no PCI path for the vsock device: %v", p.PCIPaths)
	}

	vm.Agent.VhostFD = nil
	p, err = Build(vm)
	if err != nil || !hasArg(p.Args, "-device", "vhost-vsock-pci,id=vsock-1234567,guest-cid=1234567,bus=pcie.0,addr=0x3") || len(p.ExtraFiles) != 0 {
		t.Errorf("without a vhost fd: %v, extra files %v, args:\n%s", err, p.ExtraFiles, strings.Join(p.Args, "\n"))
	}
}

func TestAgentHybridVsockArgs(t *testing.T) {
	vm := baseVM()
	vm.Agent = AgentChannel{Transport: AgentHybridVsock, SocketPath: "/run/kata-fsx/x,y/vsock/vhost.sock"}
	p, err := Build(vm)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range [][2]string{
		{"-chardev", "socket,id=charvsock0,path=/run/kata-fsx/x,,y/vsock/vhost.sock"},
		{"-device", "vhost-user-vsock-pci,id=vsock0,chardev=charvsock0,bus=pcie.0,addr=0x3"},
	} {
		if !hasArg(p.Args, want[0], want[1]) {
			t.Errorf("args lack %s %s:\n%s", want[0], want[1], strings.Join(p.Args, "\n"))
		}
	}
	if strings.Contains(strings.Join(p.Args, " "), "guest-cid") {
		t.Error("vhost-user-vsock-pci has no guest-cid property: the backend's config space holds it")
	}
	if p.PCIPaths["vsock0"] == "" || len(p.ExtraFiles) != 0 {
		t.Errorf("PCI paths %v, extra files %v", p.PCIPaths, p.ExtraFiles)
	}
}

func TestAgentChannelRefusals(t *testing.T) {
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	cases := map[string]struct {
		mod  func(vm *VMConfig)
		want string
	}{
		"cid VMADDR_CID_ANY": {func(vm *VMConfig) { vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: ^uint32(0)} }, "want 3..4294967294"},
		"vhost fd on serial": {func(vm *VMConfig) { vm.Agent.VhostFD = devNull }, "only used by agent transport"},
		"hybrid without shared memory": {func(vm *VMConfig) {
			vm.SharedMemory = SharedMemoryOff
			vm.Agent = AgentChannel{Transport: AgentHybridVsock, SocketPath: "/run/v.sock"}
		}, "shared guest memory"},
		"hybrid device missing": {func(vm *VMConfig) {
			vm.Caps.Devices = []string{"virtio-serial-pci"}
			vm.Agent = AgentChannel{Transport: AgentHybridVsock, SocketPath: "/run/v.sock"}
		}, "vhost-user-vsock-pci is not supported"},
		"hybrid relative socket": {func(vm *VMConfig) { vm.Agent = AgentChannel{Transport: AgentHybridVsock, SocketPath: "v.sock"} }, "must be absolute"},
		"unknown transport":      {func(vm *VMConfig) { vm.Agent = AgentChannel{Transport: "tcp"} }, `agent transport "tcp"`},
		"device id vsock0 taken": {func(vm *VMConfig) {
			vm.Devices = []Device{&VhostUserBlk{ID: "vsock0", SocketPath: "/s"}}
		}, `"vsock0" is used twice`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			vm := baseVM()
			tc.mod(vm)
			_, err := Build(vm)
			if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestStartPassesVhostFD: QEMU receives the vhost fd as the vhostfd= it is
// told. This host has no /dev/vhost-vsock, so /dev/null stands in: QEMU
// then fails in vhost_set_owner on *that* fd (ENOTTY), where a missing fd
// would fail with EBADF.
func TestStartPassesVhostFD(t *testing.T) {
	vm := testVM(t, "q35")
	if !vm.Caps.VhostVsock {
		t.Skip("this QEMU has no vhost-vsock-pci")
	}
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 3, VhostFD: devNull}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := Start(ctx, vm)
	if err == nil {
		v.Stop(ctx)
		t.Fatal("QEMU started a vhost-vsock device on /dev/null")
	}
	if !strings.Contains(err.Error(), "vhost_set_owner failed: Inappropriate ioctl for device") {
		t.Fatalf("QEMU did not use the fd passed: %v", err)
	}
	if _, err := os.Stat(vm.Dir); err == nil {
		t.Errorf("VM directory %s left behind", vm.Dir)
	}
	// The caller's copy stays open: it holds the CID until QEMU is gone.
	if _, err := devNull.Stat(); err != nil {
		t.Errorf("the caller's vhost fd was closed: %v", err)
	}
}

func hasArg(args []string, flag, value string) bool {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag && args[i+1] == value {
			return true
		}
	}
	return false
}
