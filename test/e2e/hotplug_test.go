package e2e

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// hotplugRootDevice returns the device and fstype of "/" in /proc/mounts output.
func hotplugRootDevice(mounts string) (dev, fstype string) {
	for _, l := range strings.Split(mounts, "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[1] == "/" {
			return f[0], f[2]
		}
	}
	return "", ""
}

// hotplugDirNames lists a directory's entries, sorted; a missing directory is empty.
func hotplugDirNames(dir string) []string {
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

// hotplugJoinArgs is `ctr run` for a container joining pod the way CRI starts
// workloads (container-type and sandbox-id annotations).
func (ce *containerdEnv) hotplugJoinArgs(pod string, extra ...string) []string {
	return ce.runArgs(append([]string{
		"--annotation", "io.kubernetes.cri.container-type=container",
		"--annotation", "io.kubernetes.cri.sandbox-id=" + pod,
	}, extra...)...)
}

var hotplugVirtioDisk = regexp.MustCompile(`^/dev/vd[a-z]+$`)

// hotplugGuestDisks lists the virtio disks the pod's guest kernel has, seen from
// inside the pod's first container.
func (ce *containerdEnv) hotplugGuestDisks(ctx context.Context, t *testing.T, pod, execID string) []string {
	t.Helper()
	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", execID, pod, "/bin/ls", "/sys/block")
	if r.code != 0 {
		t.Fatalf("ls /sys/block in %s: exit %d %s", pod, r.code, r.stderr)
	}
	var disks []string
	for _, n := range strings.Fields(r.stdout) {
		if strings.HasPrefix(n, "vd") {
			disks = append(disks, n)
		}
	}
	return disks
}

// TestShimContainerdHotplugBlk: on an imagefs-blk pod, a container created
// after the VM booted gets its own disk hot-plugged over QMP; deleting it
// unplugs the disk and removes its files while the pod keeps running, and
// the slot serves the next container.
func TestShimContainerdHotplugBlk(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	const pod, worker = "hppod", "hpworker"
	ce.startLongRunning(ctx, t, pod, "imagefs-blk")
	sandboxDir := filepath.Join(ce.stateDir, pod)
	blkDir := filepath.Join(sandboxDir, "blk")
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != pod {
		t.Fatalf("disks of the booted pod: %v, want [%s]", got, pod)
	}
	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "m0", pod, "/bin/cat", "/proc/mounts")
	podDev, podFS := hotplugRootDevice(r.stdout)
	if r.code != 0 || podFS != "ext4" || !hotplugVirtioDisk.MatchString(podDev) {
		t.Fatalf("pod root: %q on %q (exit %d)\n%s%s", podFS, podDev, r.code, r.stdout, r.stderr)
	}
	disksBefore := ce.hotplugGuestDisks(ctx, t, pod, "d0")
	qemuBefore := pidsOf(ce.dir, "qemu-system")

	// The worker runs in the pod's VM on a disk of its own.
	if r := ce.ctr(ctx, ce.hotplugJoinArgs(pod, "-d", ce.image, worker, "/bin/sleep", "600")...); r.code != 0 {
		t.Fatalf("ctr run -d %s: exit %d\n%s%s", worker, r.code, r.stdout, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, worker, "RUNNING"); st != "RUNNING" {
		t.Fatalf("task %s is %q, want RUNNING", worker, st)
	}
	r = ce.ctr(ctx, "tasks", "exec", "--exec-id", "m1", worker, "/bin/sh", "-c", "cat /proc/mounts; echo hi > /written; cat /written")
	wDev, wFS := hotplugRootDevice(r.stdout)
	if r.code != 0 || wFS != "ext4" || !hotplugVirtioDisk.MatchString(wDev) || wDev == podDev || !strings.HasSuffix(r.stdout, "hi\n") {
		t.Fatalf("worker root: %q on %q (pod's is %s), exit %d\n%s%s", wFS, wDev, podDev, r.code, r.stdout, r.stderr)
	}
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != strings.Join([]string{pod, worker}, " ") {
		t.Errorf("disks with the worker running: %v, want [%s %s]", got, pod, worker)
	}
	disksWith := ce.hotplugGuestDisks(ctx, t, pod, "d1")
	t.Logf("pod root on %s, worker root on %s; guest disks %v, then %v", podDev, wDev, disksBefore, disksWith)
	if len(disksWith) != len(disksBefore)+1 {
		t.Errorf("guest disks: %v before the worker, %v with it", disksBefore, disksWith)
	}
	if !strings.Contains(ce.logTail(1<<22), "container "+worker+": disk imagefs-blk-1 hot-plugged at PCI path 02/01") {
		t.Errorf("the shim did not log the worker's hot-plug at 02/01")
	}
	if q := pidsOf(ce.dir, "qemu-system"); len(q) != 1 || len(qemuBefore) != 1 || q[0] != qemuBefore[0] {
		t.Errorf("QEMU before %v, after %v: the worker must join the pod's VM", qemuBefore, q)
	}

	// Deleting the worker unplugs its disk and deletes its files.
	if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", worker); r.code != 0 {
		t.Fatalf("kill %s: %s", worker, r.stderr)
	}
	ce.waitTaskStatus(ctx, worker, "STOPPED")
	if r := ce.ctr(ctx, "tasks", "delete", worker); r.code != 0 && !strings.Contains(r.stderr, "exit code") {
		t.Fatalf("delete %s: %d %s", worker, r.code, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", worker); r.code != 0 {
		t.Fatalf("container delete %s: %s", worker, r.stderr)
	}
	if !strings.Contains(ce.logTail(1<<22), "container "+worker+": disk imagefs-blk-1 unplugged and removed") {
		t.Fatalf("the shim did not unplug the worker's disk:\n%s", ce.logTail(6000))
	}
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != pod {
		t.Errorf("disks after the worker's delete: %v, want [%s]", got, pod)
	}
	for _, n := range hotplugDirNames(sandboxDir) {
		if strings.HasPrefix(n, "blk") && strings.HasSuffix(n, ".sock") && n != "blk0.sock" {
			t.Errorf("socket of the worker's disk left: %s", n)
		}
	}
	// The guest saw the disk go: QEMU deleted the device.
	if after := ce.hotplugGuestDisks(ctx, t, pod, "d2"); strings.Join(after, " ") != strings.Join(disksBefore, " ") {
		t.Errorf("guest disks after the unplug: %v, want %v", after, disksBefore)
	}
	if st := ce.waitTaskStatus(ctx, pod, "RUNNING"); st != "RUNNING" {
		t.Fatalf("pod task is %q after the worker left", st)
	}

	// The freed slot takes the next container, which sees a fresh disk.
	r = ce.ctr(ctx, ce.hotplugJoinArgs(pod, "--rm", ce.image, "hpnext", "/bin/sh", "-c", `grep " / " /proc/mounts; ls /written 2>&1; true`)...)
	if dev, fs := hotplugRootDevice(r.stdout); r.code != 0 || fs != "ext4" || !hotplugVirtioDisk.MatchString(dev) || dev == podDev {
		t.Fatalf("next container: exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	if strings.Contains(r.stdout, "\n/written\n") {
		t.Errorf("the next container sees the worker's writes:\n%s", r.stdout)
	}
	if !strings.Contains(ce.logTail(1<<22), "container hpnext: disk imagefs-blk-2 hot-plugged at PCI path 02/01") {
		t.Errorf("the next container did not reuse the freed slot 02/01")
	}
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != pod {
		t.Errorf("disks after the --rm container: %v, want [%s]", got, pod)
	}

	if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", pod); r.code != 0 {
		t.Fatalf("kill: %s", r.stderr)
	}
	ce.waitTaskStatus(ctx, pod, "STOPPED")
	if r := ce.ctr(ctx, "tasks", "delete", pod); r.code != 0 && !strings.Contains(r.stderr, "exit code") {
		t.Fatalf("delete: %d %s", r.code, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", pod); r.code != 0 {
		t.Fatalf("container delete: %s", r.stderr)
	}
	// The shim exits once containerd shut it down after the pod's last task.
	if left := lingering(ctx, ce.sock); len(left) > 0 {
		t.Errorf("shim still running after the pod's delete: %v", left)
	}
	if _, err := os.Stat(sandboxDir); !os.IsNotExist(err) {
		t.Errorf("sandbox directory %s survived the pod (%v)", sandboxDir, err)
	}
}

// TestSandboxHotplugRollback drives the shim's sandbox directly: a
// container the agent refuses after its disk was hot-plugged must leave no
// disk, socket, guest device or bridge slot behind, nor may one whose disk
// fails to build, so the next container gets the same slot.
func TestSandboxHotplugRollback(t *testing.T) {
	e := newEnv(t, "")
	rootfsDir := busyboxRootfs(t)
	cfg, err := config.LoadFile(e.config)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const id = "hprollback"
	rootfs := config.RootfsFromMounts(nil, rootfsDir)
	sb, err := sandbox.New(ctx, sandbox.Spec{ID: id, Config: cfg, Backend: config.SharedFSImagefsBlk, Rootfs: rootfs, Hostname: id})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := sb.Stop(context.Background()); err != nil {
			t.Errorf("stop: %v", err)
		}
	}()
	spec := func(args ...string) *specs.Spec {
		return &specs.Spec{Version: specs.Version, Root: &specs.Root{Path: "rootfs"},
			Process: &specs.Process{Args: args, Cwd: "/", Env: []string{"PATH=/bin"}}}
	}
	if err := sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: id, Rootfs: rootfs, OCI: spec("/bin/sleep", "600")}); err != nil {
		t.Fatal(err)
	}
	blkDir := filepath.Join(sb.Dir, "blk")
	sockets := func() []string {
		var out []string
		for _, n := range hotplugDirNames(sb.Dir) {
			if strings.HasSuffix(n, ".sock") && strings.HasPrefix(n, "blk") {
				out = append(out, n)
			}
		}
		return out
	}

	// The agent refuses a terminal larger than a winsize holds (the
	// shim refuses it earlier; the sandbox passes it on), after the disk is plugged.
	bad := spec("/bin/true")
	bad.Process.Terminal = true
	bad.Process.ConsoleSize = &specs.Box{Height: 1 << 16, Width: 80}
	err = sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: "bad", Rootfs: rootfs, OCI: bad})
	if err == nil || !strings.Contains(err.Error(), "agent CreateContainer") || !strings.Contains(err.Error(), "65536x80") {
		t.Fatalf("container the agent refuses: err = %v", err)
	}
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != id {
		t.Errorf("disks after the refused container: %v, want [%s]", got, id)
	}
	if got := sockets(); strings.Join(got, " ") != "blk0.sock" {
		t.Errorf("disk sockets after the refused container: %v, want [blk0.sock]", got)
	}

	// An unindexable rootfs fails before anything is plugged.
	err = sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: "odd", Rootfs: config.Rootfs{Kind: config.RootfsOther, Why: "test"}, OCI: spec("/bin/true")})
	if err == nil || !strings.Contains(err.Error(), "cannot index") {
		t.Fatalf("unindexable rootfs: err = %v", err)
	}

	// A rootfs whose build fails leaves no partial disk (nor its slot taken).
	err = sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: "missing", Rootfs: config.Rootfs{Kind: config.RootfsDir, Layers: []string{filepath.Join(e.dir, "no-such-layer")}}, OCI: spec("/bin/true")})
	if err == nil {
		t.Fatal("container with a missing rootfs layer was created")
	}
	t.Logf("missing layer: %v", err)
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != id {
		t.Errorf("disks after the failed build: %v, want [%s]", got, id)
	}
	if got := sockets(); strings.Join(got, " ") != "blk0.sock" {
		t.Errorf("disk sockets after the failed build: %v, want [blk0.sock]", got)
	}

	// The next container sits in the slot the refused one had (01 behind
	// the bridge in slot 02) and the guest sees exactly two disks.
	const good = "good"
	script := `ls /sys/block; grep " / " /proc/mounts; set -- $(grep " / " /proc/mounts); busybox readlink -f /sys/block/${1#/dev/}`
	if err := sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: good, Rootfs: rootfs, OCI: spec("/bin/sh", "-c", script)}); err != nil {
		t.Fatal(err)
	}
	g := sb.Guest()
	if err := g.StartContainer(ctx, good); err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(g.Output(ctx, good, good, false))
	if st, err := g.Wait(ctx, good, good); err != nil || st != 0 {
		t.Fatalf("good container: status %d %v\n%s", st, err, out)
	}
	t.Logf("good container:\n%s", out)
	var disks []string
	for _, f := range strings.Fields(string(out)) {
		if strings.HasPrefix(f, "vd") {
			disks = append(disks, f)
		}
	}
	if strings.Join(disks, " ") != "vda vdb" {
		t.Errorf("guest disks %v, want [vda vdb]: the refused container's device was not unplugged", disks)
	}
	if !regexp.MustCompile(`/0000:00:02\.0/0000:[0-9a-f]{2}:01\.0/`).Match(out) {
		t.Errorf("the root disk is not in slot 01 behind the bridge: the refused container's slot was not released\n%s", out)
	}
	if dev, fs := hotplugRootDevice(string(out)); dev != "/dev/vdb" || fs != "ext4" {
		t.Errorf("good container root: %s on %s", fs, dev)
	}
	if err := sb.RemoveContainer(ctx, good, 10*time.Second); err != nil {
		t.Fatalf("remove: %v", err)
	}
	if got := hotplugDirNames(blkDir); strings.Join(got, " ") != id {
		t.Errorf("disks after removing %s: %v, want [%s]", good, got, id)
	}
	if got := sockets(); strings.Join(got, " ") != "blk0.sock" {
		t.Errorf("disk sockets after removing %s: %v", good, got)
	}
}
