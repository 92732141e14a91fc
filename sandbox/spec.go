package sandbox

import (
	"fmt"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// guestSandboxShm is where the sandbox's ephemeral shm storage is mounted in the guest.
const guestSandboxShm = "/run/kata-containers/sandbox/shm"

// ExitNotExecutable is the shell's status for a command that cannot run,
// which the shim and `kata-fsx run` report when the agent cannot start a
// process.
const ExitNotExecutable = 127

// ProcessSpec converts an exec's OCI process into the agent's Process,
// refusing one the agent could not run.
func ProcessSpec(p *specs.Process) (*pb.Process, error) {
	s, err := agentSpec(&specs.Spec{Process: p}, "/", false)
	if err != nil {
		return nil, err
	}
	return s.Process, nil
}

// agentSpec converts an OCI runtime spec into the agent protocol's Spec,
// with the root path replaced by where the rootfs is inside the guest.
// The process's capabilities, rlimits and no_new_privs, and the linux
// cgroup resources, cgroups path and seccomp profile go to the agent, which
// enforces them in the guest; host-only parts (hooks, cgroup mounts,
// namespace paths) are dropped: the VM boundary stands in for them.
func agentSpec(s *specs.Spec, guestRoot string, readonly bool) (*pb.Spec, error) {
	if s == nil || s.Process == nil {
		return nil, fmt.Errorf("OCI spec has no process")
	}
	if len(s.Process.Args) == 0 {
		return nil, fmt.Errorf("OCI spec process has no args")
	}
	p := s.Process
	out := &pb.Spec{
		Version:  s.Version,
		Hostname: s.Hostname,
		Root:     &pb.Root{Path: guestRoot, Readonly: readonly},
		Process: &pb.Process{
			Terminal: p.Terminal,
			User: &pb.User{
				UID: p.User.UID, GID: p.User.GID,
				AdditionalGids: append([]uint32(nil), p.User.AdditionalGids...),
				Username:       p.User.Username,
			},
			Args:            append([]string(nil), p.Args...),
			Env:             append([]string(nil), p.Env...),
			Cwd:             p.Cwd,
			NoNewPrivileges: p.NoNewPrivileges,
			Capabilities:    agentCapabilities(p.Capabilities),
			Rlimits:         agentRlimits(p.Rlimits),
			OOMScoreAdj:     int64(derefInt(p.OOMScoreAdj)),
		},
		Annotations: map[string]string{},
	}
	if out.Process.Cwd == "" {
		out.Process.Cwd = "/"
	}
	if p.ConsoleSize != nil {
		out.Process.ConsoleSize = &pb.Box{Height: uint32(p.ConsoleSize.Height), Width: uint32(p.ConsoleSize.Width)}
	}
	for k, v := range s.Annotations {
		out.Annotations[k] = v
	}
	for _, m := range s.Mounts {
		// cgroup mounts belong to the host: the VM stands in for them.
		if m.Type == "cgroup" || m.Type == "cgroup2" {
			continue
		}
		bind := m.Type == "bind" || hasOption(m.Options, "bind") || hasOption(m.Options, "rbind")
		// The pod's /dev/shm is the sandbox's ephemeral shm storage in the
		// guest, as Kata does it, so the pod's containers share it.
		if bind && m.Destination == "/dev/shm" {
			out.Mounts = append(out.Mounts, &pb.Mount{Destination: m.Destination, Source: guestSandboxShm, Type: "bind", Options: []string{"rbind"}})
			continue
		}
		// Other host binds cannot be honoured inside the guest as they are;
		// the sandbox turns the ones it shares into guest paths before this.
		if bind {
			continue
		}
		out.Mounts = append(out.Mounts, &pb.Mount{Destination: m.Destination, Source: m.Source, Type: m.Type, Options: append([]string(nil), m.Options...)})
	}
	if s.Linux != nil {
		out.Linux = &pb.Linux{
			Sysctl:        s.Linux.Sysctl,
			MaskedPaths:   append([]string(nil), s.Linux.MaskedPaths...),
			ReadonlyPaths: append([]string(nil), s.Linux.ReadonlyPaths...),
		}
		out.Linux.CgroupsPath = s.Linux.CgroupsPath
		out.Linux.Resources = AgentResources(s.Linux.Resources)
		out.Linux.Seccomp = agentSeccomp(s.Linux.Seccomp)
		for _, ns := range s.Linux.Namespaces {
			// Namespace paths name host namespaces, meaningless in the guest.
			out.Linux.Namespaces = append(out.Linux.Namespaces, &pb.LinuxNamespace{Type: string(ns.Type)})
		}
	}
	return out, nil
}

func hasOption(opts []string, o string) bool {
	for _, x := range opts {
		if x == o {
			return true
		}
	}
	return false
}
