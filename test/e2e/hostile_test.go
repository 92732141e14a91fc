package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// hostCanary is a host directory outside every sandbox that the hostile
// guest points its symlinks at: a file with an owner and mode of its own,
// an empty directory (what a removal would take), and a directory named
// rootfs that is a mount point (what an unmount or a bind would take).
type hostCanary struct{ dir string }

func newHostCanary(t *testing.T) hostCanary {
	t.Helper()
	c := hostCanary{dir: filepath.Join(t.TempDir(), "canary")}
	for _, d := range []string{"empty", "rootfs", "etc"} {
		if err := os.MkdirAll(filepath.Join(c.dir, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	for name, body := range map[string]string{"passwd": "root:x:0:0:host\n", "etc/shadow": "root:!:host\n", "rootfs/marker": "host mount\n"} {
		if err := os.WriteFile(filepath.Join(c.dir, name), []byte(body), 0o640); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(filepath.Join(c.dir, name), 1234, 5678); err != nil {
			t.Fatal(err)
		}
	}
	rootfs := filepath.Join(c.dir, "rootfs")
	if err := unix.Mount(rootfs, rootfs, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(rootfs, unix.MNT_DETACH) })
	return c
}

// snapshot describes the canary: every name with its type, mode, owner,
// size and content digest, and the mount points at or below it.
func (c hostCanary) snapshot(t *testing.T) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(c.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s mode=%o uid=%d gid=%d size=%d", strings.TrimPrefix(p, c.dir), st.Mode, st.Uid, st.Gid, st.Size)
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			sum := sha256.Sum256(b)
			line += " sha256=" + hex.EncodeToString(sum[:8])
		}
		lines = append(lines, line)
		return nil
	})
	if err != nil {
		t.Fatalf("canary: %v", err)
	}
	for _, l := range sharedMounts(os.Getpid(), c.dir) {
		f := strings.Fields(l)
		lines = append(lines, "mount "+f[0]+" "+f[4]+" "+f[5])
	}
	return strings.Join(lines, "\n")
}

// hostMounts lists the host's mount points (with their ids and options)
// outside the temporary directory: what a pod may never add to or take
// from. The temporary directory is left out because the tests of other
// packages, run at the same time, mount and unmount below it; the canary,
// which is there, is checked on its own.
func hostMounts() string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	tmp := filepath.Clean(os.TempDir())
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 5 && f[4] != tmp && !strings.HasPrefix(f[4], tmp+"/") {
			out = append(out, f[0]+" "+f[4]+" "+f[5])
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// hostileLog parses the hostile agent's log: attempts per phase, and the
// attacks on the share's tree that succeeded.
func hostileLog(log string) (attempts map[string]int, breaches []string) {
	attempts = map[string]int{}
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		f := strings.Fields(l)
		if len(f) < 3 {
			continue
		}
		phase, kind := f[0], f[1]
		if phase == "race" {
			attempts["race"]++
			if !strings.HasSuffix(l, ": 0 ok") {
				breaches = append(breaches, l)
			}
			continue
		}
		attempts[phase]++
		if kind == "tree" && strings.HasSuffix(l, ": ok") {
			breaches = append(breaches, l)
		}
	}
	return attempts, breaches
}

// nsDescriptors lists the open descriptors of process pid that are
// namespaces (their links read "<kind>:[inode]"), as "fd -> mnt:[inode]".
func nsDescriptors(pid int) []string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(dir)
	var out []string
	for _, e := range ents {
		l, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		if kind, _, ok := strings.Cut(l, ":["); ok && slices.Contains([]string{"cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"}, kind) {
			out = append(out, e.Name()+" -> "+l)
		}
	}
	return out
}

// guestMissedRootfs reports whether a container create failed only
// because the guest's agent could not find the rootfs the shim shared.
func guestMissedRootfs(stderr, cid string) bool {
	return strings.Contains(stderr, "agent CreateContainer") &&
		strings.Contains(stderr, "rootfs /run/kata-containers/shared/containers/"+cid+"/rootfs is not a directory")
}

// TestHostileGuest boots pods whose guest agent is compromised (the hostile
// mode of test/guest/hostileagent, the agent make guest puts in the kit)
// on both share backends (and on imagefs-blk, whose
// share carries only the volumes): as root in the guest, with
// the share mounted, it plants symlinks to a host canary in place of every
// directory the shim touches, renames and removes them, races the shim
// for the names of a container about to be created, makes device nodes
// and set-user-id files, writes to a read-only volume and fills the share,
// at sandbox creation, container create, exec, delete and pod teardown.
// The host's mount table, the canary (contents, modes, owners, mounts)
// and the volumes must be unchanged, every attack on the share's tree
// refused, and the pod must tear down cleanly.
func TestHostileGuest(t *testing.T) {
	// imagefs-blk: the rootfs is a disk, the share carries the volumes.
	for _, backend := range []string{"virtio-fs", "virtio-9p", "imagefs-blk"} {
		t.Run(backend, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
			defer cancel()
			canary := newHostCanary(t)
			pod, worker := "hostile-pod", "hostile-worker"
			ce := newContainerdEnvFor(t, func() *env {
				return newEnv(t, fmt.Sprintf("enable_annotations = [\"shared_fs\"]\nkernel_params = %q\n", "kata_fsx.hostile="+canary.dir+","+worker))
			})
			ro := filepath.Join(t.TempDir(), "ro")
			if err := os.MkdirAll(ro, 0o755); err != nil {
				t.Fatal(err)
			}
			writeFile(t, filepath.Join(ro, "ro.txt"), "orig\n")
			wantCanary := canary.snapshot(t)
			wantMounts := hostMounts()
			sbDir := filepath.Join(ce.stateDir, pod)

			if r := ce.ctr(ctx, ce.runArgs("-d", "--annotation", "io.katacontainers.config.hypervisor.shared_fs="+backend,
				"--mount", "type=bind,src="+ro+",dst=/vol/ro,options=rbind:ro",
				ce.image, pod, "/bin/sleep", "600")...); r.code != 0 {
				t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if st := ce.waitTaskStatus(ctx, pod, "RUNNING"); st != "RUNNING" {
				t.Fatalf("task %s is %q, want RUNNING", pod, st)
			}
			check := func(when string) {
				t.Helper()
				if got := canary.snapshot(t); got != wantCanary {
					t.Errorf("%s: the host canary changed:\n%s\nwant:\n%s", when, got, wantCanary)
				}
				if got := hostMounts(); got != wantMounts {
					t.Errorf("%s: the host's mount table changed:\n%s\nwant:\n%s", when, got, wantMounts)
				}
				if b, _ := os.ReadFile(filepath.Join(ro, "ro.txt")); string(b) != "orig\n" {
					t.Errorf("%s: the read-only volume's file reads %q", when, b)
				}
				if ents, _ := os.ReadDir(ro); len(ents) != 1 {
					t.Errorf("%s: the guest wrote in the read-only volume: %v", when, ents)
				}
			}
			execN := 0
			sh := func(script string) result {
				execN++
				return ce.ctr(ctx, "tasks", "exec", "--exec-id", fmt.Sprintf("e%d", execN), pod, "/bin/sh", "-c", script)
			}
			check("after create")
			// The shim serves the pod from a mount namespace of its own:
			// the share's binds are there, not in the host's table.
			shimPid := ce.shimPid(t, pod)
			shimMounts := func(dir string) []string { return sharedMounts(shimPid, dir) }
			if len(shimMounts(sbDir)) == 0 {
				t.Fatalf("no mount of the sandbox in the shim's (pid %d) mount namespace", shimPid)
			}
			if m := sharedMounts(os.Getpid(), sbDir); len(m) > 0 {
				t.Errorf("mounts of the sandbox in the host's mount namespace:\n%s", strings.Join(m, "\n"))
			}
			// The processes that face the guest hold no namespace of the
			// host's (the shim keeps one to read volume sources in).
			for _, exe := range []string{"qemu-system", "virtiofsd"} {
				for _, pid := range pidsOf(sbDir, exe) {
					if fds := nsDescriptors(pid); len(fds) > 0 {
						t.Errorf("%s (pid %d) holds namespace descriptors: %v", exe, pid, fds)
					}
				}
			}

			// A container joining the pod: its create and delete are
			// attacked, and the racer has been at its name since boot.
			//
			// On 9p (cache=mmap) the guest's client does not revalidate
			// dentries, so a lookup by the agent that meets a negative
			// dentry the racer holds for the name misses the rootfs the
			// shim bound: the guest denies itself its own container. That
			// is the guest's loss alone, so such a create may fail (and
			// must leave nothing behind on the host) and is tried again;
			// any other failure, or three of them, fails the test.
			for try := 1; ; try++ {
				r := ce.ctr(ctx, ce.runArgs("--rm",
					"--annotation", "io.kubernetes.cri.container-type=container",
					"--annotation", "io.kubernetes.cri.sandbox-id="+pod,
					ce.image, worker, "/bin/sh", "-c", "echo worker")...)
				if r.code == 0 && strings.HasPrefix(r.stdout, "worker\n") {
					break
				}
				if try == 3 || !guestMissedRootfs(r.stderr, worker) {
					t.Fatalf("worker container (try %d): exit %d\n%s%s", try, r.code, r.stdout, r.stderr)
				}
				t.Logf("worker container (try %d): the guest's own lookup missed its rootfs: %s", try, strings.TrimSpace(r.stderr))
				check("after a worker create the guest failed")
				if left := shimMounts(filepath.Join(sbDir, "mounts", worker) + "/"); len(left) > 0 {
					t.Fatalf("a failed worker create left its binds:\n%s", strings.Join(left, "\n"))
				}
				ce.ctr(ctx, "containers", "delete", worker)
			}
			check("after the worker's create and delete")

			log := sh("cat /.hostile")
			if log.code != 0 {
				t.Fatalf("read the hostile log: exit %d %s", log.code, log.stderr)
			}
			attempts, breaches := hostileLog(log.stdout)
			phases := []string{"sandbox", "create", "exec", "delete"}
			if backend == "imagefs-blk" {
				phases = phases[1:] // its volumes share is plugged at the first container
			}
			for _, phase := range phases {
				if attempts[phase] == 0 {
					t.Errorf("no attack at %s: the hostile agent did not run (log:\n%s)", phase, log.stdout)
				}
			}
			if len(breaches) > 0 {
				t.Errorf("attacks on the share's tree that succeeded:\n%s", strings.Join(breaches, "\n"))
			}
			t.Logf("hostile agent: %d attempts by phase %v", strings.Count(log.stdout, "\n"), attempts)

			// The device node and set-user-id file the guest made in its
			// rootfs do nothing through the host's binds.
			// (9p with security_model=none refuses the guest's mknod.)
			// The bind is reached through the shim's root, in its namespace.
			rootfsBind := filepath.Join(fmt.Sprintf("/proc/%d/root", shimPid), sbDir, "mounts", pod, "rootfs")
			made := strings.Contains(log.stdout, "content mknod /run/kata-containers/shared/containers/"+pod+"/rootfs/hostile-null: ok")
			if f, err := os.OpenFile(filepath.Join(rootfsBind, "hostile-null"), os.O_WRONLY, 0); made && !errors.Is(err, unix.EACCES) {
				if f != nil {
					f.Close()
				}
				t.Errorf("the guest's device node opened through the host's bind: %v, want EACCES", err)
			}
			t.Logf("the guest's mknod in its rootfs: made %t", made)
			for _, l := range shimMounts(sbDir) {
				if f := strings.Fields(l); !strings.Contains(f[5], "nosuid") || !strings.Contains(f[5], "nodev") {
					t.Errorf("a mount of the sandbox is not nosuid,nodev: %s", l)
				}
			}

			if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", pod); r.code != 0 {
				t.Fatalf("ctr task kill: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			ce.waitTaskStatus(ctx, pod, "STOPPED")
			if r := ce.ctr(ctx, "tasks", "delete", pod); r.code != 0 && !strings.Contains(r.stderr, "exit code") {
				t.Fatalf("ctr task delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			if r := ce.ctr(ctx, "containers", "delete", pod); r.code != 0 {
				t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
			}
			assertPodGone(ctx, t, sbDir)
			check("after teardown")
		})
	}
}

// TestPrivilegedContainerSeesShareReadOnly: a container with every
// capability (kata-fsx run's) mounts the virtio-fs share itself and finds
// the tree the shim mounts in read-only, and its own rootfs still
// writable through it.
func TestPrivilegedContainerSeesShareReadOnly(t *testing.T) {
	e := newEnv(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rootfs := busyboxRootfs(t)
	script := `/bin/busybox mount -t virtiofs kataShared /tmp || exit 9
for op in "touch /tmp/x" "mkdir /tmp/d" "ln -s / /tmp/l" "mv /tmp/$(ls /tmp | head -1) /tmp/moved" "touch /tmp/$(ls /tmp | head -1)/x"; do
  /bin/busybox sh -c "$op" 2>&1 && echo "$op: ok"
done
echo rootfs > /tmp/$(ls /tmp | head -1)/rootfs/written && echo rootfs-write: ok`
	r := e.run(ctx, "run", "--backend", "virtio-fs", "--rootfs", "dir:"+rootfs, "--", "/bin/sh", "-c", script)
	if r.code != 0 {
		t.Fatalf("run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if strings.Count(r.stdout, "Read-only file system") != 5 || strings.Contains(strings.ReplaceAll(r.stdout, "rootfs-write: ok", ""), ": ok") {
		t.Errorf("writes to the share's tree, want 5 EROFS refusals:\n%s", r.stdout)
	}
	if !strings.Contains(r.stdout, "rootfs-write: ok") {
		t.Errorf("the container's own rootfs was not writable through the share:\n%s", r.stdout)
	}
	if b, err := os.ReadFile(filepath.Join(rootfs, "written")); err != nil || string(b) != "rootfs\n" {
		t.Errorf("the rootfs write did not reach the host: %q, %v", b, err)
	}
}
