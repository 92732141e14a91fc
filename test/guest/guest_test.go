package guest_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const (
	qemuBinary     = "qemu-system-x86_64"
	cVirtiofsd     = "/usr/lib/qemu/virtiofsd"
	sharedMount    = "/run/kata-containers/shared/containers/"
	guestTestLimit = 4 * time.Minute
)

var (
	kitOnce sync.Once
	kitDir  string
	kitErr  error
	kitSkip string
)

// guestKit returns the kit directory: $KATA_FSX_GUEST_DIR, or build/guest of
// this repository built once by make guest (guest/initrd/build.sh, which
// skips unchanged inputs, with the agent the other tests boot too).
func guestKit(t testing.TB) string {
	t.Helper()
	kitOnce.Do(func() {
		if d := os.Getenv("KATA_FSX_GUEST_DIR"); d != "" {
			kitDir = d
		} else {
			root, err := filepath.Abs("../..")
			if err != nil {
				kitErr = err
				return
			}
			kitDir = filepath.Join(root, "build", "guest")
			for _, tool := range [][2]string{{"make", "make"}, {"apt-get", "apt"}, {"dpkg-deb", "dpkg"}, {"depmod", "kmod"}, {"cpio", "cpio"}, {"xz", "xz-utils"}} {
				if _, err := exec.LookPath(tool[0]); err != nil {
					kitSkip = fmt.Sprintf("guest kit not built and %s is missing to build it (apt-get install %s)", tool[0], tool[1])
					return
				}
			}
			cmd := exec.Command("make", "-C", root, "guest", "GUESTDIR="+kitDir)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Run(); err != nil {
				kitErr = fmt.Errorf("make guest GUESTDIR=%s: %w\n%s", kitDir, err, out.String())
				return
			}
		}
		for _, f := range []string{"vmlinux", "initrd.img"} {
			if _, err := os.Stat(filepath.Join(kitDir, f)); err != nil {
				kitSkip = fmt.Sprintf("guest kit %s incomplete ('make guest' builds it): %v", kitDir, err)
			}
		}
	})
	if kitSkip != "" {
		testenv.Missing(t, "%s", kitSkip)
	}
	if kitErr != nil {
		t.Fatal(kitErr)
	}
	return kitDir
}

var (
	accelOnce sync.Once
	accelName string
	accelWhy  string
)

// accelerator returns "kvm" when KVM really runs this guest kernel, else
// "tcg". Opening /dev/kvm is not enough: under some nested setups KVM
// initialises and then stops on an "emulation failure" early in the boot, so
// the probe boots the kit's kernel with no root filesystem and expects it to
// panic and exit QEMU by itself (panic=-1 with -no-reboot).
func accelerator(t testing.TB, kit string) string {
	accelOnce.Do(func() {
		accelName = "tcg"
		if _, err := os.Stat("/dev/kvm"); err != nil {
			accelWhy = "no /dev/kvm"
			return
		}
		// A working KVM gets this kernel to its panic in a second or two; a
		// broken one may spin silently, hence the short bound.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, qemuBinary, "-accel", "kvm", "-M", "q35", "-cpu", "host",
			"-m", "256M", "-nodefaults", "-display", "none", "-no-reboot", "-serial", "stdio",
			"-kernel", filepath.Join(kit, "vmlinux"), "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent")
		pr, pw := io.Pipe()
		cmd.Stdout, cmd.Stderr = pw, pw
		if err := cmd.Start(); err != nil {
			accelWhy = fmt.Sprintf("KVM probe: %v", err)
			return
		}
		waitErr := make(chan error, 1)
		go func() {
			err := cmd.Wait()
			pw.Close()
			waitErr <- err
		}()
		// A KVM emulation failure leaves QEMU paused for ever: stop at the
		// first sign of it instead of waiting for the timeout.
		var out bytes.Buffer
		sc := bufio.NewScanner(pr)
		failed := false
		for sc.Scan() {
			line := sc.Text()
			out.WriteString(line + "\n")
			if strings.Contains(line, "KVM internal error") || strings.Contains(line, "emulation failure") {
				failed = true
				cancel()
			}
		}
		err := <-waitErr
		if failed || err != nil || !bytes.Contains(out.Bytes(), []byte("Kernel panic")) {
			first, _, _ := strings.Cut(strings.TrimSpace(out.String()), "\n")
			accelWhy = fmt.Sprintf("KVM probe boot did not reach the kernel's panic in 10s (%v) %s", err, first)
			return
		}
		accelName = "kvm"
	})
	if accelWhy != "" {
		t.Logf("using TCG: %s", accelWhy)
	}
	return accelName
}

// makeRootfs creates <share>/<cid>/rootfs as a busybox system.
func makeRootfs(t testing.TB, share, cid string) {
	t.Helper()
	bb := testenv.Tool(t, "busybox", "busybox-static")
	root := filepath.Join(share, cid, "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc"} {
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
	list, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	for _, applet := range strings.Fields(string(list)) {
		// The list names busybox itself: a link to itself would loop.
		if applet == "busybox" {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	}
}

// makeExt4Rootfs builds a raw ext4 image of the busybox rootfs of c1 with
// mkfs.ext4 -d; empty without e2fsprogs, and testGuest then runs the other
// cases and ends through testenv.Missing.
func makeExt4Rootfs(t *testing.T, share string) string {
	t.Helper()
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return ""
	}
	img := filepath.Join(t.TempDir(), "rootfs.ext4")
	out, err := exec.Command(mkfs, "-q", "-F", "-d", filepath.Join(share, "c1", "rootfs"), img, "64M").CombinedOutput()
	if err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	return img
}

// vm is one QEMU guest started for a test.
type vm struct {
	cmd     *exec.Cmd
	sock    string
	console string
	started time.Time
	exited  chan struct{}
	waitErr error
}

func (v *vm) consoleTail() string {
	b, _ := os.ReadFile(v.console)
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}

// startVM boots the kit with the share exposed as kataShared over fs
// ("9p" or "virtio-fs") and, if blkImage is set, that raw disk at PCI path
// 02/01; the VM is killed at test end.
func startVM(t testing.TB, kit, share, fs, blkImage string) *vm {
	t.Helper()
	testenv.Tool(t, qemuBinary, "qemu-system-x86")
	dir := t.TempDir()
	accel := accelerator(t, kit)
	v := &vm{sock: filepath.Join(dir, "agent.sock"), console: filepath.Join(dir, "console.log"), exited: make(chan struct{})}
	args := []string{
		"-M", "q35", "-accel", accel, "-cpu", map[string]string{"kvm": "host", "tcg": "max"}[accel],
		"-smp", "1", "-m", "512M", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-object", "memory-backend-memfd,id=mem,size=512M,share=on", "-numa", "node,memdev=mem",
		"-kernel", filepath.Join(kit, "vmlinux"), "-initrd", filepath.Join(kit, "initrd.img"),
		"-append", "console=ttyS0 panic=-1 tsc=reliable no_timer_check noreplace-smp rcupdate.rcu_expedited=1 i8042.direct=1 i8042.dumbkbd=1 i8042.nopnp=1 i8042.noaux=1 cryptomgr.notests quiet loglevel=4 rdinit=/init",
		"-serial", "file:" + v.console,
		"-device", "virtio-serial-pci,id=serial0",
		"-chardev", "socket,id=agent,path=" + v.sock + ",server=on,wait=off",
		"-device", "virtserialport,chardev=agent,name=agent.channel.0",
	}
	if blkImage != "" {
		// Behind a bridge, so the agent has to walk the PCI path "02/01".
		args = append(args,
			"-device", "pci-bridge,id=br0,bus=pcie.0,addr=0x2,chassis_nr=1,shpc=off",
			"-drive", "if=none,id=d0,format=raw,cache=none,aio=threads,file="+blkImage,
			"-device", "virtio-blk-pci,drive=d0,bus=br0,addr=0x1")
	}
	switch fs {
	case "9p":
		args = append(args,
			"-fsdev", "local,id=fs9p,path="+share+",security_model=none,multidevs=remap",
			"-device", "virtio-9p-pci,fsdev=fs9p,mount_tag=kataShared")
	case "virtio-fs":
		if _, err := os.Stat(cVirtiofsd); err != nil {
			testenv.Missing(t, "C virtiofsd not installed (apt-get install qemu-system-common, which qemu-system-x86 depends on): %v", err)
		}
		fsSock := filepath.Join(dir, "vhost-fs.sock")
		d := exec.Command(cVirtiofsd, "--socket-path="+fsSock, "-o", "source="+share, "-o", "cache=auto")
		dlog, err := os.Create(filepath.Join(dir, "virtiofsd.log"))
		if err != nil {
			t.Fatal(err)
		}
		d.Stdout, d.Stderr = dlog, dlog
		if err := d.Start(); err != nil {
			t.Fatalf("start virtiofsd: %v", err)
		}
		t.Cleanup(func() {
			_ = d.Process.Kill()
			_ = d.Wait()
			dlog.Close()
		})
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, err := os.Stat(fsSock); err == nil {
				break
			}
			if time.Now().After(deadline) {
				b, _ := os.ReadFile(dlog.Name())
				t.Fatalf("virtiofsd did not create %s: %s", fsSock, b)
			}
			time.Sleep(10 * time.Millisecond)
		}
		args = append(args,
			"-chardev", "socket,id=fs,path="+fsSock,
			"-device", "vhost-user-fs-pci,chardev=fs,tag=kataShared,queue-size=1024")
	default:
		t.Fatalf("unknown shared fs %q", fs)
	}
	v.cmd = exec.Command(qemuBinary, args...)
	qlog, err := os.Create(filepath.Join(dir, "qemu.log"))
	if err != nil {
		t.Fatal(err)
	}
	v.cmd.Stdout, v.cmd.Stderr = qlog, qlog
	v.started = time.Now()
	if err := v.cmd.Start(); err != nil {
		t.Fatalf("start qemu: %v", err)
	}
	go func() {
		v.waitErr = v.cmd.Wait()
		close(v.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-v.exited:
		default:
			_ = v.cmd.Process.Kill()
			<-v.exited
		}
		qlog.Close()
		if t.Failed() || os.Getenv("KATA_FSX_GUEST_CONSOLE") != "" {
			b, _ := os.ReadFile(qlog.Name())
			t.Logf("qemu (%s) output:\n%s\nguest console tail:\n%s", accel, b, v.consoleTail())
		}
	})
	t.Logf("booting %s guest (%s) sharing %s over %s", "q35", accel, share, fs)
	return v
}

// readAll drains a process's stdout and stderr into strings.
func readAll(ctx context.Context, c *agent.Client, cid, eid string) (stdout, stderr <-chan string) {
	read := func(isErr bool) <-chan string {
		ch := make(chan string, 1)
		go func() {
			b, err := io.ReadAll(c.StreamReader(ctx, cid, eid, isErr))
			if err != nil {
				b = append(b, []byte("\n<read error: "+err.Error()+">")...)
			}
			ch <- string(b)
		}()
		return ch
	}
	return read(false), read(true)
}

func containerRequest(cid, hostname string, args ...string) *pb.CreateContainerRequest {
	return &pb.CreateContainerRequest{
		ContainerId: cid,
		ExecId:      cid,
		OCI: &pb.Spec{
			Version:  "1.0.2",
			Hostname: hostname,
			Root:     &pb.Root{Path: sharedMount + cid + "/rootfs"},
			Process: &pb.Process{
				Args: args,
				Env:  []string{"PATH=/bin:/usr/bin", "HOME=/"},
				Cwd:  "/",
				User: &pb.User{},
			},
		},
	}
}

func TestGuestAgent(t *testing.T) {
	kit := guestKit(t)
	for _, fs := range []struct{ name, driver, fstype string }{
		{"9p", "9p", "9p"},
		{"virtio-fs", "virtio-fs", "virtiofs"},
	} {
		t.Run(fs.name, func(t *testing.T) {
			testGuest(t, kit, fs.name, fs.driver, fs.fstype)
		})
	}
}

func testGuest(t *testing.T, kit, fsName, driver, fstype string) {
	share := t.TempDir()
	sandboxID := "sb-" + fsName
	for _, cid := range []string{"c1", "c2", "c3", "c5", sandboxID} {
		makeRootfs(t, share, cid)
	}
	blkImage := makeExt4Rootfs(t, share)
	v := startVM(t, kit, share, fsName, blkImage)
	ctx, cancel := context.WithTimeout(context.Background(), guestTestLimit)
	defer cancel()

	c, err := agent.Dial(ctx, agent.SerialTransport{Path: v.sock}, 2*time.Minute)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Logf("boot to agent Check over %s: %s", fsName, time.Since(v.started).Round(time.Millisecond))
	// The port is one stream: after the host hangs up, the agent must reopen
	// it for the next connection (a restarted shim, say).
	// Several times, back to back: the host reconnects faster than the
	// guest notices the hangup.
	for i := range 3 {
		c.Close()
		c, err = agent.Dial(ctx, agent.SerialTransport{Path: v.sock}, 30*time.Second)
		if err != nil {
			t.Fatalf("redial %d after close: %v", i+1, err)
		}
	}
	defer c.Close()

	err = c.CreateSandbox(ctx, &pb.CreateSandboxRequest{
		Hostname:  "sandbox",
		SandboxId: sandboxID,
		Storages: []*pb.Storage{
			{Driver: driver, Source: "kataShared", Fstype: fstype, MountPoint: sharedMount},
			{Driver: "ephemeral", Source: "shm", Fstype: "tmpfs", MountPoint: "/run/kata-containers/sandbox/shm"},
		},
	})
	if err != nil {
		t.Fatal(err)
	}

	// c1: output, rootfs as "/", exit status.
	if err := c.CreateContainer(ctx, containerRequest("c1", "c1host", "/bin/sh", "-c", "cat /proc/mounts; echo hello; exit 3")); err != nil {
		t.Fatal(err)
	}
	out, errOut := readAll(ctx, c, "c1", "c1")
	if err := c.StartContainer(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	st, err := c.WaitProcess(ctx, "c1", "c1")
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr := <-out, <-errOut
	if st != 3 {
		t.Errorf("c1 exit status %d, want 3 (stderr %q)", st, stderr)
	}
	if !strings.Contains(stdout, "hello\n") {
		t.Errorf("c1 stdout lacks hello: %q", stdout)
	}
	rootLine := ""
	for _, line := range strings.Split(stdout, "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[1] == "/" {
			rootLine = line
		}
	}
	if f := strings.Fields(rootLine); len(f) < 3 || f[2] != fstype {
		t.Errorf("c1 /proc/mounts shows / as %q, want a %s mount:\n%s", rootLine, fstype, stdout)
	}
	if err := c.RemoveContainer(ctx, "c1", 10*time.Second); err != nil {
		t.Error(err)
	}

	// c2: a long-running container to exec into.
	if err := c.CreateContainer(ctx, containerRequest("c2", "c2host", "/bin/sh", "-c", "echo ready; exec sleep 1000")); err != nil {
		t.Fatal(err)
	}
	if err := c.StartContainer(ctx, "c2"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := c.ReadStdout(ctx, "c2", "", buf); err != nil || string(buf[:n]) != "ready\n" {
		t.Fatalf("c2 first output %q, %v", buf[:n], err)
	}

	execReq := func(eid string, args ...string) *pb.ExecProcessRequest {
		return &pb.ExecProcessRequest{ContainerId: "c2", ExecId: eid, Process: &pb.Process{
			Args: args, Env: []string{"PATH=/bin"}, Cwd: "/tmp", User: &pb.User{},
		}}
	}
	if err := c.ExecProcess(ctx, execReq("e1", "/bin/sh", "-c", "hostname; pwd; cat /proc/1/cmdline | tr '\\0' ' '; echo; echo exec-ok >&2; exit 5")); err != nil {
		t.Fatal(err)
	}
	out, errOut = readAll(ctx, c, "c2", "e1")
	st, err = c.WaitProcess(ctx, "c2", "e1")
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr = <-out, <-errOut
	if st != 5 || stdout != "c2host\n/tmp\nsh -c echo ready; exec sleep 1000 \n" && stdout != "c2host\n/tmp\nsleep 1000 \n" || stderr != "exec-ok\n" {
		t.Errorf("exec e1: status %d stdout %q stderr %q; want 5, hostname/cwd/container init, exec-ok", st, stdout, stderr)
	}

	// stdin round trip through an exec'd cat.
	if err := c.ExecProcess(ctx, execReq("e2", "cat")); err != nil {
		t.Fatal(err)
	}
	out, _ = readAll(ctx, c, "c2", "e2")
	if n, err := c.WriteStdin(ctx, "c2", "e2", []byte("ping\n")); n != 5 || err != nil {
		t.Fatalf("WriteStdin: %d, %v", n, err)
	}
	if err := c.CloseStdin(ctx, "c2", "e2"); err != nil {
		t.Fatal(err)
	}
	if st, err := c.WaitProcess(ctx, "c2", "e2"); st != 0 || err != nil {
		t.Errorf("cat exit %d, %v", st, err)
	}
	if got := <-out; got != "ping\n" {
		t.Errorf("cat echoed %q, want ping", got)
	}

	// A command missing from the rootfs is an error naming it.
	err = c.ExecProcess(ctx, execReq("e3", "no-such-command-x"))
	if err == nil || !strings.Contains(err.Error(), "no-such-command-x") {
		t.Errorf("exec of a missing command: want an error naming it, got %v", err)
	}
	if err := c.CreateContainer(ctx, containerRequest("c3", "", "/bin/no-such-init")); err != nil {
		t.Fatal(err)
	}
	err = c.StartContainer(ctx, "c3")
	if err == nil || !strings.Contains(err.Error(), "/bin/no-such-init") {
		t.Errorf("start with a missing command: want an error naming it, got %v", err)
	}
	if st, err := c.WaitProcess(ctx, "c3", ""); st != 127 || err != nil {
		t.Errorf("c3 status %d, %v; want 127", st, err)
	}

	// Signals: SIGKILL to the init gives 128+9.
	if err := c.SignalProcess(ctx, "c2", "", syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if st, err := c.WaitProcess(ctx, "c2", ""); st != 137 || err != nil {
		t.Errorf("c2 after SIGKILL: %d, %v; want 137", st, err)
	}
	if err := c.RemoveContainer(ctx, "c2", 10*time.Second); err != nil {
		t.Error(err)
	}

	if blkImage != "" {
		// c4: an ext4 rootfs on a virtio-blk disk, as imagefs-blk hands it over.
		mp := sharedMount + "c4"
		req := containerRequest("c4", "", "/bin/sh", "-c", "grep ' / ' /proc/mounts; echo blk > /written; cat /written")
		req.OCI.Root.Path = mp
		req.Storages = []*pb.Storage{{Driver: "blk", Source: "02/01", Fstype: "ext4", MountPoint: mp}}
		if err := c.CreateContainer(ctx, req); err != nil {
			t.Fatal(err)
		}
		out, errOut = readAll(ctx, c, "c4", "")
		if err := c.StartContainer(ctx, "c4"); err != nil {
			t.Fatal(err)
		}
		st, err := c.WaitProcess(ctx, "c4", "")
		stdout, stderr := <-out, <-errOut
		if err != nil || st != 0 || !strings.HasPrefix(stdout, "/dev/vda / ext4 ") || !strings.HasSuffix(stdout, "\nblk\n") {
			t.Errorf("blk container: status %d, %v, stdout %q, stderr %q; want / on /dev/vda ext4 and a write", st, err, stdout, stderr)
		}
		if err := c.RemoveContainer(ctx, "c4", 10*time.Second); err != nil {
			t.Error(err)
		}
	}

	// The pod's PID namespace, as CRI asks for it (PID mode POD): the
	// sandbox container, whose id is the sandbox's, runs in a PID
	// namespace of its own; c5, created with SandboxPidns, joins it and
	// sees the sandbox container's init as PID 1, not itself.
	if err := c.CreateContainer(ctx, containerRequest(sandboxID, "", "/bin/sleep", "600")); err != nil {
		t.Fatal(err)
	}
	if err := c.StartContainer(ctx, sandboxID); err != nil {
		t.Fatal(err)
	}
	req := containerRequest("c5", "", "/bin/sh", "-c", "tr '\\0' ' ' </proc/1/cmdline; echo; echo $$")
	req.SandboxPidns = true
	if err := c.CreateContainer(ctx, req); err != nil {
		t.Fatal(err)
	}
	out, errOut = readAll(ctx, c, "c5", "")
	if err := c.StartContainer(ctx, "c5"); err != nil {
		t.Fatal(err)
	}
	if st, err := c.WaitProcess(ctx, "c5", ""); err != nil || st != 0 {
		t.Errorf("c5 (the pod's PID namespace): status %d, %v; stderr %q", st, err, <-errOut)
	} else if stdout := <-out; !strings.HasPrefix(stdout, "/bin/sleep 600 \n") || strings.HasSuffix(stdout, "\n1\n") {
		t.Errorf("c5 joined the pod's PID namespace, yet PID 1 and its own PID read %q; want the sandbox container's /bin/sleep 600 as PID 1 and c5 not", stdout)
	}
	if err := c.SignalProcess(ctx, sandboxID, "", syscall.SIGKILL); err != nil {
		t.Error(err)
	} else if st, err := c.WaitProcess(ctx, sandboxID, ""); err != nil || st != 137 {
		t.Errorf("sandbox container after SIGKILL: %d, %v; want 137", st, err)
	}
	for _, cid := range []string{"c5", sandboxID} {
		if err := c.RemoveContainer(ctx, cid, 10*time.Second); err != nil {
			t.Errorf("remove %s: %v", cid, err)
		}
	}

	if err := c.DestroySandbox(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-v.exited:
		if v.waitErr != nil {
			t.Errorf("qemu exited with %v after power-off", v.waitErr)
		}
	case <-time.After(60 * time.Second):
		t.Errorf("VM still running 60s after DestroySandbox")
	}
	if blkImage == "" {
		testenv.Missing(t, "mkfs.ext4 not installed (apt-get install e2fsprogs): the blk rootfs case was left out, the others were checked")
	}
}

// BenchmarkBootToCheck measures QEMU start to the agent's first health check
// answer (9p share, no storages), then powers the guest off.
func BenchmarkBootToCheck(b *testing.B) {
	kit := guestKit(b)
	share := b.TempDir()
	accelerator(b, kit) // probe outside the timed loop
	var toCheck time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		v := startVM(b, kit, share, "9p", "")
		ctx, cancel := context.WithTimeout(context.Background(), guestTestLimit)
		c, err := agent.Dial(ctx, agent.SerialTransport{Path: v.sock}, 2*time.Minute)
		if err != nil {
			cancel()
			b.Fatal(err)
		}
		toCheck += time.Since(v.started)
		if err := c.DestroySandbox(ctx); err != nil {
			b.Error(err)
		}
		c.Close()
		select {
		case <-v.exited:
		case <-ctx.Done():
			b.Error("guest did not power off")
		}
		cancel()
	}
	b.ReportMetric(toCheck.Seconds()/float64(b.N), "s-to-check/op")
}
