package sandbox

import (
	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// ContainerStats is a container's cgroup statistics, in containerd's
// cgroup v2 metrics, which is what the shim reports.
type ContainerStats = cgroupstats.Metrics

// containerStats converts the agent's container stats (Kata's units: CPU
// times in nanoseconds, memory.stat keys in the Stats map) into
// containerd's cgroup v2 metrics.
func containerStats(st *pb.StatsContainerResponse) *ContainerStats {
	m := &cgroupstats.Metrics{}
	cg := st.GetCgroupStats()
	if cg == nil {
		return m
	}
	if p := cg.GetPidsStats(); p != nil {
		m.Pids = &cgroupstats.PidsStat{Current: p.GetCurrent(), Limit: p.GetLimit()}
	}
	if c := cg.GetCpuStats(); c != nil {
		u, t := c.GetCpuUsage(), c.GetThrottlingData()
		m.CPU = &cgroupstats.CPUStat{
			UsageUsec:     u.GetTotalUsage() / 1000,
			UserUsec:      u.GetUsageInUsermode() / 1000,
			SystemUsec:    u.GetUsageInKernelmode() / 1000,
			NrPeriods:     t.GetPeriods(),
			NrThrottled:   t.GetThrottledPeriods(),
			ThrottledUsec: t.GetThrottledTime() / 1000,
		}
	}
	if mem := cg.GetMemoryStats(); mem != nil {
		s := mem.GetStats()
		m.Memory = &cgroupstats.MemoryStat{
			Usage:                 mem.GetUsage().GetUsage(),
			UsageLimit:            mem.GetUsage().GetLimit(),
			MaxUsage:              mem.GetUsage().GetMaxUsage(),
			SwapUsage:             mem.GetSwapUsage().GetUsage(),
			SwapLimit:             mem.GetSwapUsage().GetLimit(),
			Anon:                  s["anon"],
			File:                  s["file"],
			KernelStack:           s["kernel_stack"],
			Slab:                  s["slab"],
			Sock:                  s["sock"],
			Shmem:                 s["shmem"],
			FileMapped:            s["file_mapped"],
			FileDirty:             s["file_dirty"],
			FileWriteback:         s["file_writeback"],
			AnonThp:               s["anon_thp"],
			InactiveAnon:          s["inactive_anon"],
			ActiveAnon:            s["active_anon"],
			InactiveFile:          s["inactive_file"],
			ActiveFile:            s["active_file"],
			Unevictable:           s["unevictable"],
			SlabReclaimable:       s["slab_reclaimable"],
			SlabUnreclaimable:     s["slab_unreclaimable"],
			Pgfault:               s["pgfault"],
			Pgmajfault:            s["pgmajfault"],
			WorkingsetRefault:     s["workingset_refault"],
			WorkingsetActivate:    s["workingset_activate"],
			WorkingsetNodereclaim: s["workingset_nodereclaim"],
			Pgrefill:              s["pgrefill"],
			Pgscan:                s["pgscan"],
			Pgsteal:               s["pgsteal"],
			Pgactivate:            s["pgactivate"],
			Pgdeactivate:          s["pgdeactivate"],
			Pglazyfree:            s["pglazyfree"],
			Pglazyfreed:           s["pglazyfreed"],
			ThpFaultAlloc:         s["thp_fault_alloc"],
			ThpCollapseAlloc:      s["thp_collapse_alloc"],
		}
		m.MemoryEvents = &cgroupstats.MemoryEvents{Max: mem.GetUsage().GetFailcnt()}
	}
	return m
}
