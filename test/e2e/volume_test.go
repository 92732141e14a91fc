package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// volumeDirs are the host side of the volumes a test container gets.
type volumeDirs struct {
	rw, ro, file, memEmptyDir string
	// tree has a tmpfs mounted at tree/sub; it is bound ro and rro.
	tree string
}

func newVolumeDirs(t *testing.T) volumeDirs {
	t.Helper()
	base := t.TempDir()
	v := volumeDirs{
		rw:   filepath.Join(base, "rw"),
		ro:   filepath.Join(base, "ro"),
		file: filepath.Join(base, "single.conf"),
		// Kubelet's layout of an emptyDir, which Kata recognises.
		memEmptyDir: filepath.Join(base, "pod", "volumes", "kubernetes.io~empty-dir", "cache"),
		tree:        filepath.Join(base, "tree"),
	}
	for _, d := range []string{v.rw, v.ro, v.memEmptyDir, filepath.Join(v.tree, "sub")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(v.rw, "fromhost"), "h1\n")
	writeFile(t, filepath.Join(v.ro, "ro.txt"), "orig\n")
	writeFile(t, v.file, "single-v1\n")
	// medium: Memory: kubelet mounts a tmpfs on the emptyDir.
	if err := unix.Mount("tmpfs", v.memEmptyDir, "tmpfs", 0, "size=4m"); err != nil {
		t.Fatalf("tmpfs for the emptyDir: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(v.memEmptyDir, unix.MNT_DETACH) })
	if err := unix.Mount("tmpfs", filepath.Join(v.tree, "sub"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("tmpfs below the tree volume: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(v.tree, "sub"), unix.MNT_DETACH) })
	// The pod's fsGroup owns the emptyDir; Kata hands it to the guest.
	if err := os.Chown(v.memEmptyDir, 0, 2000); err != nil {
		t.Fatal(err)
	}
	return v
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	// In place (no rename): a bind of a single file follows its inode.
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// mountArgs are ctr's --mount flags for the volumes.
func (v volumeDirs) mountArgs() []string {
	return []string{
		"--mount", "type=bind,src=" + v.rw + ",dst=/vol/rw,options=rbind:rw",
		"--mount", "type=bind,src=" + v.ro + ",dst=/vol/ro,options=rbind:ro",
		"--mount", "type=bind,src=" + v.file + ",dst=/etc/single.conf,options=rbind:rw",
		"--mount", "type=bind,src=" + v.memEmptyDir + ",dst=/vol/mem,options=rbind:rw",
		"--mount", "type=bind,src=" + v.tree + ",dst=/vol/tree,options=rbind:ro",
		"--mount", "type=bind,src=" + v.tree + ",dst=/vol/rtree,options=rbind:rro",
	}
}

// sharedMounts lists the mount table lines of process pid's mount
// namespace whose mount point is below dir: the test's own pid for the
// host's, a shim's for the pod's binds.
func sharedMounts(pid int, dir string) []string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 5 && strings.HasPrefix(f[4], dir) {
			out = append(out, l)
		}
	}
	return out
}

// mountLineFor finds the mount table line whose mount point ends in suffix
// and returns its per-mount options (field 6).
func mountLineFor(lines []string, suffix string) (string, string) {
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 5 && strings.HasSuffix(f[4], suffix) {
			return l, f[5]
		}
	}
	return "", ""
}

// TestVolumes runs a container with host binds through containerd on both
// backends: a rw directory both ways, a ro one that refuses writes (in the
// guest and on the host side of the share), ro and rro binds of a tree with
// a mount below it, a single file changed on the host, an emptyDir of medium Memory as a guest tmpfs; after the pod, no
// mount of its shared directory and no virtiofsd is left.
func TestVolumes(t *testing.T) {
	ce := newContainerdEnv(t)
	for _, backend := range []string{"virtio-fs", "imagefs-blk"} {
		t.Run(backend, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
			defer cancel()
			v := newVolumeDirs(t)
			id := "vol-" + strings.ReplaceAll(backend, "-", "")
			sbDir := filepath.Join(ce.stateDir, id)
			shared := filepath.Join(sbDir, "shared")
			args := append([]string{"-d", "--annotation", "io.katacontainers.config.hypervisor.shared_fs=" + backend}, v.mountArgs()...)
			if r := ce.ctr(ctx, ce.runArgs(append(args, ce.image, id, "/bin/sleep", "600")...)...); r.code != 0 {
				t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
				t.Fatalf("task %s is %q, want RUNNING", id, st)
			}
			execN := 0
			sh := func(script string) result {
				execN++
				return ce.ctr(ctx, "tasks", "exec", "--exec-id", fmt.Sprintf("e%d", execN), id, "/bin/sh", "-c", script)
			}

			// rw: host to guest and guest to host.
			if r := sh("cat /vol/rw/fromhost && echo g1 > /vol/rw/fromguest"); r.code != 0 || r.stdout != "h1\n" {
				t.Fatalf("rw volume in the guest: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
			}
			if b, err := os.ReadFile(filepath.Join(v.rw, "fromguest")); err != nil || string(b) != "g1\n" {
				t.Errorf("the guest's write is not on the host: %q, %v", b, err)
			}
			// A file changed on the host is seen in the guest.
			writeFile(t, filepath.Join(v.rw, "fromhost"), "h2\n")
			if got := pollGuest(ctx, sh, "cat /vol/rw/fromhost", "h2\n"); got != "h2\n" {
				t.Errorf("host change of a rw volume's file not seen in the guest: %q", got)
			}

			// ro: writes are refused with EROFS, the host is unchanged.
			r := sh("cat /vol/ro/ro.txt; echo x > /vol/ro/ro.txt; echo rc=$?; touch /vol/ro/new; echo rc=$?")
			if !strings.HasPrefix(r.stdout, "orig\n") || strings.Count(r.stdout, "rc=") != 2 || strings.Contains(r.stdout, "rc=0") || strings.Count(r.stderr, "Read-only file system") != 2 {
				t.Errorf("ro volume: exit %d stdout %q stderr %q, want two EROFS refusals", r.code, r.stdout, r.stderr)
			}
			if b, _ := os.ReadFile(filepath.Join(v.ro, "ro.txt")); string(b) != "orig\n" {
				t.Errorf("ro volume's file changed on the host: %q", b)
			}
			if _, err := os.Stat(filepath.Join(v.ro, "new")); err == nil {
				t.Errorf("the guest created a file in a ro volume")
			}
			// Read-only on the host side too: the bind in the shared
			// directory (in the shim's mount namespace, and not in the
			// host's), and its copy in virtiofsd's mount namespace.
			shimPid := ce.shimPid(t, id)
			if _, opts := mountLineFor(sharedMounts(shimPid, shared), "-ro"); !strings.HasPrefix(opts, "ro") {
				t.Errorf("the ro volume's bind in %s is %q, want ro:\n%s", shared, opts, strings.Join(sharedMounts(shimPid, shared), "\n"))
			}
			if l, _ := mountLineFor(sharedMounts(os.Getpid(), shared), "-ro"); l != "" {
				t.Errorf("the ro volume's bind is in the host's mount namespace: %s", l)
			}
			vfsd := pidsOf(sbDir, "virtiofsd")
			if len(vfsd) == 0 {
				t.Fatalf("no virtiofsd serves the %s pod's volumes", backend)
			}
			seen := false
			for _, pid := range vfsd {
				if l, opts := mountLineFor(sharedMounts(pid, "/"), "-ro"); l != "" {
					seen = true
					if !strings.HasPrefix(opts, "ro") {
						t.Errorf("in virtiofsd's (pid %d) mount namespace the ro volume is %q (%s), want ro", pid, opts, l)
					}
				}
			}
			if !seen {
				t.Errorf("the ro volume is not in the mount namespace of virtiofsd %v", vfsd)
			}

			// ro on an rbind closes its top, not the mount below it (as
			// runc leaves it); rro closes both.
			r = sh("touch /vol/tree/top; echo rc=$?; touch /vol/tree/sub/fromguest; echo rc=$?; touch /vol/rtree/sub/rro; echo rc=$?")
			if r.stdout != "rc=1\nrc=0\nrc=1\n" || strings.Count(r.stderr, "Read-only file system") != 2 {
				t.Errorf("ro and rro volumes over a mount: stdout %q stderr %q, want the top and the rro mount refused (EROFS), the ro volume's mount below writable", r.stdout, r.stderr)
			}
			if _, err := os.Stat(filepath.Join(v.tree, "sub", "fromguest")); err != nil {
				t.Errorf("the write below the ro volume's top is not on the host: %v", err)
			}
			for _, f := range []string{filepath.Join(v.tree, "top"), filepath.Join(v.tree, "sub", "rro")} {
				if _, err := os.Stat(f); err == nil {
					t.Errorf("the guest created %s through a read-only volume", f)
				}
			}

			// The host takes its mounts back from under the running pod,
			// as critest does with a volume's tmpfs: the share's binds
			// live in the shim's mount namespace and do not pin the
			// host's directories, which a bind in the host's namespace
			// would (unlinkat: device or resource busy).
			if err := unix.Unmount(filepath.Join(v.tree, "sub"), 0); err != nil {
				t.Errorf("unmount the tree volume's tmpfs while the pod runs: %v", err)
			}
			if err := os.RemoveAll(v.tree); err != nil {
				t.Errorf("remove the tree volume's directory while the pod runs: %v", err)
			}

			// A single file, changed on the host.
			if r := sh("cat /etc/single.conf"); r.code != 0 || r.stdout != "single-v1\n" {
				t.Errorf("single-file volume: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
			}
			writeFile(t, v.file, "single-v2\n")
			if got := pollGuest(ctx, sh, "cat /etc/single.conf", "single-v2\n"); got != "single-v2\n" {
				t.Errorf("host change of a single-file volume not seen in the guest: %q", got)
			}

			// emptyDir of medium Memory: a tmpfs of the guest's own.
			if r := sh("grep ' /vol/mem ' /proc/mounts && stat -c gid=%g /vol/mem && echo m > /vol/mem/inguest && cat /vol/mem/inguest"); r.code != 0 || !strings.Contains(r.stdout, " tmpfs ") || !strings.Contains(r.stdout, "gid=2000\n") || !strings.HasSuffix(r.stdout, "m\n") {
				t.Errorf("memory emptyDir: exit %d stdout %q stderr %q, want a guest tmpfs owned by group 2000", r.code, r.stdout, r.stderr)
			}
			if _, err := os.Stat(filepath.Join(v.memEmptyDir, "inguest")); err == nil {
				t.Errorf("the memory emptyDir was shared from the host, not a guest tmpfs")
			}

			if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id); r.code != 0 {
				t.Fatalf("ctr task kill: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			ce.waitTaskStatus(ctx, id, "STOPPED")
			if r := ce.ctr(ctx, "tasks", "delete", id); r.code != 0 {
				t.Fatalf("ctr task delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
				t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			assertPodGone(ctx, t, sbDir)
			for _, f := range []string{filepath.Join(v.rw, "fromguest"), filepath.Join(v.ro, "ro.txt"), v.file} {
				if _, err := os.Stat(f); err != nil {
					t.Errorf("a volume's file is gone after the pod: %v", err)
				}
			}
		})
	}
}

// pollGuest runs script in the guest until it prints want (a host change
// reaches the guest once virtio-fs's cache times out) and returns the
// last output.
func pollGuest(ctx context.Context, sh func(string) result, script, want string) string {
	var got string
	for i := 0; i < 20 && ctx.Err() == nil; i++ {
		if got = sh(script).stdout; got == want {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	return got
}

// assertPodGone waits for the pod's shim to finish its teardown and checks
// that no mount below the sandbox directory and no virtiofsd of it is left.
func assertPodGone(ctx context.Context, t *testing.T, sbDir string) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for wctx.Err() == nil && (len(sharedMounts(os.Getpid(), sbDir)) > 0 || len(pidsOf(sbDir, "virtiofsd")) > 0) {
		time.Sleep(100 * time.Millisecond)
	}
	if m := sharedMounts(os.Getpid(), sbDir); len(m) > 0 {
		t.Errorf("mounts of the pod left behind:\n%s", strings.Join(m, "\n"))
	}
	if p := pidsOf(sbDir, "virtiofsd"); len(p) > 0 {
		t.Errorf("virtiofsd of the pod still running: %v", p)
	}
	if _, err := os.Stat(sbDir); err == nil {
		t.Errorf("sandbox directory %s left behind", sbDir)
	}
}

// TestVolumesRefused: a mount that cannot be honoured fails the container
// with an error naming the mount and why, and leaves nothing behind.
func TestVolumesRefused(t *testing.T) {
	ce := newContainerdEnv(t)
	dev := filepath.Join(t.TempDir(), "null")
	if err := unix.Mknod(dev, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatalf("mknod: %v", err)
	}
	for _, c := range []struct {
		name, backend, mount string
		want                 []string
	}{
		{"missing-source", "virtio-fs", "type=bind,src=/nonexistent/kata-fsx-vol,dst=/data,options=rbind:rw", []string{"mount /data", "/nonexistent/kata-fsx-vol", "no such file or directory"}},
		{"device-node", "imagefs-blk", "type=bind,src=" + dev + ",dst=/dev/mynull,options=rbind:rw", []string{"mount /dev/mynull", dev, "character device"}},
		{"unknown-type", "virtio-fs", "type=nosuchfs,src=none,dst=/data,options=rw", []string{"mount /data", `type "nosuchfs" cannot be mounted`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			id := "bad-" + c.name
			r := ce.ctr(ctx, ce.runArgs("--rm", "--annotation", "io.katacontainers.config.hypervisor.shared_fs="+c.backend,
				"--mount", c.mount, ce.image, id, "/bin/true")...)
			if r.code == 0 {
				t.Fatalf("a container with %s ran", c.mount)
			}
			t.Logf("refused as wanted: %s", strings.TrimSpace(r.stderr))
			for _, w := range c.want {
				if !strings.Contains(r.stderr, w) {
					t.Errorf("error does not say %q:\n%s", w, r.stderr)
				}
			}
			ce.ctr(ctx, "containers", "delete", id)
			assertPodGone(ctx, t, filepath.Join(ce.stateDir, id))
		})
	}
}

// TestVolumesNoneNoVirtiofsd: an imagefs-blk pod without volumes runs no
// virtiofsd at all.
func TestVolumesNoneNoVirtiofsd(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const id = "novol"
	ce.startLongRunning(ctx, t, id, "imagefs-blk")
	sbDir := filepath.Join(ce.stateDir, id)
	if p := pidsOf(sbDir, "virtiofsd"); len(p) > 0 {
		t.Errorf("an imagefs-blk pod without volumes runs virtiofsd: %v", p)
	}
	if _, err := os.Stat(filepath.Join(sbDir, "shared")); err == nil {
		t.Errorf("an imagefs-blk pod without volumes has a shared directory")
	}
	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
	ce.waitTaskStatus(ctx, id, "STOPPED")
	ce.ctr(ctx, "tasks", "delete", id)
	ce.ctr(ctx, "containers", "delete", id)
	assertPodGone(ctx, t, sbDir)
}

// TestVolumesPodJoin: containers joining a running imagefs-blk pod the way
// CRI adds them. The pod starts without volumes and without virtiofsd;
// the first container with volumes starts it and hot-plugs its device;
// the containers share a memory emptyDir; a container's binds leave the
// shared directory with it, and the next container still gets its volumes.
func TestVolumesPodJoin(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const pod = "volpod"
	ce.startLongRunning(ctx, t, pod, "imagefs-blk")
	sbDir := filepath.Join(ce.stateDir, pod)
	shared := filepath.Join(sbDir, "shared")
	if p := pidsOf(sbDir, "virtiofsd"); len(p) > 0 {
		t.Fatalf("virtiofsd %v runs before any container has volumes", p)
	}
	v := newVolumeDirs(t)
	join := func(extra ...string) []string {
		return ce.runArgs(append([]string{
			"--annotation", "io.kubernetes.cri.container-type=container",
			"--annotation", "io.kubernetes.cri.sandbox-id=" + pod,
			"--mount", "type=bind,src=" + v.rw + ",dst=/vol/rw,options=rbind:rw",
			"--mount", "type=bind,src=" + v.memEmptyDir + ",dst=/vol/mem,options=rbind:rw",
		}, extra...)...)
	}
	if r := ce.ctr(ctx, join("-d", ce.image, "worker1", "/bin/sh", "-c", "echo w1 > /vol/mem/w1; exec sleep 600")...); r.code != 0 {
		t.Fatalf("worker1: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, "worker1", "RUNNING"); st != "RUNNING" {
		t.Fatalf("worker1 is %q", st)
	}
	if p := pidsOf(sbDir, "virtiofsd"); len(p) == 0 {
		t.Fatalf("no virtiofsd after the first container with volumes joined")
	}
	if !strings.Contains(ce.logTail(1<<22), "vhost-user-fs-vol hot-plugged") {
		t.Errorf("the volumes' device was not hot-plugged")
	}
	r := ce.ctr(ctx, join("--rm", ce.image, "worker2", "/bin/sh", "-c", "cat /vol/rw/fromhost; for i in 1 2 3 4 5 6 7 8 9 10; do test -e /vol/mem/w1 && break; sleep 1; done; cat /vol/mem/w1")...)
	if r.code != 0 || r.stdout != "h1\nw1\n" {
		t.Errorf("worker2 (want the rw volume and worker1's emptyDir file): exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", "worker1")
	ce.waitTaskStatus(ctx, "worker1", "STOPPED")
	ce.ctr(ctx, "tasks", "delete", "worker1")
	if r := ce.ctr(ctx, "containers", "delete", "worker1"); r.code != 0 {
		t.Fatalf("delete worker1: %s", r.stderr)
	}
	for _, l := range sharedMounts(ce.shimPid(t, pod), shared) {
		if strings.Contains(l, "/worker1-") || strings.Contains(l, "/worker2-") {
			t.Errorf("a removed container's volume is still bound: %s", l)
		}
	}
	// The share was released with its last user; the next one mounts it again.
	r = ce.ctr(ctx, join("--rm", ce.image, "worker3", "/bin/sh", "-c", "cat /vol/rw/fromhost && echo w3 > /vol/rw/w3")...)
	if r.code != 0 || r.stdout != "h1\n" {
		t.Errorf("worker3: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	if b, err := os.ReadFile(filepath.Join(v.rw, "w3")); err != nil || string(b) != "w3\n" {
		t.Errorf("worker3's write is not on the host: %q %v", b, err)
	}
	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", pod)
	ce.waitTaskStatus(ctx, pod, "STOPPED")
	ce.ctr(ctx, "tasks", "delete", pod)
	if r := ce.ctr(ctx, "containers", "delete", pod); r.code != 0 {
		t.Fatalf("container delete: %s", r.stderr)
	}
	assertPodGone(ctx, t, sbDir)
}
