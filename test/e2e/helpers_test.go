// Package e2e holds end-to-end tests that drive the built binaries against
// real QEMU, virtiofsd and the test guest kit.
package e2e

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

var repoRoot = func() string {
	d, _ := filepath.Abs("../..")
	return d
}()

// goBuild builds ./cmd/NAME into bin/NAME once per test binary run.
func goBuild(name string) func() (string, error) {
	return sync.OnceValues(func() (string, error) {
		bin := filepath.Join(repoRoot, "bin", name)
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/"+name)
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build %s: %v\n%s", name, err, out)
		}
		return bin, nil
	})
}

// The binaries the tests run: the operator CLI, the shim containerd
// starts, and the snapshotter's mount helper beside the shim on
// containerd's PATH.
var (
	buildKataFSX       = goBuild("kata-fsx")
	buildShim          = goBuild("containerd-shim-kata-fsx-v2")
	buildOverlayHelper = goBuild("kata-fsx-overlay")
)

func kataFSX(t *testing.T) string {
	t.Helper()
	bin, err := buildKataFSX()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// testAccel resolves accelerator = "auto" once for the whole run (the KVM
// boot probe is slow where KVM is broken) and gives every test's config the
// verdict explicitly; KATA_FSX_TEST_ACCEL overrides it.
func testAccel(kit string) string {
	if a := os.Getenv("KATA_FSX_TEST_ACCEL"); a != "" {
		return a
	}
	return resolveAccel()
}

var resolveAccel = sync.OnceValue(func() string {
	a, why := hypervisor.ResolveAccel(context.Background(), "/usr/bin/qemu-system-x86_64",
		filepath.Join(kitDir(), "vmlinux"), filepath.Join(repoRoot, "build", "cache"))
	fmt.Fprintf(os.Stderr, "e2e: accelerator %s: %s\n", a, why)
	return string(a)
})

func kitDir() string {
	if dir := os.Getenv("KATA_FSX_GUEST_DIR"); dir != "" {
		return dir
	}
	return filepath.Join(repoRoot, "build", "guest")
}

// guestKit returns the kit directory, or ends the test through testenv
// when the kit, QEMU or root is missing.
func guestKit(t *testing.T) string {
	t.Helper()
	dir := kitDir()
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			testenv.Missing(t, "guest kit missing (%v): run 'make guest' or set KATA_FSX_GUEST_DIR", err)
		}
	}
	if _, err := os.Stat("/usr/bin/qemu-system-x86_64"); err != nil {
		testenv.Missing(t, "QEMU missing (apt-get install qemu-system-x86): %v", err)
	}
	testenv.Root(t, "pod VMs (mounts, virtiofsd)")
	return dir
}

// env is one test's private world: a config whose state directories are
// its own, so leftovers can be checked.
type env struct {
	t        *testing.T
	dir      string
	stateDir string
	config   string
}

func newEnv(t *testing.T, extra string) *env {
	kit := guestKit(t)
	return newEnvBooting(t, kit, fmt.Sprintf("kernel = %q\ninitrd = %q\n", kit+"/vmlinux", kit+"/initrd.img"), extra, "")
}

// newEnvBooting is newEnv with the guest's boot keys (kernel, initrd or
// image) given as TOML lines, and lines for the [kata_fsx] table.
func newEnvBooting(t *testing.T, kit, boot, extra, kataFSX string) *env {
	dir := t.TempDir()
	envDirs.Store(dir, true)
	e := &env{t: t, dir: dir, stateDir: filepath.Join(dir, "run")}
	accel := testAccel(kit)
	cfg := fmt.Sprintf(`[hypervisor.qemu]
path = "/usr/bin/qemu-system-x86_64"
%sdefault_memory = 512
virtio_fs_daemon = "/usr/lib/qemu/virtiofsd"
valid_virtio_fs_daemon_paths = ["/usr/lib/qemu/virtiofsd"]
%s
[agent.kata]
dial_timeout = 90

[kata_fsx]
%saccelerator = "%s"
state_dir = "%s"

[kata_fsx.imagefs_blk]
state_dir = "%s/blk"
`, boot, extra, kataFSX, accel, e.stateDir, dir)
	e.config = filepath.Join(dir, "configuration.toml")
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.assertNothingLeft)
	return e
}

// busyboxRootfs makes a rootfs of the static busybox with its applets.
func busyboxRootfs(t *testing.T) string {
	t.Helper()
	bb := "/bin/busybox"
	f, err := elf.Open(bb)
	if errors.Is(err, fs.ErrNotExist) {
		testenv.Missing(t, "busybox: %v (apt-get install busybox-static)", err)
	}
	if err != nil {
		t.Fatalf("busybox: %v", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			f.Close()
			testenv.Missing(t, "/bin/busybox is dynamic (apt-get install busybox-static)")
		}
	}
	f.Close()
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc", "root"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"sh", "echo", "cat", "ls", "sleep", "mkdir", "rm", "stat", "chown", "find", "sync", "wc", "grep", "head", "md5sum", "mv", "dd", "touch", "seq", "xargs", "tr"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

type result struct {
	code           int
	stdout, stderr string
	took           time.Duration
}

// run runs bin/kata-fsx with the env's config and a deadline.
func (e *env) run(ctx context.Context, args ...string) result {
	e.t.Helper()
	return runCmd(e.t, exec.CommandContext(ctx, kataFSX(e.t), append([]string{args[0], "--config", e.config}, args[1:]...)...))
}

// runCmd runs cmd and returns what it printed and its exit code; a
// command that cannot be run at all fails the test.
func runCmd(t *testing.T, cmd *exec.Cmd) result {
	t.Helper()
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		// Killed at its context's end: a hung command is the caller's
		// finding, and a cleanup must go on past it.
		r.code = -1
		r.stderr += fmt.Sprintf("\n%v: %v", cmd.Args, err)
	} else if err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, r.stderr)
	}
	return r
}

// assertNothingLeft checks that no process, mount or state file of this
// test's world survived it.
func (e *env) assertNothingLeft() {
	t := e.t
	if pids := processesMentioning(e.dir); len(pids) > 0 {
		left := make([]string, 0, len(pids))
		for _, p := range pids {
			left = append(left, describeProcess(p))
			syscallKill(p)
		}
		t.Errorf("processes left behind: %v", left)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(mounts), "\n") {
		if strings.Contains(l, e.dir) {
			t.Errorf("mount left behind: %s", l)
		}
	}
	entries, _ := os.ReadDir(e.stateDir)
	for _, en := range entries {
		if en.Name() == "accel.json" {
			continue // the accelerator verdict cache is meant to stay
		}
		t.Errorf("state left behind: %s", filepath.Join(e.stateDir, en.Name()))
	}
}

// lingering waits, until ctx ends, for the processes whose command line
// mentions s to exit, and describes those that did not. Shims exit after
// replying to containerd's Shutdown, so for a moment they outlive the
// ctr command that deleted their pod.
func lingering(ctx context.Context, s string) []string {
	for ctx.Err() == nil && len(processesMentioning(s)) > 0 {
		time.Sleep(100 * time.Millisecond)
	}
	var left []string
	for _, pid := range processesMentioning(s) {
		left = append(left, describeProcess(pid))
	}
	return left
}

// describeProcess names a process by its pid and command line.
func describeProcess(pid int) string {
	b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	return fmt.Sprintf("%d (%s)", pid, strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " "))
}

func processesMentioning(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, en := range ents {
		pid, err := strconv.Atoi(en.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", en.Name(), "cmdline"))
		if err == nil && bytes.Contains(b, []byte(s)) {
			pids = append(pids, pid)
		}
	}
	return pids
}
