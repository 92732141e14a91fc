package sandbox

import (
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/config"
)

func TestWorkloadSizing(t *testing.T) {
	i64 := func(v int64) *int64 { return &v }
	u64 := func(v uint64) *uint64 { return &v }
	pod := func(kv ...string) map[string]string {
		m := map[string]string{config.AnnotationContainerType: "sandbox"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		name string
		ann  map[string]string
		res  *specs.LinuxResources
		cpus float32
		mem  uint32
	}{
		// Kata's own example: 220000/100000 is 2.2 CPUs, 1048576 bytes 1 MiB.
		{"cri pod", pod(AnnotationSandboxCPUPeriod, "100000", AnnotationSandboxCPUQuota, "220000", AnnotationSandboxMemory, "1048576"), nil, 2.2, 1},
		{"cri pod without limits", pod(), nil, 0, 0},
		{"cri pod unconstrained quota", pod(AnnotationSandboxCPUPeriod, "100000", AnnotationSandboxCPUQuota, "-1", AnnotationSandboxMemory, "-1"), nil, 0, 0},
		{"cri pod static cpu manager", pod(AnnotationSandboxCPUQuota, "-1", AnnotationSandboxCPUShares, "2048"), nil, 2, 0},
		{"cri pod best effort shares", pod(AnnotationSandboxCPUShares, "2"), nil, 0, 0},
		// A pod's annotations size it, not the sandbox container's resources.
		{"cri pod ignores resources", pod(), &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: i64(1 << 30)}}, 0, 0},
		{"lone container", nil, &specs.LinuxResources{
			Memory: &specs.LinuxMemory{Limit: i64(256 << 20)},
			CPU:    &specs.LinuxCPU{Quota: i64(150000), Period: u64(100000)},
		}, 1.5, 256},
		{"lone container quota without period", nil, &specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: i64(150000)}}, 0, 0},
		{"lone container annotations ignored", map[string]string{AnnotationSandboxMemory: "1073741824"}, nil, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sz, err := WorkloadSizing(tc.ann, tc.res)
			if err != nil {
				t.Fatal(err)
			}
			if sz.CPUs != tc.cpus || sz.MemoryMiB != tc.mem {
				t.Errorf("sizing %+v, want %g CPUs %d MiB", sz, tc.cpus, tc.mem)
			}
		})
	}
}

func TestWorkloadSizingRefusesBadAnnotations(t *testing.T) {
	for key, v := range map[string]string{
		AnnotationSandboxMemory:    "1G",
		AnnotationSandboxCPUPeriod: "-5",
		AnnotationSandboxCPUQuota:  "lots",
		AnnotationSandboxCPUShares: "1.5",
	} {
		_, err := WorkloadSizing(map[string]string{config.AnnotationContainerType: "sandbox", key: v}, nil)
		if err == nil || !strings.Contains(err.Error(), key) {
			t.Errorf("%s = %q: err %v, want one naming the annotation", key, v, err)
		}
	}
}

func TestApplySizing(t *testing.T) {
	q := &config.QEMU{DefaultVCPUsRequested: 1, DefaultVCPUs: 1, DefaultMemory: 2048}
	applySizing(q, Sizing{CPUs: 2.2, MemoryMiB: 512})
	// Kata: 1 + 2.2 vCPUs boots ceil(3.2) = 4; memory adds up.
	if q.DefaultVCPUs != 4 || q.DefaultMemory != 2560 {
		t.Errorf("vCPUs %d memory %d, want 4 and 2560", q.DefaultVCPUs, q.DefaultMemory)
	}
	q = &config.QEMU{DefaultVCPUs: 1, DefaultMemory: 512}
	applySizing(q, Sizing{})
	if q.DefaultVCPUs != 1 || q.DefaultMemory != 512 {
		t.Errorf("no workload: vCPUs %d memory %d, want the defaults", q.DefaultVCPUs, q.DefaultMemory)
	}
}
