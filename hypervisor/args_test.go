package hypervisor

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// testCaps is a Debian-7.2-like capability set, fixed so goldens do not depend on the host QEMU.
func testCaps(dax bool) *Caps {
	devs := []string{"nvdimm", "pci-bridge", "vhost-user-blk-pci", "vhost-user-fs-pci", "vhost-user-vsock-pci", "vhost-vsock-pci", "virtio-9p-pci", "virtio-blk-pci", "virtio-serial-pci", "virtconsole", "virtserialport"}
	sort.Strings(devs)
	return &Caps{
		Path:     "/usr/bin/qemu-system-x86_64",
		Version:  Version{7, 2, 22},
		Devices:  devs,
		Machines: []Machine{{Name: "pc", Alias: "pc-i440fx-7.2"}, {Name: "q35", Alias: "pc-q35-7.2"}},
		DAX:      dax, VhostUserFS: true, VhostUserBlk: true, Virtio9P: true, VhostVsock: true, VhostUserVsock: true, VirtioBlk: true, VirtioSerial: true, PCIBridge: true,
	}
}

func baseVM() *VMConfig {
	return &VMConfig{
		Name:         "sandbox-abc",
		UUID:         "6d8a3c8e-4f7e-4a54-9a0d-2f5d3a1c9b01",
		Caps:         testCaps(false),
		Accel:        AccelTCG,
		VCPUs:        2,
		MemoryMiB:    2048,
		SharedMemory: SharedMemoryFile,
		Kernel:       "/usr/share/kata-fsx/vmlinux",
		Initrd:       "/usr/share/kata-fsx/initrd.img",
		ConsoleLog:   "/run/kata-fsx/vm/console.log",
		QMPSocket:    "/run/kata-fsx/vm/qmp.sock",
		Agent:        AgentChannel{Transport: AgentSerial, SocketPath: "/run/kata-fsx/vm/agent.sock"},
		HotplugSlots: 8,
	}
}

func testImage(virtioBlk bool) *RootImage {
	return &RootImage{Path: "/usr/share/kata-containers/kata-containers.img", Size: 128 << 20, VirtioBlk: virtioBlk}
}

func fsDev() *VhostUserFS {
	return &VhostUserFS{ID: "fs0", SocketPath: "/run/kata-fsx/vm/vhost-fs.sock"}
}

func goldenCases() map[string]func(vm *VMConfig) {
	return map[string]func(vm *VMConfig){
		"minimal_q35_tcg": func(vm *VMConfig) {
			vm.Kernel, vm.Initrd, vm.ConsoleLog, vm.HotplugSlots = "", "", "", 0
			vm.Agent = AgentChannel{}
			vm.SharedMemory = SharedMemoryOff
			vm.UUID = ""
		},
		"kvm_vsock": func(vm *VMConfig) {
			vm.Accel = AccelKVM
			vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 3}
		},
		"tcg_serial": func(vm *VMConfig) {},
		"hybrid_vsock": func(vm *VMConfig) {
			vm.Agent = AgentChannel{Transport: AgentHybridVsock, SocketPath: "/run/kata-fsx/abc/vsock/vhost.sock"}
		},
		"pc_machine": func(vm *VMConfig) { vm.MachineType = "pc" },
		"virtiofs_dax_off": func(vm *VMConfig) {
			vm.Devices = []Device{fsDev()}
		},
		"virtiofs_dax_on": func(vm *VMConfig) {
			vm.Caps = testCaps(true)
			d := fsDev()
			d.DAXWindowMiB = 1024
			vm.Devices = []Device{d}
		},
		"virtiofs_memfd_virtio_console": func(vm *VMConfig) {
			vm.SharedMemory = SharedMemoryMemfd
			vm.Console = ConsoleVirtio
			vm.Devices = []Device{&VhostUserFS{ID: "fs0", SocketPath: "/run/x,y/fs.sock", Tag: "myTag", QueueSize: 512}}
		},
		"vhost_user_blk": func(vm *VMConfig) {
			vm.Devices = []Device{&VhostUserBlk{ID: "rootfs-c1", SocketPath: "/run/kata-fsx/vm/blk-c1.sock", NumQueues: 2, QueueSize: 256}}
		},
		"virtio_9p": func(vm *VMConfig) {
			vm.SharedMemory = SharedMemoryOff
			vm.Devices = []Device{&Virtio9P{ID: "share0", Path: "/run/kata-fsx/shared/sandbox-abc"}}
		},
		"virtio_blk_raw": func(vm *VMConfig) {
			vm.Devices = []Device{&VirtioBlk{ID: "disk0", Path: "/var/lib/kata-fsx/img.raw", Cache: "none", AIO: "native", ReadOnly: true}}
		},
		// The image on an nvdimm beside guest RAM shared for a vhost-user
		// disk: memory-backend-file share=on + -numa for RAM, the image's
		// own read-only backend for the nvdimm, -m with Kata's slots/maxmem.
		"image_nvdimm_shared_memory": func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = testImage(false)
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 24*1024+1024
			vm.Devices = []Device{&VhostUserBlk{ID: "rootfs-c1", SocketPath: "/run/kata-fsx/vm/blk-c1.sock"}}
		},
		"image_nvdimm_memfd_debug": func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = testImage(false)
			vm.SharedMemory = SharedMemoryMemfd
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 4096
			vm.Debug = true
			vm.Devices = []Device{fsDev()}
		},
		// disable_image_nvdimm: a read-only virtio-blk disk, first of the
		// disks so that it is vda.
		"image_virtio_blk": func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = testImage(true)
			vm.Devices = []Device{&VhostUserBlk{ID: "rootfs-c1", SocketPath: "/run/kata-fsx/vm/blk-c1.sock"}}
		},
		"all_devices_hotmem": func(vm *VMConfig) {
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 8192
			vm.MemPath = "/dev/hugepages"
			vm.Debug = true
			vm.Paused = true
			vm.KernelParams = []string{"agent.debug_console", "systemd.unit=kata-containers.target"}
			vm.Devices = []Device{
				fsDev(),
				&VhostUserBlk{ID: "blk0", SocketPath: "/run/b.sock"},
				&Virtio9P{ID: "p9", Path: "/srv", MountTag: "extra"},
				&VirtioBlk{ID: "disk0", Path: "/img.qcow2", Format: "qcow2", Cache: "writeback", AIO: "io_uring"},
			}
		},
	}
}

func renderPlan(p *Plan) string {
	var b strings.Builder
	for _, a := range p.Args {
		b.WriteString(a)
		b.WriteByte('\n')
	}
	b.WriteString("# PCI paths\n")
	ids := make([]string, 0, len(p.PCIPaths))
	for id := range p.PCIPaths {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		fmt.Fprintf(&b, "%s %s\n", id, p.PCIPaths[id])
	}
	if p.Hotplug != nil {
		s, err := p.Hotplug.NextHotplugSlot()
		fmt.Fprintf(&b, "# first hot-plug slot\n%+v %v\n", s, err)
	}
	return b.String()
}

func checkGolden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run %s -update)", err, t.Name())
	}
	if got != string(want) {
		t.Errorf("%s mismatch:\n--- got\n%s--- want\n%s", path, got, want)
	}
}

func TestBuildGolden(t *testing.T) {
	for name, mod := range goldenCases() {
		t.Run(name, func(t *testing.T) {
			vm := baseVM()
			mod(vm)
			p, err := Build(vm)
			if err != nil {
				t.Fatal(err)
			}
			checkGolden(t, name, renderPlan(p))
		})
	}
}

// TestBuildInvariants checks properties every plan must have, independent of goldens.
func TestBuildInvariants(t *testing.T) {
	for name, mod := range goldenCases() {
		vm := baseVM()
		mod(vm)
		p, err := Build(vm)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		joined := strings.Join(p.Args, " ")
		if strings.Contains(joined, "-daemonize") {
			t.Errorf("%s: -daemonize must not be used", name)
		}
		for _, want := range []string{"-nodefaults", "-no-user-config", "-no-reboot", "-nographic", "-qmp unix:" + vm.QMPSocket + ",server=on,wait=off"} {
			if !strings.Contains(joined, want) {
				t.Errorf("%s: missing %q", name, want)
			}
		}
		hasVhost := false
		for _, d := range vm.Devices {
			hasVhost = hasVhost || d.vhostUser()
			if _, ok := p.PCIPaths[d.DeviceID()]; !ok {
				t.Errorf("%s: no PCI path for %s", name, d.DeviceID())
			}
		}
		if hasVhost && !strings.Contains(joined, "share=on") {
			t.Errorf("%s: vhost-user device without share=on memory", name)
		}
		// Every PCI slot on the root bus is used at most once.
		seen := map[PCIPath]string{}
		for id, path := range p.PCIPaths {
			if other, dup := seen[path]; dup {
				t.Errorf("%s: %s and %s share PCI path %s", name, id, other, path)
			}
			seen[path] = id
		}
		// Every -device that is a PCI device carries an explicit bus and addr.
		for i, a := range p.Args {
			if i > 0 && p.Args[i-1] == "-device" && strings.Contains(a, "-pci,") && !(strings.Contains(a, ",bus=") && strings.Contains(a, ",addr=")) {
				t.Errorf("%s: PCI device without explicit address: %s", name, a)
			}
		}
	}
}

func TestBuildErrors(t *testing.T) {
	cases := map[string]struct {
		mod  func(vm *VMConfig)
		want error
	}{
		"vhost_user_fs_without_shared_memory": {func(vm *VMConfig) {
			vm.SharedMemory = SharedMemoryOff
			vm.Devices = []Device{fsDev()}
		}, ErrSharedMemoryRequired},
		"vhost_user_blk_without_shared_memory": {func(vm *VMConfig) {
			vm.SharedMemory = SharedMemoryOff
			vm.Devices = []Device{&VhostUserBlk{ID: "b", SocketPath: "/s"}}
		}, ErrSharedMemoryRequired},
		"dax_unsupported": {func(vm *VMConfig) {
			d := fsDev()
			d.DAXWindowMiB = 1024
			vm.Devices = []Device{d}
		}, ErrDAXUnsupported},
		"dax_without_caps": {func(vm *VMConfig) {
			vm.Caps = nil
			d := fsDev()
			d.DAXWindowMiB = 1024
			vm.Devices = []Device{d}
		}, ErrDAXUnsupported},
		"dax_window_over_memory_limit": {func(vm *VMConfig) {
			vm.Caps = testCaps(true)
			d := fsDev()
			d.DAXWindowMiB = 4096
			vm.Devices = []Device{d}
		}, ErrInvalidConfig},
		"dax_window_not_power_of_two": {func(vm *VMConfig) {
			vm.Caps = testCaps(true)
			d := fsDev()
			d.DAXWindowMiB = 1000
			vm.Devices = []Device{d}
		}, ErrInvalidConfig},
		"memory_zero":     {func(vm *VMConfig) { vm.MemoryMiB = 0 }, ErrInvalidConfig},
		"memory_huge":     {func(vm *VMConfig) { vm.MemoryMiB = 1 << 40 }, ErrInvalidConfig},
		"maxmem_no_slots": {func(vm *VMConfig) { vm.MaxMemoryMiB = 4096 }, ErrInvalidConfig},
		"maxmem_below_mem": {func(vm *VMConfig) {
			vm.MemorySlots, vm.MaxMemoryMiB = 2, 1024
		}, ErrInvalidConfig},
		"vcpus_zero": {func(vm *VMConfig) { vm.VCPUs = 0 }, ErrInvalidConfig},
		"fs_queue_not_power_of_two": {func(vm *VMConfig) {
			vm.Devices = []Device{&VhostUserFS{ID: "fs0", SocketPath: "/s", QueueSize: 1000}}
		}, ErrInvalidConfig},
		"blk_queue_too_big": {func(vm *VMConfig) {
			vm.Devices = []Device{&VhostUserBlk{ID: "b", SocketPath: "/s", QueueSize: 2048}}
		}, ErrInvalidConfig},
		"no_accel":    {func(vm *VMConfig) { vm.Accel = "" }, ErrInvalidConfig},
		"bad_machine": {func(vm *VMConfig) { vm.MachineType = "virt" }, ErrInvalidConfig},
		"microvm":     {func(vm *VMConfig) { vm.Caps = nil; vm.MachineType = "microvm" }, ErrInvalidConfig},
		"vsock_cid_2": {func(vm *VMConfig) { vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 2} }, ErrInvalidConfig},
		"vsock_missing": {func(vm *VMConfig) {
			vm.Caps.Devices = []string{"virtio-serial-pci"}
			vm.Agent = AgentChannel{Transport: AgentVsock, GuestCID: 3}
		}, ErrInvalidConfig},
		"long_qmp_socket": {func(vm *VMConfig) { vm.QMPSocket = "/" + strings.Repeat("x", 120) }, ErrInvalidConfig},
		"duplicate_id": {func(vm *VMConfig) {
			vm.Devices = []Device{fsDev(), &VhostUserBlk{ID: "fs0", SocketPath: "/s"}}
		}, ErrInvalidConfig},
		"bad_id":            {func(vm *VMConfig) { vm.Devices = []Device{&Virtio9P{ID: "0bad,id", Path: "/x"}} }, ErrInvalidConfig},
		"nil_device":        {func(vm *VMConfig) { vm.Devices = []Device{nil} }, ErrInvalidConfig},
		"initrd_no_kernel":  {func(vm *VMConfig) { vm.Kernel = "" }, ErrInvalidConfig},
		"kernel_param_word": {func(vm *VMConfig) { vm.KernelParams = []string{"a b"} }, ErrInvalidConfig},
		"cmdline_too_long": {func(vm *VMConfig) {
			for i := 0; i < 200; i++ {
				vm.KernelParams = append(vm.KernelParams, fmt.Sprintf("param%d=xxxxxx", i))
			}
		}, ErrInvalidConfig},
		"aio_native_writeback": {func(vm *VMConfig) {
			vm.Devices = []Device{&VirtioBlk{ID: "d", Path: "/img", Cache: "writeback", AIO: "native"}}
		}, ErrInvalidConfig},
		"too_many_hotplug_slots": {func(vm *VMConfig) { vm.HotplugSlots = 32 }, ErrInvalidConfig},
		"too_many_devices": {func(vm *VMConfig) {
			for i := 0; i < 40; i++ {
				vm.Devices = append(vm.Devices, &Virtio9P{ID: fmt.Sprintf("p%d", i), Path: "/x"})
			}
		}, ErrInvalidConfig},
		"relative_disk_path": {func(vm *VMConfig) {
			vm.Devices = []Device{&VirtioBlk{ID: "d", Path: "nbd:evil:10809"}}
		}, ErrInvalidConfig},
		"relative_kernel":    {func(vm *VMConfig) { vm.Kernel = "vmlinux" }, ErrInvalidConfig},
		"mempath_with_memfd": {func(vm *VMConfig) { vm.SharedMemory = SharedMemoryMemfd; vm.MemPath = "/dev/shm" }, ErrInvalidConfig},
		"device_named_like_the_image": {func(vm *VMConfig) {
			vm.Devices = []Device{&VirtioBlk{ID: "image0", Path: "/img"}}
		}, ErrInvalidConfig},
		"image_and_initrd": {func(vm *VMConfig) {
			vm.Image = testImage(true)
		}, ErrInvalidConfig},
		"image_no_kernel": {func(vm *VMConfig) {
			vm.Kernel, vm.Initrd = "", ""
			vm.Image = testImage(true)
		}, ErrInvalidConfig},
		"image_relative_path": {func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = &RootImage{Path: "kata-containers.img", VirtioBlk: true}
		}, ErrInvalidConfig},
		"image_nvdimm_no_slots": {func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = testImage(false)
		}, ErrInvalidConfig},
		"image_nvdimm_no_room": {func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = testImage(false)
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 2048+127
		}, ErrInvalidConfig},
		"image_nvdimm_unaligned": {func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Image = &RootImage{Path: "/img", Size: 1000}
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 4096
		}, ErrInvalidConfig},
		"image_nvdimm_unsupported": {func(vm *VMConfig) {
			vm.Initrd = ""
			vm.Caps.Devices = []string{"pci-bridge", "virtio-serial-pci"}
			vm.Image = testImage(false)
			vm.MemorySlots, vm.MaxMemoryMiB = 10, 4096
		}, ErrInvalidConfig},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			vm := baseVM()
			c.mod(vm)
			p, err := Build(vm)
			if err == nil {
				t.Fatalf("Build succeeded: %v", p.Args)
			}
			if !errors.Is(err, c.want) || !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			checkGolden(t, "error_"+name, "error: "+err.Error()+"\n")
		})
	}
	if _, err := Build(nil); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("nil config: %v", err)
	}
}

func TestBuildDoesNotModifyInput(t *testing.T) {
	vm := baseVM()
	d := &VhostUserFS{ID: "fs0", SocketPath: "/s"}
	vm.Devices = []Device{d}
	before := fmt.Sprintf("%+v %+v", *vm, *d)
	if _, err := Build(vm); err != nil {
		t.Fatal(err)
	}
	if after := fmt.Sprintf("%+v %+v", *vm, *d); after != before {
		t.Errorf("Build modified its input:\n%s\n%s", before, after)
	}
}

func TestHotplugAllocator(t *testing.T) {
	vm := baseVM()
	vm.HotplugSlots = 3
	p, err := Build(vm)
	if err != nil {
		t.Fatal(err)
	}
	var got []HotplugSlot
	for i := 0; i < 3; i++ {
		s, err := p.Hotplug.NextHotplugSlot()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, s)
	}
	if got[0].Path != "02/01" || got[2].Path != "02/03" || got[1].Addr != "0x2" || got[1].Bus != "pci-bridge-0" {
		t.Errorf("slots = %+v", got)
	}
	if _, err := p.Hotplug.NextHotplugSlot(); !errors.Is(err, ErrNoHotplugSlot) {
		t.Fatalf("exhausted: %v", err)
	}
	if err := p.Hotplug.Release(got[1]); err != nil {
		t.Fatal(err)
	}
	if err := p.Hotplug.Release(got[1]); err == nil {
		t.Error("double release accepted")
	}
	s, err := p.Hotplug.NextHotplugSlot()
	if err != nil || s != got[1] {
		t.Errorf("reuse: %+v %v", s, err)
	}
	if props := s.Props(); props["bus"] != "pci-bridge-0" || props["addr"] != "0x2" {
		t.Errorf("props %v", props)
	}
}

func TestNewPCIPath(t *testing.T) {
	if p, err := NewPCIPath(2, 1); err != nil || p != "02/01" {
		t.Errorf("got %q %v", p, err)
	}
	if p, err := NewPCIPath(0x1f); err != nil || p.String() != "1f" {
		t.Errorf("got %q %v", p, err)
	}
	for _, bad := range [][]int{nil, {32}, {-1}, {2, 40}} {
		if _, err := NewPCIPath(bad...); err == nil {
			t.Errorf("NewPCIPath(%v) accepted", bad)
		}
	}
}

// FuzzBuild feeds arbitrary user-controlled values through Build: it must
// return a plan or an ErrInvalidConfig error, never panic, and a plan with a
// vhost-user device always has shared memory.
func FuzzBuild(f *testing.F) {
	f.Add("sandbox-1", uint64(2048), uint32(2), uint32(1024), uint64(0), "/run/fs.sock", "kataShared", "quiet", "q35", 4, uint8(0))
	f.Add("a,b", uint64(0), uint32(0), uint32(1000), uint64(4096), "rel.sock", "", "a b", "pc", 40, uint8(3))
	f.Add("x", uint64(1<<40), uint32(1), uint32(0), uint64(1<<63), "/"+strings.Repeat("s", 200), "tag,with,commas", "", "microvm", -1, uint8(1))
	// A 1 MiB image (and DAX window) on an nvdimm, then on virtio-blk.
	f.Add("img", uint64(512), uint32(1), uint32(1024), uint64(1), "/run/fs.sock", "kataShared", "quiet", "q35", 4, uint8(5))
	f.Add("img", uint64(512), uint32(1), uint32(1024), uint64(1), "/run/fs.sock", "kataShared", "quiet", "pc", 4, uint8(9))
	f.Fuzz(func(t *testing.T, name string, mem uint64, vcpus, queue uint32, dax uint64, sock, tag, param, machine string, slots int, shared uint8) {
		vm := baseVM()
		vm.Caps = testCaps(dax%2 == 1)
		vm.Name, vm.MemoryMiB, vm.VCPUs, vm.MachineType, vm.HotplugSlots = name, mem, vcpus, machine, slots
		vm.SharedMemory = []SharedMemory{SharedMemoryOff, SharedMemoryFile, SharedMemoryMemfd, "bogus"}[shared%4]
		vm.KernelParams = []string{param}
		vm.Devices = []Device{
			&VhostUserFS{ID: "fs0", SocketPath: sock, Tag: tag, QueueSize: queue, DAXWindowMiB: dax},
			&VirtioBlk{ID: "d0", Path: sock},
		}
		// The upper bits of shared pick a guest image: none, on an
		// nvdimm (sized by dax, in MiB when small) or on virtio-blk.
		imageMode := (shared / 4) % 3
		if imageMode > 0 {
			vm.Initrd = ""
			vm.Image = &RootImage{Path: sock, Size: dax, VirtioBlk: imageMode == 2}
			if dax < 1<<20 {
				vm.Image.Size = dax << 20
			}
			vm.MemorySlots, vm.MaxMemoryMiB = 10, mem+dax
		}
		p, err := Build(vm)
		if err != nil {
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("error outside ErrInvalidConfig: %v", err)
			}
			return
		}
		if !strings.Contains(strings.Join(p.Args, " "), "share=on") {
			t.Fatalf("vhost-user-fs accepted without shared memory: %v", p.Args)
		}
		if p.PCIPaths["fs0"] == "" || p.PCIPaths["d0"] == "" || p.PCIPaths["fs0"] == p.PCIPaths["d0"] {
			t.Fatalf("PCI paths %v", p.PCIPaths)
		}
		args := strings.Join(p.Args, " ")
		switch imageMode {
		case 1:
			if !strings.Contains(args, "nvdimm=on") || !strings.Contains(args, "root=/dev/pmem0p1 ") || !strings.Contains(args, ",slots=") {
				t.Fatalf("nvdimm image accepted without its machine option, root or memory slots: %v", p.Args)
			}
		case 2:
			if p.PCIPaths["image0"] == "" || p.PCIPaths["image0"] >= p.PCIPaths["d0"] || !strings.Contains(args, "root=/dev/vda1 ") {
				t.Fatalf("virtio-blk image not the first disk or without its root: %v %v", p.PCIPaths, p.Args)
			}
		}
		if imageMode > 0 && strings.Contains(args, "-initrd") {
			t.Fatalf("image and initrd both booted: %v", p.Args)
		}
	})
}
