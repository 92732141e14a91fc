package initproc

import (
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/seccomp"
)

// ExecInitArg is the role of the helper an exec'd process starts as: it
// runs in the container's namespaces already, applies the process's
// privileges and execs the command.
const ExecInitArg = "__exec-init"

// Privileges is what the OCI process asks of its credentials, resolved to
// numbers by the agent so the helper has nothing left to refuse but what
// the kernel refuses.
type Privileges struct {
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Groups []uint32 `json:"groups"`
	// Caps is nil when the spec has no capabilities: the process keeps
	// the agent's, as runc leaves them.
	Caps       *CapSets `json:"caps,omitempty"`
	Rlimits    []Rlimit `json:"rlimits,omitempty"`
	NoNewPrivs bool     `json:"noNewPrivs"`
	// Seccomp is the container's profile, compiled; nil without one.
	Seccomp *seccomp.Program `json:"seccomp,omitempty"`
}

// CapSets are capability bit masks.
type CapSets struct {
	Bounding, Effective, Permitted, Inheritable, Ambient uint64
}

// Rlimit is one resource limit of the process, resolved to its number.
type Rlimit struct {
	Resource int    `json:"resource"`
	Soft     uint64 `json:"soft"`
	Hard     uint64 `json:"hard"`
}

// capNames are the capabilities in kernel bit order.
var capNames = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
	"CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK",
	"CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE",
	"CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE",
	"CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE",
	"CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
	"CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
	"CAP_CHECKPOINT_RESTORE",
}

// rlimitNames are OCI's rlimit types.
var rlimitNames = map[string]int{
	"RLIMIT_CPU": unix.RLIMIT_CPU, "RLIMIT_FSIZE": unix.RLIMIT_FSIZE, "RLIMIT_DATA": unix.RLIMIT_DATA,
	"RLIMIT_STACK": unix.RLIMIT_STACK, "RLIMIT_CORE": unix.RLIMIT_CORE, "RLIMIT_RSS": unix.RLIMIT_RSS,
	"RLIMIT_NPROC": unix.RLIMIT_NPROC, "RLIMIT_NOFILE": unix.RLIMIT_NOFILE, "RLIMIT_MEMLOCK": unix.RLIMIT_MEMLOCK,
	"RLIMIT_AS": unix.RLIMIT_AS, "RLIMIT_LOCKS": unix.RLIMIT_LOCKS, "RLIMIT_SIGPENDING": unix.RLIMIT_SIGPENDING,
	"RLIMIT_MSGQUEUE": unix.RLIMIT_MSGQUEUE, "RLIMIT_NICE": unix.RLIMIT_NICE, "RLIMIT_RTPRIO": unix.RLIMIT_RTPRIO,
	"RLIMIT_RTTIME": unix.RLIMIT_RTTIME,
}

// lastCap is the guest kernel's highest capability; capabilities above it
// are skipped with a log line, as runc skips capabilities its kernel lacks.
func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return len(capNames) - 1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return len(capNames) - 1
	}
	return n
}

func capMask(names []string, last int, set string) (uint64, error) {
	var m uint64
	for _, n := range names {
		i := -1
		for j, c := range capNames {
			if strings.EqualFold(n, c) {
				i = j
				break
			}
		}
		if i < 0 {
			return 0, status.Errorf(codes.InvalidArgument, "capabilities.%s: unknown capability %q", set, n)
		}
		if i > last {
			log.Printf("capabilities.%s: %s is unknown to the guest kernel (last is %d): skipped", set, n, last)
			continue
		}
		m |= 1 << i
	}
	return m, nil
}

// ProcessPrivileges resolves an OCI process's user, capabilities,
// rlimits and no_new_privs, and compiles the container's seccomp profile;
// a bad name is an InvalidArgument naming it.
func ProcessPrivileges(p *pb.Process, sc *pb.LinuxSeccomp) (Privileges, error) {
	u := p.GetUser()
	out := Privileges{UID: u.GetUID(), GID: u.GetGID(), Groups: u.GetAdditionalGids(), NoNewPrivs: p.GetNoNewPrivileges()}
	prog, _, err := seccomp.Compile(sc)
	if err != nil {
		return out, err
	}
	out.Seccomp = prog
	if c := p.GetCapabilities(); c != nil {
		last := lastCap()
		var cs CapSets
		for _, s := range []struct {
			name  string
			names []string
			dst   *uint64
		}{
			{"bounding", c.GetBounding(), &cs.Bounding}, {"effective", c.GetEffective(), &cs.Effective},
			{"permitted", c.GetPermitted(), &cs.Permitted}, {"inheritable", c.GetInheritable(), &cs.Inheritable},
			{"ambient", c.GetAmbient(), &cs.Ambient},
		} {
			m, err := capMask(s.names, last, s.name)
			if err != nil {
				return out, err
			}
			*s.dst = m
		}
		out.Caps = &cs
	}
	for _, r := range p.GetRlimits() {
		res, ok := rlimitNames[strings.ToUpper(r.GetType())]
		if !ok {
			return out, status.Errorf(codes.InvalidArgument, "rlimits: unknown type %q", r.GetType())
		}
		if r.GetSoft() > r.GetHard() {
			return out, status.Errorf(codes.InvalidArgument, "rlimits: %s soft limit %d is above its hard limit %d", r.GetType(), r.GetSoft(), r.GetHard())
		}
		out.Rlimits = append(out.Rlimits, Rlimit{Resource: res, Soft: r.GetSoft(), Hard: r.GetHard()})
	}
	return out, nil
}

// applyRlimits sets the rlimits while the helper is still root, so raising
// a hard limit works. syscall's Setrlimit, not unix's: it also stops Go from
// restoring its own idea of RLIMIT_NOFILE at exec.
func applyRlimits(rls []Rlimit) error {
	for _, r := range rls {
		if err := syscall.Setrlimit(r.Resource, &syscall.Rlimit{Cur: r.Soft, Max: r.Hard}); err != nil {
			return fmt.Errorf("setrlimit %d to %d/%d: %w", r.Resource, r.Soft, r.Hard, err)
		}
	}
	return nil
}

// applyPrivileges drops to the process's credentials in runc's order:
// bounding set, then user and groups (keeping the permitted set across
// setuid), then the effective, permitted, inheritable and ambient sets,
// then no_new_privs and the seccomp filter. Without no_new_privs the
// filter is loaded first instead, while the helper still has CAP_SYS_ADMIN
// (as runc does), so the profile must allow what follows (setuid, capset,
// prctl: Docker's and containerd's defaults do). Capability and seccomp
// state is per thread: the caller has locked its OS thread and execs from it.
func applyPrivileges(p Privileges) error {
	if !p.NoNewPrivs {
		if err := seccomp.Load(p.Seccomp); err != nil {
			return err
		}
	}
	if p.Caps != nil {
		last := lastCap()
		for c := 0; c <= last; c++ {
			if p.Caps.Bounding&(1<<c) != 0 {
				continue
			}
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
			}
		}
		if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("prctl keepcaps: %w", err)
		}
	}
	if err := setUser(p.UID, p.GID, p.Groups); err != nil {
		return err
	}
	if p.Caps != nil {
		if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 0, 0, 0, 0); err != nil {
			return fmt.Errorf("prctl keepcaps: %w", err)
		}
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		for i := range data {
			shift := 32 * i
			data[i] = unix.CapUserData{
				Effective:   uint32(p.Caps.Effective >> shift),
				Permitted:   uint32(p.Caps.Permitted >> shift),
				Inheritable: uint32(p.Caps.Inheritable >> shift),
			}
		}
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capset effective %#x permitted %#x inheritable %#x: %w", p.Caps.Effective, p.Caps.Permitted, p.Caps.Inheritable, err)
		}
		if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
			return fmt.Errorf("clear ambient capabilities: %w", err)
		}
		for c := 0; c < 64; c++ {
			if p.Caps.Ambient&(1<<c) == 0 {
				continue
			}
			if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_RAISE, uintptr(c), 0, 0); err != nil {
				return fmt.Errorf("raise ambient capability %s (it must be permitted and inheritable too): %w", capNames[c], err)
			}
		}
	}
	if p.NoNewPrivs {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("prctl no_new_privs: %w", err)
		}
		if err := seccomp.Load(p.Seccomp); err != nil {
			return err
		}
	}
	return nil
}

func setUser(uid, gid uint32, groups []uint32) error {
	gs := make([]int, len(groups))
	for i, g := range groups {
		gs[i] = int(g)
	}
	if err := unix.Setgroups(gs); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := unix.Setresgid(int(gid), int(gid), int(gid)); err != nil {
		return fmt.Errorf("setgid %d: %w", gid, err)
	}
	if err := unix.Setresuid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setuid %d: %w", uid, err)
	}
	return nil
}

// ExecConfig is what the agent hands its exec helper.
type ExecConfig struct {
	Path       string     `json:"path"` // resolved in the container by the agent
	Args       []string   `json:"args"`
	Env        []string   `json:"env"`
	Cwd        string     `json:"cwd"`
	Privileges Privileges `json:"privileges"`
}

// ExecInit runs as an exec'd process before its command: in the
// container's namespaces and cgroup already, it applies the privileges and
// execs. Any failure is written to the sync fd and ends it with 127.
func ExecInit() {
	runtime.LockOSThread()
	sync := os.NewFile(SyncFd, "sync")
	unix.CloseOnExec(SyncFd)
	err := func() error {
		var cfg ExecConfig
		if err := json.Unmarshal([]byte(os.Getenv(ConfigEnv)), &cfg); err != nil {
			return fmt.Errorf("exec init: bad config: %w", err)
		}
		if len(cfg.Args) == 0 || cfg.Path == "" {
			return errors.New("exec init: no command")
		}
		return becomeProcess(cfg.Privileges, cfg.Cwd, cfg.Path, cfg.Args, cfg.Env)
	}()
	fmt.Fprint(sync, err.Error())
	os.Exit(127)
}
