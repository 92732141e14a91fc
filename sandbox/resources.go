package sandbox

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// This file converts the OCI process's privileges and the linux section's
// cgroup resources and seccomp profile into Kata's agent messages. Kata's
// protocol has no field presence: an unset OCI value travels as zero, which
// the agent reads as "not set".

func agentCapabilities(c *specs.LinuxCapabilities) *pb.LinuxCapabilities {
	if c == nil {
		return nil
	}
	return &pb.LinuxCapabilities{
		Bounding:    append([]string(nil), c.Bounding...),
		Effective:   append([]string(nil), c.Effective...),
		Inheritable: append([]string(nil), c.Inheritable...),
		Permitted:   append([]string(nil), c.Permitted...),
		Ambient:     append([]string(nil), c.Ambient...),
	}
}

func agentRlimits(rs []specs.POSIXRlimit) []*pb.POSIXRlimit {
	var out []*pb.POSIXRlimit
	for _, r := range rs {
		out = append(out, &pb.POSIXRlimit{Type: r.Type, Hard: r.Hard, Soft: r.Soft})
	}
	return out
}

// AgentResources converts OCI linux resources into the agent's, for
// CreateContainer and UpdateContainer. Block I/O, hugepage, network and
// RDMA limits have no field in Kata's LinuxResources message and are not
// sent; neither are the deprecated kernel memory limits nor the host's
// cpuset.
func AgentResources(r *specs.LinuxResources) *pb.LinuxResources {
	if r == nil {
		return nil
	}
	out := &pb.LinuxResources{}
	for _, d := range r.Devices {
		out.Devices = append(out.Devices, &pb.LinuxDeviceCgroup{
			Allow: d.Allow, Type: d.Type, Major: derefInt64(d.Major), Minor: derefInt64(d.Minor), Access: d.Access,
		})
	}
	if m := r.Memory; m != nil {
		// kernel and kernelTCP are deprecated in OCI and have no cgroup v2
		// file: they are not sent.
		out.Memory = &pb.LinuxMemory{
			Limit: derefInt64(m.Limit), Reservation: derefInt64(m.Reservation), Swap: derefInt64(m.Swap),
		}
		if m.Swappiness != nil {
			out.Memory.Swappiness = *m.Swappiness
		}
		if m.DisableOOMKiller != nil {
			out.Memory.DisableOOMKiller = *m.DisableOOMKiller
		}
	}
	if c := r.CPU; c != nil {
		// cpus and mems name host CPUs and NUMA nodes, which the guest's
		// vCPUs and single node are not: Kata clears them too.
		out.CPU = &pb.LinuxCPU{Quota: derefInt64(c.Quota), RealtimeRuntime: derefInt64(c.RealtimeRuntime)}
		if c.Shares != nil {
			out.CPU.Shares = *c.Shares
		}
		if c.Period != nil {
			out.CPU.Period = *c.Period
		}
		if c.RealtimePeriod != nil {
			out.CPU.RealtimePeriod = *c.RealtimePeriod
		}
	}
	if p := r.Pids; p != nil {
		out.Pids = &pb.LinuxPids{Limit: derefInt64(p.Limit)}
	}
	return out
}

func agentSeccomp(s *specs.LinuxSeccomp) *pb.LinuxSeccomp {
	if s == nil {
		return nil
	}
	out := &pb.LinuxSeccomp{DefaultAction: string(s.DefaultAction)}
	for _, a := range s.Architectures {
		out.Architectures = append(out.Architectures, string(a))
	}
	for _, f := range s.Flags {
		out.Flags = append(out.Flags, string(f))
	}
	for _, sc := range s.Syscalls {
		ps := &pb.LinuxSyscall{Names: append([]string(nil), sc.Names...), Action: string(sc.Action)}
		if sc.ErrnoRet != nil {
			ps.ErrnoRet = &pb.LinuxSyscall_Errnoret{Errnoret: uint32(*sc.ErrnoRet)}
		}
		for _, a := range sc.Args {
			ps.Args = append(ps.Args, &pb.LinuxSeccompArg{Index: uint64(a.Index), Value: a.Value, ValueTwo: a.ValueTwo, Op: string(a.Op)})
		}
		out.Syscalls = append(out.Syscalls, ps)
	}
	return out
}

func derefInt64(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}

func derefInt(p *int) int {
	if p == nil {
		return 0
	}
	return *p
}
