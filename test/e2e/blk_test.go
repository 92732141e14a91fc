package e2e

import (
	"bufio"
	"context"
	"crypto/md5"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestRunImagefsBlkWorkload(t *testing.T) {
	e := newEnv(t, "")
	rootfs := busyboxRootfs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	script := `set -e
grep ' / ' /proc/mounts
echo segs $(cat /sys/block/vda/queue/max_segments)
mkdir -p /work/a /work/b
for i in $(seq 1 200); do echo "file $i" > /work/a/f$i; done
chown -R 1234:5678 /work
mv /work/a/f1 /work/b/renamed
rm /work/a/f2
dd if=/dev/urandom of=/work/big bs=1M count=48 2>/dev/null
sync
echo 3 > /proc/sys/vm/drop_caches
stat -c '%u:%g' /work/a/f3
cat /work/b/renamed
test ! -e /work/a/f2 && echo unlinked
ls /work/a | wc -l
stat -c '%s' /work/big
echo done`
	r := e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", rootfs, "--", "/bin/sh", "-c", script)
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	// seg_max follows the default queue_size (256 - 2), as on QEMU's virtio-blk.
	want := []string{"/dev/vda / ext4 rw", "segs 254", "1234:5678", "file 1", "unlinked", "198", strconv.Itoa(48 << 20), "done"}
	for _, w := range want {
		if !strings.Contains(r.stdout, w) {
			t.Errorf("guest output lacks %q:\n%s", w, r.stdout)
		}
	}
	// Guest writes land in the pod's overlay, never in the image's source.
	if _, err := os.Stat(filepath.Join(rootfs, "work")); !os.IsNotExist(err) {
		t.Fatalf("guest writes reached the source tree: %v", err)
	}
}

// TestRunImagefsBlkTreeMatchesSource walks a Debian root inside the guest
// and compares every entry's metadata and content hash with the host's index.
func TestRunImagefsBlkTreeMatchesSource(t *testing.T) {
	src := fixture(t, "debian-rootfs.sh", "debootstrap")
	e := newEnv(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	script := `find / -xdev -printf 'E|%p|%y|%m|%U|%G|%s|%T@|%l\n' && find / -xdev -type f -exec md5sum {} + | sed 's/^/M|/'`
	r := e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", src, "--", "/bin/sh", "-c", script)
	if r.code != 0 {
		t.Fatalf("exit %d\n%s", r.code, r.stderr)
	}
	guest := map[string][]string{}
	sums := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(r.stdout))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "E|"):
			f := strings.SplitN(l, "|", 9)
			if len(f) == 9 {
				guest[f[1]] = f[2:]
			}
		case strings.HasPrefix(l, "M|"):
			if sum, p, ok := strings.Cut(l[2:], "  "); ok {
				sums[p] = sum
			}
		}
	}
	idx, err := hostfs.FromDir(context.Background(), src, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	types := map[index.Type]string{index.TypeRegular: "f", index.TypeHardlink: "f", index.TypeDir: "d", index.TypeSymlink: "l",
		index.TypeChar: "c", index.TypeBlock: "b", index.TypeFifo: "p", index.TypeSocket: "s"}
	checked, bad := 0, 0
	byPath := map[string]*index.Entry{}
	for i := range idx.Entries {
		byPath[idx.Entries[i].Path] = &idx.Entries[i]
	}
	for i := range idx.Entries {
		x := &idx.Entries[i]
		p := "/" + x.Path
		if x.Path == "." || p == "/proc" || p == "/sys" || p == "/dev" || strings.HasPrefix(p, "/proc/") || strings.HasPrefix(p, "/sys/") || strings.HasPrefix(p, "/dev/") {
			continue // the container's own mounts cover these
		}
		g, ok := guest[p]
		if !ok {
			t.Errorf("%s: not seen in the guest", p)
			bad++
			continue
		}
		meta := x
		if x.Type == index.TypeHardlink {
			meta = byPath[x.Linkname]
		}
		mtime := fmt.Sprintf("%d.%09d", meta.Mtime.Sec, meta.Mtime.Nsec)
		wantFields := []string{types[x.Type], strconv.FormatUint(uint64(meta.Mode), 8), strconv.Itoa(int(meta.UID)), strconv.Itoa(int(meta.GID))}
		gotFields := []string{g[0], g[1], g[2], g[3]}
		if strings.Join(wantFields, " ") != strings.Join(gotFields, " ") || (x.Type != index.TypeDir && !strings.HasPrefix(g[5], mtime[:len(mtime)-3])) || g[6] != meta.Linkname && x.Type == index.TypeSymlink {
			t.Errorf("%s: host %v mtime %s link %q, guest %v", p, wantFields, mtime, meta.Linkname, g)
			bad++
		}
		if x.Type == index.TypeRegular || x.Type == index.TypeHardlink {
			if g[4] != strconv.FormatInt(meta.Size, 10) || sums[p] != md5File(t, filepath.Join(src, x.Path)) {
				t.Errorf("%s: size %s sum %s differ from the host's", p, g[4], sums[p])
				bad++
			}
		}
		checked++
		if bad > 20 {
			t.Fatal("too many differences")
		}
	}
	if checked < 5000 {
		t.Fatalf("only %d entries compared", checked)
	}
	t.Logf("%d entries identical in the guest (type, mode, owner, size, mtime, link target, md5)", checked)
}

func md5File(t *testing.T, p string) string {
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := md5.New()
	io.Copy(h, f)
	return fmt.Sprintf("%x", h.Sum(nil))
}

// TestImagefsBlkSyncedWritesSurviveBackendKill serves an image from a
// separate `kata-fsx image serve` process, has the guest write and sync,
// kills the backend with SIGKILL, and checks from the overlay that every
// synced change is there.
func TestImagefsBlkSyncedWritesSurviveBackendKill(t *testing.T) {
	kit := guestKit(t)
	work := t.TempDir()
	rootfs := busyboxRootfs(t)
	img, cache := filepath.Join(work, "img"), filepath.Join(work, "cache")
	runCLI(t, "image", "build", "dir:"+rootfs, "-o", img, "--cache", cache, "-q", "--writable-size", "256M")
	sockDir := filepath.Join(work, "sock")
	sock, ovl := filepath.Join(sockDir, "blk.sock"), filepath.Join(work, "overlay")
	serve := exec.Command(kataFSX(t), "image", "serve", img, "--socket", sock, "--overlay", ovl, "--cache", cache)
	serveLog, _ := os.Create(filepath.Join(work, "serve.log"))
	serve.Stdout, serve.Stderr = serveLog, serveLog
	if err := serve.Start(); err != nil {
		t.Fatal(err)
	}
	defer serve.Process.Kill()
	_ = testenv.Wait(30*time.Second, func() (bool, error) {
		fi, err := os.Stat(sock)
		return err == nil && fi.Mode()&os.ModeSocket != 0, nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	caps, err := hypervisor.Probe(ctx, "/usr/bin/qemu-system-x86_64")
	if err != nil {
		t.Fatal(err)
	}
	vmDir := filepath.Join(work, "vm")
	agentSock := filepath.Join(work, "agent.sock")
	vm, err := hypervisor.Start(ctx, &hypervisor.VMConfig{
		Name: "kill-test", Dir: vmDir, QEMUPath: caps.Path, Caps: caps, Accel: hypervisor.Accel(testAccel(kit)),
		VCPUs: 1, MemoryMiB: 512, SharedMemory: hypervisor.SharedMemoryMemfd,
		Kernel: filepath.Join(kit, "vmlinux"), Initrd: filepath.Join(kit, "initrd.img"), ConsoleLog: filepath.Join(work, "console.log"),
		Agent:   hypervisor.AgentChannel{Transport: hypervisor.AgentSerial, SocketPath: agentSock},
		Devices: []hypervisor.Device{&hypervisor.VhostUserBlk{ID: "disk0", SocketPath: sock}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	c, err := agent.Dial(ctx, agent.SerialTransport{Path: agentSock}, 2*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "k"}); err != nil {
		t.Fatal(err)
	}
	mp := "/run/kata-containers/shared/containers/k"
	script := `set -e
echo synced-content > /synced
mkdir /dir && for i in $(seq 1 50); do echo $i > /dir/f$i; done
chown -R 4242:4343 /dir
mv /dir/f1 /dir/moved
sync
echo unsynced > /unsynced
echo written`
	err = c.CreateContainer(ctx, &pb.CreateContainerRequest{ContainerId: "k", ExecId: "k",
		Storages: []*pb.Storage{{Driver: "blk", Source: string(vm.Plan().PCIPaths["disk0"]), Fstype: "ext4", MountPoint: mp}},
		OCI:      &pb.Spec{Root: &pb.Root{Path: mp}, Process: &pb.Process{Args: []string{"/bin/sh", "-c", script}, Env: []string{"PATH=/bin"}, Cwd: "/", User: &pb.User{}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.StartContainer(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(c.StreamReader(ctx, "k", "k", false))
	if st, err := c.WaitProcess(ctx, "k", "k"); err != nil || st != 0 || !strings.Contains(string(out), "written") {
		t.Fatalf("guest script: status %d %v, output %q", st, err, out)
	}
	// The backend dies without any chance to flush; then the VM goes.
	serve.Process.Signal(syscall.SIGKILL)
	serve.Wait()
	vm.Stop(context.Background())

	// What the overlay holds is what a restarted backend serves.
	raw := filepath.Join(work, "after.raw")
	runCLI(t, "image", "export", img, "--raw", raw, "--overlay", ovl, "--cache", cache)
	mnt := filepath.Join(work, "mnt")
	os.Mkdir(mnt, 0o755)
	// The guest never unmounted: mounting replays the journal, as the guest would on its next boot.
	if b, err := exec.Command("mount", "-o", "loop", raw, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, b)
	}
	defer exec.Command("umount", mnt).Run()
	if b, err := os.ReadFile(filepath.Join(mnt, "synced")); err != nil || string(b) != "synced-content\n" {
		t.Fatalf("synced file after backend kill: %q %v", b, err)
	}
	for i := 2; i <= 50; i++ {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(mnt, "dir", fmt.Sprintf("f%d", i)), &st); err != nil || st.Uid != 4242 || st.Gid != 4343 {
			t.Fatalf("dir/f%d after backend kill: %v uid %d gid %d", i, err, st.Uid, st.Gid)
		}
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "dir", "moved")); err != nil || string(b) != "1\n" {
		t.Fatalf("renamed file: %q %v", b, err)
	}
	t.Log("every synced change survived the backend's SIGKILL")
}
