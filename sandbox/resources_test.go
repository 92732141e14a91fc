package sandbox

import (
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestAgentSpecCarriesLimits(t *testing.T) {
	i64 := func(v int64) *int64 { return &v }
	u64 := func(v uint64) *uint64 { return &v }
	errno := uint(1)
	s := &specs.Spec{
		Process: &specs.Process{
			Args:            []string{"sh"},
			NoNewPrivileges: true,
			Capabilities: &specs.LinuxCapabilities{
				Bounding: []string{"CAP_KILL", "CAP_CHOWN"}, Effective: []string{"CAP_KILL"},
				Permitted: []string{"CAP_KILL"}, Inheritable: []string{"CAP_CHOWN"}, Ambient: []string{"CAP_NET_RAW"},
			},
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 4096, Soft: 1024}},
		},
		Linux: &specs.Linux{
			CgroupsPath: "/default/c1",
			Resources: &specs.LinuxResources{
				Memory: &specs.LinuxMemory{Limit: i64(64 << 20), Reservation: i64(32 << 20), Swap: i64(128 << 20)},
				CPU:    &specs.LinuxCPU{Shares: u64(512), Quota: i64(50000), Period: u64(100000), Cpus: "0", Mems: "0"},
				Pids:   &specs.LinuxPids{Limit: i64(42)},
			},
			Seccomp: &specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Architectures: []specs.Arch{specs.ArchX86_64},
				Syscalls: []specs.LinuxSyscall{{Names: []string{"read"}, Action: specs.ActAllow, ErrnoRet: &errno,
					Args: []specs.LinuxSeccompArg{{Index: 1, Value: 2, ValueTwo: 3, Op: specs.OpEqualTo}}}}},
		},
	}
	out, err := agentSpec(s, "/rootfs", false)
	if err != nil {
		t.Fatal(err)
	}
	p := out.Process
	if !p.NoNewPrivileges || len(p.Capabilities.Bounding) != 2 || p.Capabilities.Effective[0] != "CAP_KILL" ||
		p.Capabilities.Inheritable[0] != "CAP_CHOWN" || p.Capabilities.Ambient[0] != "CAP_NET_RAW" {
		t.Errorf("process privileges: %v", p)
	}
	if len(p.Rlimits) != 1 || p.Rlimits[0].Type != "RLIMIT_NOFILE" || p.Rlimits[0].Hard != 4096 || p.Rlimits[0].Soft != 1024 {
		t.Errorf("rlimits: %v", p.Rlimits)
	}
	l := out.Linux
	r := l.Resources
	if l.CgroupsPath != "/default/c1" || r.Memory.Limit != 64<<20 || r.Memory.Reservation != 32<<20 || r.Memory.Swap != 128<<20 ||
		r.CPU.Shares != 512 || r.CPU.Quota != 50000 || r.CPU.Period != 100000 || r.CPU.Cpus != "" || r.CPU.Mems != "" || r.Pids.Limit != 42 {
		t.Errorf("resources: %v (cgroups path %q)", r, l.CgroupsPath)
	}
	sc := l.Seccomp
	if sc.DefaultAction != "SCMP_ACT_ERRNO" || sc.Architectures[0] != "SCMP_ARCH_X86_64" || sc.Syscalls[0].Names[0] != "read" ||
		sc.Syscalls[0].GetErrnoret() != 1 || sc.Syscalls[0].Args[0].Op != "SCMP_CMP_EQ" || sc.Syscalls[0].Args[0].ValueTwo != 3 {
		t.Errorf("seccomp: %v", sc)
	}
	// An exec's process carries its own privileges too.
	eps, err := NewProcessSpec(s.Process)
	if err != nil {
		t.Fatal(err)
	}
	if ep := eps.p; ep.Capabilities == nil || len(ep.Rlimits) != 1 || !ep.NoNewPrivileges {
		t.Errorf("ProcessSpec: %v", ep)
	}
	// Unset OCI values travel as zero, which the agent reads as unset.
	if r := AgentResources(&specs.LinuxResources{Memory: &specs.LinuxMemory{}}); r.Memory.Limit != 0 || r.CPU != nil || r.Pids != nil {
		t.Errorf("empty resources: %v", r)
	}
}
