package virtiofs

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestArgsPerFlavour(t *testing.T) {
	c := &Daemon{Path: "/usr/lib/qemu/virtiofsd", Flavour: FlavourC}
	r := &Daemon{Path: "/usr/libexec/virtiofsd", Flavour: FlavourRust}
	kataExtra := []string{"--thread-pool-size=1", "--announce-submounts"}
	got, err := Args(Options{Daemon: c, SharedDir: "/s", Cache: "never", ExtraArgs: kataExtra})
	if err != nil {
		t.Fatal(err)
	}
	if want := "--fd=3 -f -o source=/s -o cache=none -o sandbox=namespace --thread-pool-size=1 -o announce_submounts"; strings.Join(got, " ") != want {
		t.Fatalf("C:\n got %s\nwant %s", strings.Join(got, " "), want)
	}
	got, err = Args(Options{Daemon: r, SharedDir: "/s", Cache: "always", ExtraArgs: kataExtra, Sandbox: "chroot"})
	if err != nil {
		t.Fatal(err)
	}
	if want := "--fd=3 --shared-dir=/s --cache=always --sandbox=chroot --thread-pool-size=1 --announce-submounts"; strings.Join(got, " ") != want {
		t.Fatalf("Rust:\n got %s\nwant %s", strings.Join(got, " "), want)
	}
	if _, err := Args(Options{Daemon: c, SharedDir: "/s", Cache: "metadata"}); err == nil || !strings.Contains(err.Error(), "virtio_fs_cache") {
		t.Fatalf("metadata for C: %v", err)
	}
	if _, err := Args(Options{Daemon: r, SharedDir: "/s", Cache: "auto", ExtraArgs: []string{"-o", "cache=always"}}); err == nil || !strings.Contains(err.Error(), "virtio_fs_extra_args") {
		t.Fatalf("-o cache for Rust: %v", err)
	}
}

func cDaemon(t *testing.T) *Daemon {
	t.Helper()
	if _, err := os.Stat(debianCDaemon); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-common, which qemu-system-x86 depends on): %v", err)
	}
	testenv.Root(t, "virtiofsd (mount namespace sandbox)")
	d, err := Detect(context.Background(), debianCDaemon)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// processesWithArg lists pids whose command line contains s.
func processesWithArg(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func TestStartStopLeavesNothing(t *testing.T) {
	d := cDaemon(t)
	dir := t.TempDir()
	shared := filepath.Join(dir, "shared-stop")
	os.Mkdir(shared, 0o755)
	sock := filepath.Join(dir, "vhost-fs.sock")
	p, err := Start(context.Background(), Options{Daemon: d, SharedDir: shared, Cache: "auto"}, sock)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %v %v", fi, err)
	}
	if len(processesWithArg("source="+shared)) == 0 {
		t.Fatal("virtiofsd not running")
	}
	p.Stop(context.Background())
	if err := p.Err(); err != nil {
		t.Fatalf("stopped daemon reported failure: %v", err)
	}
	if pids := processesWithArg("source=" + shared); len(pids) != 0 {
		t.Fatalf("virtiofsd processes left: %v", pids)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
}

func TestDaemonDeathIsReportedWithLastWords(t *testing.T) {
	d := cDaemon(t)
	dir := t.TempDir()
	shared := filepath.Join(dir, "shared-kill")
	os.Mkdir(shared, 0o755)
	p, err := Start(context.Background(), Options{Daemon: d, SharedDir: shared, Cache: "auto", ExtraArgs: []string{"-o", "log_level=debug"}}, filepath.Join(dir, "s.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(context.Background())
	syscall.Kill(p.Pid(), syscall.SIGKILL)
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("death not noticed")
	}
	err = p.Err()
	if err == nil || !strings.Contains(err.Error(), "virtiofsd") || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("got %v", err)
	}
}

func TestBadArgumentFailsAtStartWithDaemonOutput(t *testing.T) {
	d := cDaemon(t)
	dir := t.TempDir()
	_, err := Start(context.Background(), Options{Daemon: d, SharedDir: dir, Cache: "auto", ExtraArgs: []string{"-o", "no_such_option"}}, filepath.Join(dir, "s.sock"))
	if err == nil || !strings.Contains(err.Error(), "last words") || !strings.Contains(err.Error(), "no_such_option") {
		t.Fatalf("got %v", err)
	}
}

func TestSharedDirBindsReachRunningDaemon(t *testing.T) {
	d := cDaemon(t)
	sandbox := filepath.Join(t.TempDir(), "sandbox")
	s, err := NewSharedDir(sandbox)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Cleanup()
	p, err := Start(context.Background(), Options{Daemon: d, SharedDir: s.Root, Cache: "auto"}, filepath.Join(sandbox, "fs.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(context.Background())
	rootfs := t.TempDir()
	os.WriteFile(filepath.Join(rootfs, "marker"), []byte("x"), 0o644)
	// The C daemon builds its sandbox (a child in its own mount namespace)
	// once a frontend connects, so play the frontend's part that far.
	conn, err := net.Dial("unix", p.Socket())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	self, _ := os.Readlink("/proc/self/ns/mnt")
	sandboxed := func() []int {
		var out []int
		for _, pid := range processesWithArg("source=" + s.Root) {
			if ns, _ := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "ns", "mnt")); ns != "" && ns != self {
				out = append(out, pid)
			}
		}
		return out
	}
	testenv.Eventually(t, 10*time.Second, func() (bool, error) {
		return len(sandboxed()) > 0, errors.New("virtiofsd built no sandbox after a frontend connected")
	})
	pids := sandboxed()
	guest, err := s.BindRootfs("c1", rootfs, true)
	if err != nil {
		t.Fatal(err)
	}
	if guest != "/run/kata-containers/shared/containers/c1/rootfs" {
		t.Fatalf("guest path %s", guest)
	}
	// The bind made after the daemon sandboxed itself must have propagated
	// into its mount namespace (where the shared dir is its root).
	mi, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pids[0]), "mountinfo"))
	if !strings.Contains(string(mi), "/c1/rootfs ") {
		t.Fatalf("the container bind did not propagate into virtiofsd's mount namespace:\n%s", mi)
	}
	if _, err := s.BindRootfs("../x", rootfs, false); err == nil {
		t.Fatal("hostile container id accepted")
	}
	if err := s.Unbind("c1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "marker")); err != nil {
		t.Fatalf("unbind lost the container's files: %v", err)
	}
	p.Stop(context.Background())
	if err := s.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.Root); !os.IsNotExist(err) {
		t.Fatalf("shared dir left: %v", err)
	}
}

// init keeps the main goroutine on the main thread. Go never ends the
// main thread (a locked goroutine that exits there wedges it instead), so
// a test goroutine that ran on it could not show what ending its thread
// does to the children it forked.
func init() { runtime.LockOSThread() }

// TestDaemonOutlivesItsStarterThread: a daemon started from a goroutine
// locked to a thread that Go then ends keeps serving. It carries a
// parent-death signal, which must follow its owner process, not the
// thread that happened to fork it.
func TestDaemonOutlivesItsStarterThread(t *testing.T) {
	d := cDaemon(t)
	dir := t.TempDir()
	shared := filepath.Join(dir, "shared-thread")
	os.Mkdir(shared, 0o755)
	type started struct {
		p   *Process
		err error
	}
	ch := make(chan started, 1)
	go func() {
		runtime.LockOSThread()
		p, err := Start(context.Background(), Options{Daemon: d, SharedDir: shared, Cache: "auto"}, filepath.Join(dir, "s.sock"))
		ch <- started{p, err}
	}()
	s := <-ch
	if s.err != nil {
		t.Fatal(s.err)
	}
	defer s.p.Stop(context.Background())
	// The starter's goroutine has ended and its thread with it; a daemon
	// tied to that thread would have been SIGKILLed by now.
	select {
	case <-s.p.Done():
		t.Fatalf("virtiofsd died with the thread that started it: %v", s.p.Err())
	case <-time.After(time.Second):
	}
	if len(processesWithArg("source="+shared)) == 0 {
		t.Fatal("virtiofsd not running")
	}
}
