package mount

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// A mount made in another namespace after this process parted from it is
// what that namespace's Clone copies; the caller's own Clone does not see
// it. This is the shim's case turned round: a host mount made after the
// shim entered its own namespace.
func TestNamespaceClone(t *testing.T) {
	testenv.Root(t, "mount namespaces")
	testenv.Tool(t, "unshare", "util-linux")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "below"), []byte("the directory's own file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	other := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		fmt.Sprintf("mount -t tmpfs namespace-test %s && echo >%s/made ready && echo ready && exec sleep 60", dir, dir))
	out, err := other.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	other.Stderr = os.Stderr
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Process.Kill(); other.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("the other namespace's tmpfs: %q, %v", line, err)
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", other.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	ns, err := NamespaceOf(f)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	own, err := OwnNamespace()
	if err != nil {
		t.Fatal(err)
	}
	if ns.Inode() == own {
		t.Fatalf("the other namespace has this process's inode %d", own)
	}

	fsType := func(src *Source) int64 {
		t.Helper()
		var st unix.Statfs_t
		if err := unix.Fstatfs(src.fd, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Type)
	}
	there, err := ns.Clone(dir, true)
	if err != nil {
		t.Fatal(err)
	}
	defer there.Close()
	if got := fsType(there); got != unix.TMPFS_MAGIC {
		t.Errorf("the other namespace's clone of %s is filesystem %#x, want its tmpfs", dir, got)
	}
	var none *Namespace
	here, err := none.Clone(dir, true)
	if err != nil {
		t.Fatal(err)
	}
	defer here.Close()
	if got := fsType(here); got == unix.TMPFS_MAGIC {
		t.Errorf("the caller's own clone of %s is the other namespace's tmpfs", dir)
	}
	// Cloning on a thread that joined the other namespace left the
	// process where it was.
	if now, _ := OwnNamespace(); now != own {
		t.Errorf("this process's namespace moved from %d to %d", own, now)
	}
	if _, err := os.Stat(filepath.Join(dir, "made")); err == nil {
		t.Errorf("this process sees the other namespace's tmpfs at %s", dir)
	}
}

// NamespaceOf takes only a mount namespace's file.
func TestNamespaceOfRefusesOthers(t *testing.T) {
	for _, p := range []string{"/proc/self/ns/net", "/proc/self/status"} {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		if ns, err := NamespaceOf(f); err == nil {
			ns.Close()
			t.Errorf("NamespaceOf(%s) took it", p)
		} else {
			t.Logf("%s: %v", p, err)
		}
		f.Close()
	}
}
