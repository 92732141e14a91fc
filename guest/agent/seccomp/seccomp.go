// Package seccomp compiles an OCI seccomp profile to a classic BPF filter in
// the agent and loads it in the helper that execs the container process.
package seccomp

import (
	"fmt"
	"math/bits"
	"runtime"
	"unsafe"

	seccompbpf "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// Program is an OCI seccomp profile compiled to classic BPF by the
// agent, for the helper to load just before exec.
type Program struct {
	Filter []bpf.RawInstruction `json:"filter"`
	Flags  uint                 `json:"flags"`
}

// seccompActions are OCI's actions; SCMP_ACT_KILL is libseccomp's name for
// killing the thread. SCMP_ACT_NOTIFY needs a listener the agent does not
// run, so it is refused.
var seccompActions = map[string]seccompbpf.Action{
	"SCMP_ACT_KILL":         seccompbpf.ActionKillThread,
	"SCMP_ACT_KILL_THREAD":  seccompbpf.ActionKillThread,
	"SCMP_ACT_KILL_PROCESS": seccompbpf.ActionKillProcess,
	"SCMP_ACT_TRAP":         seccompbpf.ActionTrap,
	"SCMP_ACT_ERRNO":        seccompbpf.ActionErrno,
	"SCMP_ACT_TRACE":        seccompbpf.ActionTrace,
	"SCMP_ACT_ALLOW":        seccompbpf.ActionAllow,
	"SCMP_ACT_LOG":          seccompbpf.ActionLog,
}

var seccompFlags = map[string]uint{
	"SECCOMP_FILTER_FLAG_LOG":        unix.SECCOMP_FILTER_FLAG_LOG,
	"SECCOMP_FILTER_FLAG_SPEC_ALLOW": unix.SECCOMP_FILTER_FLAG_SPEC_ALLOW,
	// TSYNC syncs the filter to the other threads of the process; the
	// helper execs right after loading, which leaves one thread.
	"SECCOMP_FILTER_FLAG_TSYNC": 0,
}

// seccompAction resolves an OCI action; ERRNO and TRACE carry errnoRet,
// EPERM when the profile gives none.
func seccompAction(name string, errno *uint32) (seccompbpf.Action, error) {
	a, ok := seccompActions[name]
	if !ok {
		return 0, fmt.Errorf("action %q is not supported (the kata-fsx agent runs no seccomp notify listener)", name)
	}
	if a == seccompbpf.ActionErrno || a == seccompbpf.ActionTrace {
		e := uint32(unix.EPERM)
		if errno != nil {
			e = *errno
		}
		if e > 0xffff {
			return 0, fmt.Errorf("errnoRet %d does not fit seccomp's 16-bit data", e)
		}
		if e == 0 && a == seccompbpf.ActionErrno {
			// The BPF builder turns a bare ERRNO into EPERM.
			return 0, fmt.Errorf("SCMP_ACT_ERRNO with errnoRet 0 (a denied call that reports success) is not supported")
		}
		a |= seccompbpf.Action(e)
	}
	return a, nil
}

// seccompCondition converts one OCI argument rule. SCMP_CMP_MASKED_EQ
// compares (arg & value) with valueTwo; the BPF builder has "no bit of the
// mask set" and, for one bit, "that bit set", which are the forms profiles
// use (containerd's default: clone flags masked equal to 0).
func seccompCondition(a *pb.LinuxSeccompArg) (seccompbpf.Condition, error) {
	c := seccompbpf.Condition{Argument: uint32(a.GetIndex()), Value: a.GetValue()}
	if a.GetIndex() > 5 {
		return c, fmt.Errorf("argument index %d is above 5", a.GetIndex())
	}
	switch a.GetOp() {
	case "SCMP_CMP_NE":
		c.Operation = seccompbpf.NotEqual
	case "SCMP_CMP_LT":
		c.Operation = seccompbpf.LessThan
	case "SCMP_CMP_LE":
		c.Operation = seccompbpf.LessOrEqual
	case "SCMP_CMP_EQ":
		c.Operation = seccompbpf.Equal
	case "SCMP_CMP_GE":
		c.Operation = seccompbpf.GreaterOrEqual
	case "SCMP_CMP_GT":
		c.Operation = seccompbpf.GreaterThan
	case "SCMP_CMP_MASKED_EQ":
		switch {
		case a.GetValueTwo() == 0:
			c.Operation = seccompbpf.BitsNotSet
		case a.GetValueTwo() == a.GetValue() && bits.OnesCount64(a.GetValue()) == 1:
			c.Operation = seccompbpf.BitsSet
		default:
			return c, fmt.Errorf("SCMP_CMP_MASKED_EQ with mask %#x and value %#x is not supported (only a value of 0, or of the mask's single bit)", a.GetValue(), a.GetValueTwo())
		}
	default:
		return c, fmt.Errorf("unknown argument operator %q", a.GetOp())
	}
	return c, nil
}

// Compile compiles an OCI profile for the guest's architecture. The
// rules are tried in the profile's order, the first match deciding; rules
// whose action is the default one are left out, as runc leaves them out.
// Syscalls the architecture does not know are skipped (as libseccomp
// skips them) and returned; other architectures listed in the profile get
// the default action for every syscall (x32 gets ENOSYS). A profile the
// builder cannot express is an InvalidArgument naming the rule.
func Compile(s *pb.LinuxSeccomp) (*Program, []string, error) {
	if s == nil {
		return nil, nil, nil
	}
	bad := func(format string, a ...any) error {
		return status.Errorf(codes.InvalidArgument, "seccomp: "+format, a...)
	}
	native, err := arch.GetInfo("")
	if err != nil {
		return nil, nil, bad("%v", err)
	}
	def, err := seccompAction(s.GetDefaultAction(), nil)
	if err != nil {
		return nil, nil, bad("defaultAction: %v", err)
	}
	prog := &Program{}
	for _, f := range s.GetFlags() {
		v, ok := seccompFlags[f]
		if !ok {
			return nil, nil, bad("unknown flag %q", f)
		}
		prog.Flags |= v
	}
	var skipped []string
	var groups []seccompbpf.SyscallGroup
	for i, r := range s.GetSyscalls() {
		var errno *uint32
		if e, ok := r.GetErrnoRet().(*pb.LinuxSyscall_Errnoret); ok {
			errno = &e.Errnoret
		}
		act, err := seccompAction(r.GetAction(), errno)
		if err != nil {
			return nil, nil, bad("syscalls[%d] %v: %v", i, r.GetNames(), err)
		}
		if act == def {
			continue
		}
		var conds seccompbpf.ArgumentConditions
		seen := map[uint64]bool{}
		for _, a := range r.GetArgs() {
			if seen[a.GetIndex()] {
				return nil, nil, bad("syscalls[%d] %v: two conditions on argument %d are not supported", i, r.GetNames(), a.GetIndex())
			}
			seen[a.GetIndex()] = true
			c, err := seccompCondition(a)
			if err != nil {
				return nil, nil, bad("syscalls[%d] %v: %v", i, r.GetNames(), err)
			}
			conds = append(conds, c)
		}
		g := seccompbpf.SyscallGroup{Action: act}
		dup := map[string]bool{}
		for _, n := range r.GetNames() {
			if _, ok := native.SyscallNames[n]; !ok {
				skipped = append(skipped, n)
				continue
			}
			if dup[n] {
				continue
			}
			dup[n] = true
			if len(conds) == 0 {
				g.Names = append(g.Names, n)
			} else {
				g.NamesWithCondtions = append(g.NamesWithCondtions, seccompbpf.NameWithConditions{Name: n, Conditions: conds})
			}
		}
		if len(dup) > 0 {
			groups = append(groups, g)
		}
	}
	var insts []bpf.Instruction
	if len(groups) == 0 {
		insts = []bpf.Instruction{bpf.RetConstant{Val: uint32(def)}}
	} else {
		// The builder only takes bare actions as the default; the errno
		// of an ERRNO default is patched into the final return, which
		// unmatched syscalls and other architectures reach.
		p := seccompbpf.Policy{DefaultAction: def &^ 0xffff, Syscalls: groups}
		insts, err = p.Assemble()
		if err != nil {
			return nil, nil, bad("%v", err)
		}
		last, ok := insts[len(insts)-1].(bpf.RetConstant)
		if !ok || last.Val&^0xffff != uint32(def&^0xffff) {
			return nil, nil, bad("the BPF builder did not end with the default action")
		}
		insts[len(insts)-1] = bpf.RetConstant{Val: uint32(def)}
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, nil, bad("%v", err)
	}
	if len(raw) > 4096 {
		return nil, nil, bad("the filter has %d instructions, above the kernel's 4096", len(raw))
	}
	prog.Filter = raw
	return prog, skipped, nil
}

// Load installs the filter on the calling thread, which execs next.
func Load(p *Program) error {
	if p == nil || len(p.Filter) == 0 {
		return nil
	}
	filter := make([]unix.SockFilter, len(p.Filter))
	for i, in := range p.Filter {
		filter[i] = unix.SockFilter{Code: in.Op, Jt: in.Jt, Jf: in.Jf, K: in.K}
	}
	fprog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	_, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, uintptr(p.Flags), uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(filter)
	if errno != 0 {
		return fmt.Errorf("seccomp: load the filter (%d instructions): %w", len(filter), errno)
	}
	return nil
}
