package hypervisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/hypervisor/qmp"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// testVM is a kernel-less, paused VM: QEMU runs its devices but no guest code.
func testVM(t *testing.T, machine string) *VMConfig {
	t.Helper()
	qemu := qemuBinary(t)
	caps, err := Probe(context.Background(), qemu)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "vm")
	return &VMConfig{
		Name:         "test-" + machine,
		UUID:         "6d8a3c8e-4f7e-4a54-9a0d-2f5d3a1c9b01",
		Dir:          dir,
		QEMUPath:     qemu,
		Caps:         caps,
		MachineType:  machine,
		Accel:        AccelTCG,
		VCPUs:        1,
		MemoryMiB:    128,
		SharedMemory: SharedMemoryMemfd,
		ConsoleLog:   filepath.Join(dir, "console.log"),
		Agent:        AgentChannel{Transport: AgentSerial, SocketPath: filepath.Join(dir, "agent.sock")},
		HotplugSlots: 4,
		Paused:       true,
	}
}

func processGone(pid int) bool {
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// checkPCIPaths compares every PCI path the plan promised with where QEMU put the device.
func checkPCIPaths(t *testing.T, vm *VM) {
	t.Helper()
	buses, err := vm.QMP().QueryPCI(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(vm.Plan().PCIPaths) == 0 {
		t.Fatal("plan has no PCI devices")
	}
	for id, want := range vm.Plan().PCIPaths {
		// Two independent views of QEMU's topology: query-pci and QOM.
		slots, ok := qmp.FindPCIPath(buses, id)
		if !ok {
			t.Errorf("%s: not in query-pci", id)
			continue
		}
		got, err := NewPCIPath(slots...)
		if err != nil || got != want {
			t.Errorf("%s: query-pci has it at %v (%v), plan says %s", id, slots, err, want)
		}
		if got, err := vm.DevicePCIPath(context.Background(), id); err != nil || got != want {
			t.Errorf("%s: QOM has it at %s (%v), plan says %s", id, got, err, want)
		}
	}
}

func TestStartStopNoKernel(t *testing.T) {
	variants := map[string]func(*VMConfig){
		"q35": func(*VMConfig) {},
		"pc":  func(cfg *VMConfig) { cfg.MachineType = "pc"; cfg.Name = "test-pc" },
		"q35_virtio_console_shm_file": func(cfg *VMConfig) {
			cfg.Console = ConsoleVirtio
			cfg.SharedMemory = SharedMemoryFile
			cfg.MemorySlots, cfg.MaxMemoryMiB = 2, 512
		},
	}
	for name, mod := range variants {
		t.Run(name, func(t *testing.T) {
			cfg := testVM(t, "q35")
			mod(cfg)
			vm, err := Start(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			pid := vm.Pid()
			st, err := os.Stat(cfg.Dir)
			if err != nil || st.Mode().Perm() != 0o700 {
				t.Errorf("VM dir: %v %v", st, err)
			}
			for _, f := range []string{"qemu.log", "console.log"} {
				if st, err := os.Stat(filepath.Join(cfg.Dir, f)); err != nil || st.Mode().Perm()&0o077 != 0 {
					t.Errorf("%s: %v readable by others or missing (%v)", f, st, err)
				}
			}
			status, err := vm.QMP().QueryStatus(context.Background())
			if err != nil || status.Status != "prelaunch" || status.Running {
				t.Errorf("status %+v %v", status, err)
			}
			checkPCIPaths(t, vm)
			if err := vm.Stop(context.Background()); err != nil {
				t.Fatal(err)
			}
			if err := vm.Wait(); err != nil {
				t.Errorf("Wait after quit: %v", err)
			}
			if !processGone(pid) {
				t.Errorf("QEMU pid %d still exists", pid)
			}
			if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("VM dir left behind: %v", err)
			}
			if err := vm.Stop(context.Background()); err != nil {
				t.Errorf("second Stop: %v", err)
			}
		})
	}
}

func TestStartBadArgumentReturnsStderr(t *testing.T) {
	cfg := testVM(t, "q35")
	missing := filepath.Join(t.TempDir(), "no-such-virtiofsd.sock")
	cfg.Devices = []Device{&VhostUserFS{ID: "fs0", SocketPath: missing}}
	vm, err := Start(context.Background(), cfg)
	if err == nil {
		vm.Stop(context.Background())
		t.Fatal("Start succeeded with a vhost-user socket nobody listens on")
	}
	// QEMU's own complaint must be in the error, naming the socket.
	if !errors.Is(err, ErrExited) || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "qemu-system-x86_64:") {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir left behind: %v", err)
	}
}

func TestStartMissingBinary(t *testing.T) {
	cfg := testVM(t, "q35")
	cfg.QEMUPath = filepath.Join(t.TempDir(), "qemu-system-gone")
	_, err := Start(context.Background(), cfg)
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), cfg.QEMUPath) {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir created: %v", err)
	}
}

func TestStartInvalidConfigCreatesNothing(t *testing.T) {
	cfg := testVM(t, "q35")
	cfg.SharedMemory = SharedMemoryOff
	cfg.Devices = []Device{&VhostUserBlk{ID: "b", SocketPath: "/x.sock"}}
	if _, err := Start(context.Background(), cfg); !errors.Is(err, ErrSharedMemoryRequired) {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir created: %v", err)
	}
}

func TestKilledExternally(t *testing.T) {
	cfg := testVM(t, "q35")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(vm.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err = vm.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("Wait = %v", err)
	}
	<-vm.QMP().Done()
	if _, err := vm.QMP().QueryStatus(context.Background()); !errors.Is(err, qmp.ErrClosed) {
		t.Errorf("QMP after kill: %v", err)
	}
	if err := vm.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir left behind: %v", err)
	}
}

func TestStopKillsWhenQuitIsIgnored(t *testing.T) {
	cfg := testVM(t, "q35")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	pid := vm.Pid()
	// A stopped QEMU cannot answer quit: Stop must fall back to SIGKILL.
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := vm.StopWith(context.Background(), StopOptions{QuitGrace: 200 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if err := vm.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Wait = %v, want killed", err)
	}
	if !processGone(pid) {
		t.Errorf("pid %d still exists", pid)
	}
}

func TestStartCancelled(t *testing.T) {
	cfg := testVM(t, "q35")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Start(ctx, cfg); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir left behind: %v", err)
	}
}

// TestStartWithResolvedAccel starts QEMU with the accelerator a pod would get.
// DetectAccel alone is not enough: on some hosts /dev/kvm passes its ioctls
// and QEMU still aborts under KVM (seen here: "failed to set MSR 0x10a"),
// which is what ResolveAccel's boot probe is for.
func TestStartWithResolvedAccel(t *testing.T) {
	cfg := testVM(t, "q35")
	kernel := guestKernel(t)
	t.Setenv("TMPDIR", t.TempDir())
	accel, reason := ResolveAccel(context.Background(), cfg.QEMUPath, kernel, t.TempDir())
	t.Logf("accelerator %s: %s", accel, reason)
	cfg.Accel = accel
	cfg.SharedMemory = SharedMemoryFile
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	if err := vm.QMP().Cont(context.Background()); err != nil {
		t.Fatal(err)
	}
	st, err := vm.QMP().QueryStatus(context.Background())
	if err != nil || !st.Running {
		t.Fatalf("after cont: %+v %v", st, err)
	}
}

// guestKernel returns probeKernel's kernel or ends the test through testenv.
func guestKernel(t *testing.T) string {
	t.Helper()
	k := probeKernel()
	if k == "" {
		testenv.Missing(t, "no guest kernel: set KATA_FSX_GUEST_DIR to a kit built by 'make guest' (as make test does), or apt-get install linux-image-amd64")
	}
	return k
}

// probeKernel is a guest kernel for the KVM boot probe: the test guest kit's
// when the tests run with one, else the host's installed kernel package.
func probeKernel() string {
	if dir := os.Getenv("KATA_FSX_GUEST_DIR"); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "vmlinux")); err == nil {
			return filepath.Join(dir, "vmlinux")
		}
	}
	kernels, _ := filepath.Glob("/boot/vmlinuz-*")
	if len(kernels) == 0 {
		return ""
	}
	return kernels[0]
}

// listenUnix starts a listener that accepts and holds connections, standing in
// for a chardev peer whose protocol the device does not speak at realize time.
func listenUnix(t *testing.T, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
}

func TestHotplugOnBridge(t *testing.T) {
	cfg := testVM(t, "q35")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	ctx := context.Background()
	q := vm.QMP()

	slot, err := vm.NextHotplugSlot()
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(cfg.Dir, "peer.sock")
	listenUnix(t, sock)
	if err := q.ChardevAddSocket(ctx, "char-hp0", sock); err != nil {
		t.Fatal(err)
	}
	if err := q.DeviceAdd(ctx, "virtio-serial-pci", "hp0", slot.Props()); err != nil {
		t.Fatal(err)
	}
	if err := q.DeviceAdd(ctx, "virtserialport", "hp0port", map[string]any{"bus": "hp0.0", "chardev": "char-hp0", "name": "hp.0"}); err != nil {
		t.Fatal(err)
	}
	// query-pci cannot see behind a bridge the firmware has not numbered
	// yet (-S), so ask QOM.
	if p, err := vm.DevicePCIPath(ctx, "hp0"); err != nil || p != slot.Path {
		t.Fatalf("hot-plugged device at %s (%v), allocator said %s", p, err, slot.Path)
	}
	if _, err := vm.DevicePCIPath(ctx, "nonexistent"); err == nil {
		t.Error("PCI path of a missing device")
	}
	// A chardev in use cannot be removed: QEMU's error comes back typed.
	var qe *qmp.Error
	if err := q.ChardevRemove(ctx, "char-hp0"); !errors.As(err, &qe) || qe.Class == "" || !strings.Contains(qe.Desc, "char-hp0") {
		t.Errorf("chardev-remove of busy chardev: %v", err)
	}
	// Adding to an occupied slot is refused by QEMU.
	if err := q.DeviceAdd(ctx, "virtio-serial-pci", "hp1", slot.Props()); !errors.As(err, &qe) {
		t.Errorf("device_add on occupied slot: %v", err)
	}
	if err := q.DeviceDel(ctx, "nonexistent"); !errors.As(err, &qe) || !strings.Contains(qe.Desc, "nonexistent") {
		t.Errorf("device_del of unknown device: %v", err)
	}
	// PCI unplug needs the guest to eject the device (ACPI); with the CPUs
	// stopped the request is accepted but DEVICE_DELETED never comes, so
	// DeviceDel must give up when its context ends, not hang.
	dctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if err := q.DeviceDel(dctx, "hp0"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("device_del without guest: %v", err)
	}
}

// TestColdPlugDevicesRealBackends boots (paused) a VM with every device kind
// behind its real backend and checks QEMU accepted the argv and placed each
// device where the plan says.
func TestColdPlugDevicesRealBackends(t *testing.T) {
	cfg := testVM(t, "q35")
	work := t.TempDir()
	var devs []Device

	img := filepath.Join(work, "disk.raw")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	devs = append(devs, &VirtioBlk{ID: "disk0", Path: img, ReadOnly: true})
	share := filepath.Join(work, "share")
	if err := os.Mkdir(share, 0o700); err != nil {
		t.Fatal(err)
	}
	devs = append(devs, &Virtio9P{ID: "p9", Path: share})

	var missing []string
	if qsd, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		sock := filepath.Join(work, "blk.sock")
		startDaemon(t, sock, qsd, "--blockdev", "driver=file,node-name=file0,filename="+img,
			"--export", "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path="+sock+",writable=off")
		devs = append(devs, &VhostUserBlk{ID: "blk0", SocketPath: sock})
	} else {
		missing = append(missing, "qemu-storage-daemon for vhost-user-blk")
	}
	if _, err := os.Stat("/usr/lib/qemu/virtiofsd"); err == nil {
		sock := filepath.Join(work, "fs.sock")
		startDaemon(t, sock, "/usr/lib/qemu/virtiofsd", "--socket-path="+sock, "-o", "source="+share, "-o", "cache=auto")
		devs = append(devs, &VhostUserFS{ID: "fs0", SocketPath: sock})
	} else {
		missing = append(missing, "/usr/lib/qemu/virtiofsd for vhost-user-fs")
	}
	cfg.Devices = devs
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	checkPCIPaths(t, vm)
	if len(missing) > 0 {
		testenv.Missing(t, "not covered: %s (apt-get install qemu-system-common, which qemu-system-x86 depends on); the devices that could run were checked", strings.Join(missing, ", "))
	}
}

// startDaemon runs a vhost-user backend and waits until its socket exists.
func startDaemon(t *testing.T, sock, bin string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var out tailBuffer
	out.max = 8 << 10
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := os.Stat(sock); err == nil {
			return
		}
		select {
		case <-done:
			t.Fatalf("%s exited: %s", bin, out.String())
		case <-tick.C:
		}
	}
}

func TestTailBuffer(t *testing.T) {
	b := &tailBuffer{max: 8}
	for _, s := range []string{"abc", "defg", "hij"} {
		fmt.Fprint(b, s)
	}
	if got := b.String(); got != "cdefghij" {
		t.Errorf("got %q", got)
	}
	fmt.Fprint(b, "0123456789")
	if got := b.String(); got != "23456789" {
		t.Errorf("got %q", got)
	}
}

func TestMakeVMDirRefusesSymlink(t *testing.T) {
	base := t.TempDir()
	link := filepath.Join(base, "vm")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	if err := MakeVMDir(link); err == nil {
		t.Fatal("symlink accepted as VM directory")
	}
	existing := filepath.Join(base, "pre")
	if err := os.Mkdir(existing, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := MakeVMDir(existing); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(existing); st.Mode().Perm() != 0o700 {
		t.Errorf("mode %v", st.Mode())
	}
}

func TestHotplugVhostUserBlk(t *testing.T) {
	qsd := testenv.Tool(t, "qemu-storage-daemon", "qemu-system-common")
	cfg := testVM(t, "q35")
	work := t.TempDir()
	img := filepath.Join(work, "disk.raw")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(work, "blk.sock")
	startDaemon(t, sock, qsd, "--blockdev", "driver=file,node-name=file0,filename="+img,
		"--export", "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path="+sock+",writable=on,num-queues=1")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	ctx := context.Background()
	slot, err := vm.NextHotplugSlot()
	if err != nil {
		t.Fatal(err)
	}
	// The sequence the shim uses for a container created after boot.
	if err := vm.QMP().ChardevAddSocket(ctx, "char-blk1", sock); err != nil {
		t.Fatal(err)
	}
	props := slot.Props()
	props["chardev"] = "char-blk1"
	props["num-queues"] = 1
	props["queue-size"] = 128
	if err := vm.QMP().DeviceAdd(ctx, "vhost-user-blk-pci", "blk1", props); err != nil {
		t.Fatal(err)
	}
	if p, err := vm.DevicePCIPath(ctx, "blk1"); err != nil || p != slot.Path || p != "02/01" {
		t.Fatalf("blk1 at %s (%v), allocator said %s", p, err, slot.Path)
	}
	next, err := vm.NextHotplugSlot()
	if err != nil || next.Path != "02/02" {
		t.Fatalf("second slot %+v %v", next, err)
	}
	if err := vm.ReleaseHotplugSlot(next); err != nil {
		t.Fatal(err)
	}
}

func TestBuildRefusesDAXOnProbedQEMU(t *testing.T) {
	cfg := testVM(t, "q35")
	if cfg.Caps.DAX {
		// Deliberate: this test is for a QEMU without DAX; the accepting
		// branch is TestBuildGolden/virtiofs_dax_on.
		t.Skip("this QEMU has vhost-user-fs-pci cache-size (DAX)")
	}
	cfg.QMPSocket = filepath.Join(cfg.Dir, "qmp.sock")
	cfg.Devices = []Device{&VhostUserFS{ID: "fs0", SocketPath: "/run/fs.sock", DAXWindowMiB: 64}}
	if _, err := Build(cfg); !errors.Is(err, ErrDAXUnsupported) {
		t.Fatalf("err = %v", err)
	}
}

// TestBootKernelPanicExits boots the host's kernel without a root filesystem:
// it must print to the console log, panic, and with panic=1 and -no-reboot
// make QEMU exit cleanly on its own.
func TestBootKernelPanicExits(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a kernel")
	}
	kernel := guestKernel(t)
	cfg := testVM(t, "q35")
	// TCG on purpose: this host's /dev/kvm passes DetectAccel's ioctl checks
	// but a Linux guest resets/hangs right after its real-mode setup code.
	cfg.Accel = AccelTCG
	cfg.Paused = false
	cfg.Kernel = kernel
	cfg.Debug = true
	cfg.ConsoleLog = filepath.Join(t.TempDir(), "console.log")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	// A guardrail against a hung guest, not a speed assertion.
	guard := time.NewTimer(3 * time.Minute)
	defer guard.Stop()
	select {
	case <-vm.Exited():
	case <-guard.C:
		out, _ := os.ReadFile(cfg.ConsoleLog)
		t.Fatalf("guest neither panicked nor exited; console:\n%s", tail(string(out), 2000))
	}
	if err := vm.Wait(); err != nil {
		t.Fatalf("guest panic should end QEMU cleanly: %v", err)
	}
	// Stop after the guest ended the VM by itself still cleans up.
	if err := vm.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cfg.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("VM dir left behind: %v", err)
	}
	out, err := os.ReadFile(cfg.ConsoleLog)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Linux version", "Command line: " + vm.Plan().Args[len(vm.Plan().Args)-1], "Kernel panic"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("console log lacks %q:\n%s", want, tail(string(out), 2000))
		}
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func TestStopPowerdownThenQuit(t *testing.T) {
	cfg := testVM(t, "q35")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	shutdown := vm.QMP().Subscribe("SHUTDOWN", nil)
	// Paused CPUs ignore the power button: after the grace period Stop must
	// move on to quit, which ends QEMU cleanly.
	if err := vm.StopWith(context.Background(), StopOptions{PowerdownGrace: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if err := vm.Wait(); err != nil {
		t.Fatalf("Wait = %v", err)
	}
	ev, err := shutdown.Wait(context.Background())
	if err != nil || !strings.Contains(string(ev.Data), "host-qmp-quit") {
		t.Errorf("SHUTDOWN event %+v %v", ev, err)
	}
}

func TestProbeBoot(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a kernel")
	}
	kernel := guestKernel(t)
	qemu := qemuBinary(t)
	// A temp dir of our own, so probes of other packages' tests running at
	// the same time do not count as our leftovers.
	t.Setenv("TMPDIR", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := ProbeBoot(ctx, qemu, kernel, AccelTCG); err != nil {
		t.Fatal(err)
	}
	// A file that is not a kernel must fail the probe, not pass it.
	bogus := filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(bogus, bytes.Repeat([]byte{0x90}, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ProbeBoot(ctx, qemu, bogus, AccelTCG); err == nil {
		t.Fatal("boot probe passed with a bogus kernel")
	} else {
		t.Logf("bogus kernel: %v", err)
	}
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), "kata-fsx-bootprobe-*"))
	if len(left) != 0 {
		t.Errorf("probe directories left behind: %v", left)
	}
}
