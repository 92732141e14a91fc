package cgroups

import (
	"testing"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

func TestResourceWrites(t *testing.T) {
	w, err := resourceWrites(&pb.LinuxResources{
		Memory: &pb.LinuxMemory{Limit: 64 << 20, Reservation: 32 << 20, Swap: 96 << 20},
		CPU:    &pb.LinuxCPU{Shares: 1024, Quota: 50000, Period: 200000, Cpus: "0-1"},
		Pids:   &pb.LinuxPids{Limit: -1},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, x := range w {
		got[x.file] = x.value
	}
	want := map[string]string{
		"memory.max": "67108864", "memory.low": "33554432",
		// OCI's swap is memory+swap; cgroup v2's is swap alone.
		"memory.swap.max": "33554432",
		// runc's shares -> weight: 1 + (1024-2)*9999/262142 = 39.
		"cpu.weight": "39", "cpu.max": "50000 200000", "cpuset.cpus": "0-1",
		"pids.max": "max",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("writes %v, want exactly %v", got, want)
	}
	// A period alone keeps the quota unlimited; the default period is 100ms.
	w, _ = resourceWrites(&pb.LinuxResources{CPU: &pb.LinuxCPU{Quota: -1}})
	if len(w) != 1 || w[0].value != "max 100000" {
		t.Errorf("unlimited quota: %v", w)
	}
	if w, _ := resourceWrites(&pb.LinuxResources{Memory: &pb.LinuxMemory{Limit: -1}}); len(w) != 2 || w[1].file != "memory.swap.max" || w[1].value != "max" {
		t.Errorf("unlimited memory: %v", w)
	}
	for _, bad := range []*pb.LinuxResources{
		{Memory: &pb.LinuxMemory{Swap: 1 << 20}},
		{Memory: &pb.LinuxMemory{Limit: 2 << 20, Swap: 1 << 20}},
		{CPU: &pb.LinuxCPU{RealtimeRuntime: 1000}},
	} {
		if _, err := resourceWrites(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestSharesToWeight(t *testing.T) {
	for shares, want := range map[uint64]uint64{2: 1, 262144: 10000, 1024: 39, 1: 1, 1 << 20: 10000} {
		if got := sharesToWeight(shares); got != want {
			t.Errorf("shares %d: weight %d, want %d", shares, got, want)
		}
	}
}

func TestCgroupPath(t *testing.T) {
	spec := func(p string) *pb.Spec { return &pb.Spec{Linux: &pb.Linux{CgroupsPath: p}} }
	for in, want := range map[string]string{
		"/default/c1": "default/c1",
		"k8s.io/abc":  "k8s.io/abc",
		"/a/../../b":  "b",
		"":            "kata-fsx/c1",
		"/":           "kata-fsx/c1",
		// systemd's slice:prefix:name form names no cgroupfs path.
		"kubepods-besteffort.slice:cri-containerd:c1": "kata-fsx/c1",
	} {
		if got := cgroupPath(spec(in), "c1"); got != want {
			t.Errorf("cgroupsPath %q: %q, want %q", in, got, want)
		}
	}
}
