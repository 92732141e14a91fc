package sandbox

import (
	"fmt"
	"math"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/config"
)

// CRI's annotations on a pod sandbox's spec: the pod's CPU and memory
// limits, which Kata sizes the VM from under static_sandbox_resource_mgmt.
const (
	AnnotationSandboxCPUPeriod = "io.kubernetes.cri.sandbox-cpu-period"
	AnnotationSandboxCPUQuota  = "io.kubernetes.cri.sandbox-cpu-quota"
	AnnotationSandboxCPUShares = "io.kubernetes.cri.sandbox-cpu-shares"
	AnnotationSandboxMemory    = "io.kubernetes.cri.sandbox-memory"
)

// Sizing is what a pod's workload adds to the VM's default vCPUs and memory.
type Sizing struct {
	CPUs      float32 // quota/period; unconstrained adds none
	MemoryMiB uint32
	From      string // what the numbers came from, for the log
}

// WorkloadSizing is Kata's sandbox sizing: a pod sandbox (CRI's
// container-type annotation is "sandbox") is sized from CRI's sandbox
// annotations, a lone container (no container-type: ctr run) from its own
// cgroup resources. A malformed annotation is an error naming it.
func WorkloadSizing(annotations map[string]string, res *specs.LinuxResources) (Sizing, error) {
	ct := annotations[config.AnnotationContainerType]
	if ct == "" {
		ct = annotations[config.AnnotationCRIOContainerType]
	}
	if ct == "" {
		var quota int64
		var period uint64
		var mem int64
		if res != nil && res.CPU != nil && res.CPU.Quota != nil && res.CPU.Period != nil {
			quota, period = *res.CPU.Quota, *res.CPU.Period
		}
		if res != nil && res.Memory != nil && res.Memory.Limit != nil {
			mem = *res.Memory.Limit
		}
		return vmResources(quota, period, mem, "the container's cgroup resources"), nil
	}
	num := func(key string, bits int, signed bool) (int64, uint64, error) {
		v, ok := annotations[key]
		if !ok {
			return 0, 0, nil
		}
		if signed {
			n, err := strconv.ParseInt(v, 10, bits)
			if err != nil {
				return 0, 0, fmt.Errorf("annotation %s = %q is not an integer: %w", key, v, err)
			}
			return n, 0, nil
		}
		n, err := strconv.ParseUint(v, 10, bits)
		if err != nil {
			return 0, 0, fmt.Errorf("annotation %s = %q is not a non-negative integer: %w", key, v, err)
		}
		return 0, n, nil
	}
	_, period, err := num(AnnotationSandboxCPUPeriod, 64, false)
	if err != nil {
		return Sizing{}, err
	}
	quota, _, err := num(AnnotationSandboxCPUQuota, 64, true)
	if err != nil {
		return Sizing{}, err
	}
	_, shares, err := num(AnnotationSandboxCPUShares, 64, false)
	if err != nil {
		return Sizing{}, err
	}
	mem, _, err := num(AnnotationSandboxMemory, 64, true)
	if err != nil {
		return Sizing{}, err
	}
	sz := vmResources(quota, period, mem, "CRI's sandbox annotations")
	// kubelet's static CPU manager leaves the quota unconstrained (-1)
	// and gives whole CPUs: 1024 shares each, as Kata counts them.
	if quota < 0 && sz.CPUs == 0 && shares > 0 {
		sz.CPUs = float32(math.Ceil(float64(shares) / 1024))
	}
	return sz, nil
}

func vmResources(quota int64, period uint64, mem int64, from string) Sizing {
	sz := Sizing{From: from}
	if quota >= 0 && period != 0 {
		sz.CPUs = float32(quota) / float32(period)
	}
	if mem > 0 {
		sz.MemoryMiB = uint32(min(mem>>20, math.MaxUint32))
	}
	return sz
}

// applySizing adds the workload to the VM's vCPUs and memory, rounding
// vCPUs up as Kata does (1 + 2.2 CPUs boots 4).
func applySizing(q *config.QEMU, sz Sizing) {
	base := q.DefaultVCPUsRequested
	if base <= 0 {
		base = float32(q.DefaultVCPUs)
	}
	q.DefaultVCPUsRequested = base + sz.CPUs
	q.DefaultVCPUs = int32(math.Ceil(float64(q.DefaultVCPUsRequested)))
	q.DefaultMemory += sz.MemoryMiB
}
