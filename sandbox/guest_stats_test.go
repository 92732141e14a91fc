package sandbox

import (
	"testing"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

func TestContainerStats(t *testing.T) {
	st := &pb.StatsContainerResponse{CgroupStats: &pb.CgroupStats{
		CpuStats: &pb.CpuStats{
			CpuUsage:       &pb.CpuUsage{TotalUsage: 3_000_000, UsageInUsermode: 2_000_000, UsageInKernelmode: 1_000_000},
			ThrottlingData: &pb.ThrottlingData{Periods: 7, ThrottledPeriods: 2, ThrottledTime: 5000},
		},
		MemoryStats: &pb.MemoryStats{
			Usage:     &pb.MemoryData{Usage: 8 << 20, Limit: 64 << 20, MaxUsage: 9 << 20, Failcnt: 3},
			SwapUsage: &pb.MemoryData{Usage: 1 << 20, Limit: 2 << 20},
			Stats:     map[string]uint64{"anon": 6 << 20, "file": 2 << 20, "inactive_file": 1 << 20, "pgfault": 42},
		},
		PidsStats: &pb.PidsStats{Current: 3, Limit: 100},
	}}
	m := containerStats(st)
	// Kata's agent reports CPU times in nanoseconds; cgroup v2 metrics are in µs.
	if m.CPU.UsageUsec != 3000 || m.CPU.UserUsec != 2000 || m.CPU.SystemUsec != 1000 || m.CPU.NrPeriods != 7 || m.CPU.NrThrottled != 2 || m.CPU.ThrottledUsec != 5 {
		t.Errorf("cpu %v", m.CPU)
	}
	if m.Memory.Usage != 8<<20 || m.Memory.UsageLimit != 64<<20 || m.Memory.MaxUsage != 9<<20 || m.Memory.SwapUsage != 1<<20 || m.Memory.SwapLimit != 2<<20 ||
		m.Memory.Anon != 6<<20 || m.Memory.File != 2<<20 || m.Memory.InactiveFile != 1<<20 || m.Memory.Pgfault != 42 {
		t.Errorf("memory %v", m.Memory)
	}
	if m.MemoryEvents.Max != 3 || m.Pids.Current != 3 || m.Pids.Limit != 100 {
		t.Errorf("events %v pids %v", m.MemoryEvents, m.Pids)
	}
	// An agent that sends nothing gives empty metrics, not a crash.
	if m := containerStats(&pb.StatsContainerResponse{}); m.CPU != nil || m.Memory != nil {
		t.Errorf("empty stats: %v", m)
	}
}
