package sandbox

import (
	"fmt"
	"path/filepath"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// guestSandboxShm is where the sandbox's ephemeral shm storage is mounted in the guest.
const guestSandboxShm = "/run/kata-containers/sandbox/shm"

// ExitNotExecutable is the shell's status for a command that cannot run,
// which the shim and `kata-fsx run` report when the agent cannot start a
// process.
const ExitNotExecutable = 127

// agentSpec converts an OCI runtime spec into the agent protocol's Spec,
// with the root path replaced by where the rootfs is inside the guest.
// The process's capabilities, rlimits and no_new_privs, and the linux
// cgroup resources, cgroups path and seccomp profile go to the agent, which
// enforces them in the guest; host-only parts (hooks, cgroup mounts,
// namespace paths) are dropped: the VM boundary stands in for them. Mounts
// are guestMounts' part.
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
			// Namespace paths name host namespaces, meaningless in the
			// guest; a PID namespace's path is read by sharesPodPID.
			out.Linux.Namespaces = append(out.Linux.Namespaces, &pb.LinuxNamespace{Type: string(ns.Type)})
		}
	}
	return out, nil
}

// sharesPodPID says whether the container joins its pod's PID namespace:
// CRI gives a container of a pod with a shared process namespace (PID
// mode POD) the path of the sandbox container's PID namespace, and one
// with a namespace of its own none. In the guest the agent joins the
// sandbox container's (the request's SandboxPidns, as Kata's runtime
// sets it).
func sharesPodPID(s *specs.Spec) bool {
	if s == nil || s.Linux == nil {
		return false
	}
	for _, ns := range s.Linux.Namespaces {
		if ns.Type == specs.PIDNamespace {
			return ns.Path != ""
		}
	}
	return false
}

// guestMountTypes are the filesystems a container mount may have besides
// a bind: the ones the guest kernel makes itself.
var guestMountTypes = map[string]bool{"proc": true, "sysfs": true, "tmpfs": true, "devpts": true, "mqueue": true}

// mountSharer shares a container's host paths with the guest.
type mountSharer interface {
	// shareBind shares the mount's source and returns its guest path and
	// whether the host leaves writable mounts below a read-only top
	// (virtiofs.Volume's WritableBelow).
	shareBind(m specs.Mount, o virtiofs.VolumeOptions) (guestPath string, writableBelow bool, err error)
	// memoryEmptyDir reports whether src is an emptyDir of medium
	// Memory, with the group that owns it.
	memoryEmptyDir(src string) (gid uint32, ok bool)
}

// guestMounts converts a container's OCI mounts, in order, into the
// agent's: host binds become binds of their shared copies, an emptyDir of
// medium Memory a guest tmpfs (Kata's ephemeral storage, returned as a
// storage) and the pod's /dev/shm the sandbox's shm. A mount that cannot
// be honoured is an error naming it; none is dropped but cgroup mounts,
// for which the VM stands in.
func guestMounts(mounts []specs.Mount, sh mountSharer) ([]*pb.Mount, []*pb.Storage, error) {
	var out []*pb.Mount
	var storages []*pb.Storage
	for _, m := range mounts {
		if m.Type == "cgroup" || m.Type == "cgroup2" {
			continue
		}
		if !filepath.IsAbs(m.Destination) {
			return nil, nil, fmt.Errorf("%s: the destination must be an absolute path", mountName(m))
		}
		opts := append([]string(nil), m.Options...)
		bind := m.Type == "bind" || hasOption(m.Options, "bind") || hasOption(m.Options, "rbind")
		if !bind {
			if !guestMountTypes[m.Type] {
				return nil, nil, fmt.Errorf("%s: type %q cannot be mounted in the guest: use a bind of a host path or one of proc, sysfs, tmpfs, devpts, mqueue", mountName(m), m.Type)
			}
			out = append(out, &pb.Mount{Destination: m.Destination, Source: m.Source, Type: m.Type, Options: opts})
			continue
		}
		// The pod's /dev/shm is the sandbox's ephemeral shm storage in the
		// guest, as Kata does it, so the pod's containers share it.
		if m.Destination == "/dev/shm" {
			out = append(out, &pb.Mount{Destination: m.Destination, Source: guestSandboxShm, Type: "bind", Options: []string{"rbind"}})
			continue
		}
		if !filepath.IsAbs(m.Source) {
			return nil, nil, fmt.Errorf("%s: a bind needs an absolute host path as its source", mountName(m))
		}
		readonly := mount.ReadOnly(m.Options)
		if gid, ok := sh.memoryEmptyDir(m.Source); ok {
			// The containers of a pod share the emptyDir: same mount point.
			mp := filepath.Join(guestEphemeral, filepath.Base(m.Source))
			st := &pb.Storage{Driver: "ephemeral", Source: "tmpfs", Fstype: "tmpfs", MountPoint: mp}
			if gid != 0 {
				st.Options = []string{fmt.Sprintf("fsgid=%d", gid)}
			}
			storages = append(storages, st)
			out = append(out, &pb.Mount{Destination: m.Destination, Source: mp, Type: "bind", Options: opts})
			continue
		}
		src, writableBelow, err := sh.shareBind(m, virtiofs.VolumeOptions{
			Recursive:         hasOption(m.Options, "rbind"),
			ReadOnly:          readonly,
			RecursiveReadOnly: readonly && mount.RecursiveReadOnly(m.Options),
		})
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", mountName(m), err)
		}
		if writableBelow {
			// The host's bind is read-only at its top; in the guest the
			// mounts below are part of the one shared filesystem, which a
			// read-only bind would close as a whole.
			opts = readWrite(opts)
		}
		out = append(out, &pb.Mount{Destination: m.Destination, Source: src, Type: "bind", Options: opts})
	}
	return out, storages, nil
}

// readWrite returns opts with ro turned into rw.
func readWrite(opts []string) []string {
	out := make([]string, 0, len(opts))
	for _, o := range opts {
		if o == "ro" {
			o = "rw"
		}
		out = append(out, o)
	}
	return out
}

func hasOption(opts []string, o string) bool {
	for _, x := range opts {
		if x == o {
			return true
		}
	}
	return false
}
