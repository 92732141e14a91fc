package seccomp

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	seccompbpf "github.com/elastic/go-seccomp-bpf"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

func errnoRet(e uint32) *pb.LinuxSyscall_Errnoret { return &pb.LinuxSyscall_Errnoret{Errnoret: e} }

// testProfile allows everything but mkdir (EOPNOTSUPP), SIGUSR1 through
// kill (EPERM, an argument condition) and a clone with CLONE_NEWUSER
// (containerd's masked-equal form).
func testProfile() *pb.LinuxSeccomp {
	return &pb.LinuxSeccomp{
		DefaultAction: "SCMP_ACT_ALLOW",
		Architectures: []string{"SCMP_ARCH_X86_64", "SCMP_ARCH_X86"},
		Syscalls: []*pb.LinuxSyscall{
			{Names: []string{"mkdir", "mkdirat", "no_such_syscall"}, Action: "SCMP_ACT_ERRNO", ErrnoRet: errnoRet(uint32(unix.EOPNOTSUPP))},
			{Names: []string{"kill"}, Action: "SCMP_ACT_ERRNO", Args: []*pb.LinuxSeccompArg{{Index: 1, Value: uint64(unix.SIGUSR1), Op: "SCMP_CMP_EQ"}}},
			{Names: []string{"unshare"}, Action: "SCMP_ACT_ERRNO", ErrnoRet: errnoRet(uint32(unix.ENOSYS)),
				Args: []*pb.LinuxSeccompArg{{Index: 0, Value: unix.CLONE_NEWUSER, ValueTwo: unix.CLONE_NEWUSER, Op: "SCMP_CMP_MASKED_EQ"}}},
			// The default action again: left out.
			{Names: []string{"read"}, Action: "SCMP_ACT_ALLOW"},
		},
	}
}

func TestCompileSeccomp(t *testing.T) {
	prog, skipped, err := Compile(testProfile())
	if err != nil {
		t.Fatal(err)
	}
	if len(skipped) != 1 || skipped[0] != "no_such_syscall" {
		t.Errorf("skipped %v, want [no_such_syscall]", skipped)
	}
	last := prog.Filter[len(prog.Filter)-1]
	ret, _ := bpf.RetConstant{}.Assemble()
	if last.Op != ret.Op || last.K != uint32(seccompbpf.ActionAllow) {
		t.Errorf("last instruction %+v, want RET ALLOW", last)
	}
	// An ERRNO default carries its errno (EPERM) in the final return.
	prog, _, err = Compile(&pb.LinuxSeccomp{DefaultAction: "SCMP_ACT_ERRNO", Flags: []string{"SECCOMP_FILTER_FLAG_LOG"},
		Syscalls: []*pb.LinuxSyscall{{Names: []string{"read", "write"}, Action: "SCMP_ACT_ALLOW"}}})
	if err != nil {
		t.Fatal(err)
	}
	if last := prog.Filter[len(prog.Filter)-1]; last.K != uint32(seccompbpf.ActionErrno)|uint32(unix.EPERM) {
		t.Errorf("ERRNO default returns %#x", last.K)
	}
	if prog.Flags != unix.SECCOMP_FILTER_FLAG_LOG {
		t.Errorf("flags %#x", prog.Flags)
	}
	for name, bad := range map[string]*pb.LinuxSeccomp{
		"notify":          {DefaultAction: "SCMP_ACT_NOTIFY"},
		"unknown action":  {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"read"}, Action: "SCMP_ACT_MAYBE"}}},
		"unknown flag":    {DefaultAction: "SCMP_ACT_ALLOW", Flags: []string{"SECCOMP_FILTER_FLAG_FAST"}},
		"masked multibit": {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"clone"}, Action: "SCMP_ACT_ERRNO", Args: []*pb.LinuxSeccompArg{{Value: 3, ValueTwo: 3, Op: "SCMP_CMP_MASKED_EQ"}}}}},
		"same argument":   {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"kill"}, Action: "SCMP_ACT_ERRNO", Args: []*pb.LinuxSeccompArg{{Index: 1, Value: 1, Op: "SCMP_CMP_EQ"}, {Index: 1, Value: 2, Op: "SCMP_CMP_EQ"}}}}},
		"argument 6":      {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"kill"}, Action: "SCMP_ACT_ERRNO", Args: []*pb.LinuxSeccompArg{{Index: 6, Op: "SCMP_CMP_EQ"}}}}},
		"errno 0":         {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"kill"}, Action: "SCMP_ACT_ERRNO", ErrnoRet: errnoRet(0)}}},
		"unknown op":      {DefaultAction: "SCMP_ACT_ALLOW", Syscalls: []*pb.LinuxSyscall{{Names: []string{"kill"}, Action: "SCMP_ACT_ERRNO", Args: []*pb.LinuxSeccompArg{{Op: "SCMP_CMP_ROUGHLY"}}}}},
	} {
		if _, _, err := Compile(bad); err == nil || !strings.HasPrefix(err.Error(), "rpc error: code = InvalidArgument desc = seccomp: ") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// seccompChildEnv makes the test binary a child that loads the filter
// given in it and tries the syscalls the profile restricts.
const seccompChildEnv = "KATA_FSX_TEST_SECCOMP_CHILD"

func init() {
	blob := os.Getenv(seccompChildEnv)
	if blob == "" {
		return
	}
	runtime.LockOSThread()
	var prog Program
	if err := json.Unmarshal([]byte(blob), &prog); err != nil {
		fmt.Println(err)
		os.Exit(2)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Println(err)
		os.Exit(2)
	}
	if err := Load(&prog); err != nil {
		fmt.Println(err)
		os.Exit(2)
	}
	report := func(what string, err error) {
		var e unix.Errno
		if errors.As(err, &e) {
			fmt.Printf("%s=%d\n", what, int(e))
		} else {
			fmt.Printf("%s=%v\n", what, err)
		}
	}
	report("mkdir", unix.Mkdir(filepath.Join(os.Getenv("TMPDIR_CHILD"), "d"), 0o755))
	report("kill0", unix.Kill(unix.Getpid(), 0))
	report("killusr1", unix.Kill(unix.Getpid(), unix.SIGUSR1))
	report("unshare-user", unix.Unshare(unix.CLONE_NEWUSER))
	report("unshare-uts", unix.Unshare(unix.CLONE_NEWUTS))
	os.Exit(0)
}

// TestSeccompFilterInProcess loads a compiled profile in a real process
// and checks the kernel enforces what the profile says.
func TestSeccompFilterInProcess(t *testing.T) {
	prog, _, err := Compile(testProfile())
	if err != nil {
		t.Fatal(err)
	}
	blob, _ := json.Marshal(prog)
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), seccompChildEnv+"="+string(blob), "TMPDIR_CHILD="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			got[k] = v
		}
	}
	want := map[string]string{
		"mkdir":        fmt.Sprint(int(unix.EOPNOTSUPP)),
		"kill0":        "<nil>",
		"killusr1":     fmt.Sprint(int(unix.EPERM)),
		"unshare-user": fmt.Sprint(int(unix.ENOSYS)),
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s, want %s (child said %q)", k, got[k], v, out)
		}
	}
	// Not matched by the masked rule: the kernel decides (root: allowed).
	if got["unshare-uts"] == fmt.Sprint(int(unix.ENOSYS)) {
		t.Errorf("unshare(CLONE_NEWUTS) hit the CLONE_NEWUSER rule")
	}
	if _, err := os.Stat(filepath.Join(dir, "d")); err == nil {
		t.Error("mkdir went through")
	}
}
