package hypervisor

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
)

const (
	defaultMachine    = "q35"
	defaultMemPath    = "/dev/shm"
	defaultFSTag      = "kataShared"
	defaultFSQueue    = 1024
	defaultBlkQueue   = 128
	maxQueueSize      = 1024 // VIRTQUEUE_MAX_SIZE in QEMU
	maxNumQueues      = 1024 // VIRTIO_QUEUE_MAX in QEMU
	maxUnixSocketPath = 107  // sun_path is 108 bytes including the NUL
	// maxKernelCmdline is COMMAND_LINE_SIZE on x86_64; a longer -append is silently truncated by the kernel.
	maxKernelCmdline = 2048
	// maxMemoryMiB (16 TiB) keeps MiB->byte conversions far from overflow and catches unit mix-ups.
	maxMemoryMiB = 16 << 20
	maxVCPUs     = 288 // QEMU's q35 limit in 7.2
	// bridgeID names the hot-plug bridge, as Kata does.
	bridgeID = "pci-bridge-0"
	// maxBridgeSlots: slot 0 of a pci-bridge is left empty, as Kata does, leaving 1..31.
	maxBridgeSlots = 31
	// The guest image's QEMU ids, Kata's: its nvdimm backend and device, or its virtio-blk disk.
	imageMemID    = "mem0"
	imageNVDIMMID = "nv0"
	imageDiskID   = "image0"
	mib           = 1 << 20
)

// kataKernelParams are the parameters Kata passes on x86_64 to make a VM guest boot fast and quietly reboot-free.
var kataKernelParams = []string{
	"tsc=reliable", "no_timer_check", "rcupdate.rcu_expedited=1",
	"i8042.direct=1", "i8042.dumbkbd=1", "i8042.nopnp=1", "i8042.noaux=1",
	"noreplace-smp", "reboot=k", "cryptomgr.notests", "net.ifnames=0",
}

// qemuIDRE is QEMU's id_wellformed(): a letter, then letters, digits, '-', '.', '_'.
var qemuIDRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]{0,63}$`)

var uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

// Plan is the result of Build: the QEMU argv and where every device sits on the guest PCI tree.
type Plan struct {
	// Args is the argv without the binary itself.
	Args []string
	// ExtraFiles are the open files QEMU inherits, the i-th as fd 3+i
	// (exec.Cmd.ExtraFiles), which Args name by that number.
	ExtraFiles []*os.File
	// PCIPaths maps each PCI device id (devices, agent channel, console, bridge) to its guest PCI path.
	PCIPaths map[string]PCIPath
	// Hotplug allocates the reserved hot-plug slots; nil when VMConfig.HotplugSlots is 0.
	Hotplug *HotplugAllocator
}

// GuestRAMDir returns the directory whose file system holds the guest's
// RAM: MemPath (default /dev/shm) with SharedMemoryFile, where QEMU creates
// the RAM file, and "" otherwise (a memfd or private RAM lives in no file
// system with a size of its own). When that file system runs out of room,
// a first touch of a guest page raises SIGBUS in QEMU and in every
// vhost-user backend that maps the RAM.
func GuestRAMDir(vm *VMConfig) string {
	if vm.SharedMemory != SharedMemoryFile {
		return ""
	}
	if vm.MemPath != "" {
		return vm.MemPath
	}
	return defaultMemPath
}

// Build validates vm and lays out its QEMU command line in Kata's shape,
// assigning every PCI device an explicit bus and slot so the guest PCI
// path of each device is known before boot. vm is not modified.
func Build(vm *VMConfig) (*Plan, error) {
	if vm == nil {
		return nil, fmt.Errorf("%w: nil VMConfig", ErrInvalidConfig)
	}
	if err := validateVM(vm); err != nil {
		return nil, err
	}
	bus, err := newRootBus(machineOf(vm))
	if err != nil {
		return nil, err
	}
	b := &argBuilder{plan: &Plan{PCIPaths: map[string]PCIPath{}}}
	accel := vm.Accel

	b.add("-name", escapeOpt(vm.Name))
	if vm.UUID != "" {
		b.add("-uuid", vm.UUID)
	}
	machine := machineOf(vm) + ",accel=" + string(accel)
	if imageOnNVDIMM(vm) {
		machine += ",nvdimm=on"
	}
	b.add("-machine", machine)
	if accel == AccelKVM {
		b.add("-cpu", "host")
	} else {
		b.add("-cpu", "max")
	}
	b.add("-smp", strconv.FormatUint(uint64(vm.VCPUs), 10))
	mem := fmt.Sprintf("%dM", vm.MemoryMiB)
	if vm.MemorySlots > 0 {
		mem += fmt.Sprintf(",slots=%d,maxmem=%dM", vm.MemorySlots, vm.MaxMemoryMiB)
	}
	b.add("-m", mem)
	prealloc := ""
	if vm.MemPrealloc {
		prealloc = ",prealloc=on"
	}
	switch vm.SharedMemory {
	case SharedMemoryFile:
		b.add("-object", fmt.Sprintf("memory-backend-file,id=dimm1,size=%dM,mem-path=%s,share=on%s", vm.MemoryMiB, escapeOpt(GuestRAMDir(vm)), prealloc))
		b.add("-numa", "node,memdev=dimm1")
	case SharedMemoryMemfd:
		b.add("-object", fmt.Sprintf("memory-backend-memfd,id=dimm1,size=%dM,share=on%s", vm.MemoryMiB, prealloc))
		b.add("-numa", "node,memdev=dimm1")
	default:
		if vm.MemPrealloc {
			b.add("-mem-prealloc")
		}
	}
	if imageOnNVDIMM(vm) {
		// Kata's appendNvdimmImage: the image file mapped read-only as an
		// nvdimm outside guest RAM (in the -m slots/maxmem area), so it
		// coexists with the shared RAM backend above; unarmed tells the
		// guest it cannot write it.
		b.add("-object", fmt.Sprintf("memory-backend-file,id=%s,mem-path=%s,size=%d,readonly=on", imageMemID, escapeOpt(vm.Image.Path), vm.Image.Size))
		b.add("-device", fmt.Sprintf("nvdimm,id=%s,memdev=%s,unarmed=on", imageNVDIMMID, imageMemID))
	}
	b.add("-rtc", "base=utc,driftfix=slew,clock=host")
	b.add("-nographic", "-nodefaults", "-no-user-config", "-no-reboot")
	if vm.Paused {
		b.add("-S")
	}
	b.add("-qmp", "unix:"+vm.QMPSocket+",server=on,wait=off")

	// The bridge takes the first slot so hot-plugged devices get Kata's
	// familiar "02/NN" paths.
	if vm.HotplugSlots > 0 {
		loc, err := bus.next(bridgeID)
		if err != nil {
			return nil, err
		}
		b.add("-device", fmt.Sprintf("pci-bridge,id=%s,chassis_nr=1,shpc=off,%s,io-reserve=4k,mem-reserve=1m,pref64-reserve=1m", bridgeID, loc.props()))
		b.plan.PCIPaths[bridgeID] = loc.path
		b.plan.Hotplug = newHotplugAllocator(bridgeID, loc.path, vm.HotplugSlots)
	}

	console := vm.Console
	if console == "" {
		console = ConsoleSerial
	}
	if vm.ConsoleLog != "" {
		b.add("-chardev", "file,id=charconsole0,path="+escapeOpt(vm.ConsoleLog))
		if console == ConsoleSerial {
			b.add("-serial", "chardev:charconsole0")
		} else {
			loc, err := bus.next("virtio-serial-console")
			if err != nil {
				return nil, err
			}
			b.add("-device", "virtio-serial-pci,id=virtio-serial-console,"+loc.props())
			b.add("-device", "virtconsole,chardev=charconsole0,id=console0")
			b.plan.PCIPaths["virtio-serial-console"] = loc.path
		}
	}

	if err := b.agentChannel(vm, bus); err != nil {
		return nil, err
	}

	// The image disk goes before the other disks, so the guest names it vda
	// (root=/dev/vda1) whatever else is cold-plugged.
	if img := imageDisk(vm); img != nil {
		loc, err := bus.next(img.ID)
		if err != nil {
			return nil, err
		}
		b.add(img.args(loc)...)
		b.plan.PCIPaths[img.ID] = loc.path
	}

	for _, d := range vm.Devices {
		loc, err := bus.next(d.DeviceID())
		if err != nil {
			return nil, err
		}
		b.add(d.args(loc)...)
		b.plan.PCIPaths[d.DeviceID()] = loc.path
	}
	if err := b.nics(vm, bus); err != nil {
		return nil, err
	}

	if vm.Kernel != "" {
		b.add("-kernel", vm.Kernel)
		if vm.Initrd != "" {
			b.add("-initrd", vm.Initrd)
		}
		b.add("-append", kernelCmdline(vm, console))
	}
	return b.plan, nil
}

// kernelCmdline is Kata's defaults, then ours, then the user's parameters
// last so they win where the kernel takes the last occurrence.
func kernelCmdline(vm *VMConfig, console ConsoleKind) string {
	params := append([]string(nil), kataKernelParams...)
	if console == ConsoleVirtio {
		params = append(params, "console=hvc0")
	} else {
		params = append(params, "console=ttyS0")
	}
	params = append(params, "panic=1", fmt.Sprintf("nr_cpus=%d", vm.VCPUs))
	params = append(params, imageRootParams(vm)...)
	if vm.Debug {
		params = append(params, "debug", "agent.log=debug")
	} else {
		params = append(params, "quiet")
	}
	if vm.Image != nil {
		// Kata adds these for every image guest (a systemd image boots
		// with them); an agent-as-init image ignores them.
		if vm.Debug {
			params = append(params, "systemd.show_status=true", "systemd.log_level=debug")
		} else {
			params = append(params, "systemd.show_status=false")
		}
	}
	params = append(params, vm.KernelParams...)
	return strings.Join(params, " ")
}

// imageRootParams are Kata's GetKernelRootParams for an ext4 image: the
// first partition of the nvdimm, mounted with DAX, or of the virtio-blk
// disk; read-only either way.
func imageRootParams(vm *VMConfig) []string {
	switch {
	case vm.Image == nil:
		return nil
	case vm.Image.VirtioBlk:
		return []string{"root=/dev/vda1", "rootflags=data=ordered,errors=remount-ro", "ro", "rootfstype=ext4"}
	default:
		return []string{"root=/dev/pmem0p1", "rootflags=dax,data=ordered,errors=remount-ro", "ro", "rootfstype=ext4"}
	}
}

func imageOnNVDIMM(vm *VMConfig) bool { return vm.Image != nil && !vm.Image.VirtioBlk }

// imageDisk is the read-only virtio-blk disk of an image booted with
// disable_image_nvdimm, or nil. Its cache mode is Kata's default for block
// devices (block_device_cache_direct = false: the host page cache, which
// also works where O_DIRECT does not, e.g. on tmpfs).
func imageDisk(vm *VMConfig) *VirtioBlk {
	if vm.Image == nil || !vm.Image.VirtioBlk {
		return nil
	}
	return &VirtioBlk{ID: imageDiskID, Path: vm.Image.Path, Format: "raw", Cache: "writeback", ReadOnly: true}
}

type argBuilder struct {
	plan *Plan
}

func (b *argBuilder) add(args ...string) { b.plan.Args = append(b.plan.Args, args...) }

func machineOf(vm *VMConfig) string {
	if vm.MachineType == "" {
		return defaultMachine
	}
	return vm.MachineType
}

// escapeOpt doubles commas, QEMU's escape inside a key=value option list.
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, a...))
}

func validateVM(vm *VMConfig) error {
	if vm.Name == "" || strings.ContainsFunc(vm.Name, isControl) {
		return invalid("name %q must be non-empty printable text", vm.Name)
	}
	if vm.UUID != "" && !uuidRE.MatchString(vm.UUID) {
		return invalid("uuid %q is not a UUID", vm.UUID)
	}
	switch vm.Accel {
	case AccelKVM, AccelTCG:
	default:
		return invalid("accelerator %q: want %q or %q (see DetectAccel)", vm.Accel, AccelKVM, AccelTCG)
	}
	if vm.VCPUs == 0 || vm.VCPUs > maxVCPUs {
		return invalid("vcpus %d: want 1..%d", vm.VCPUs, maxVCPUs)
	}
	if vm.MemoryMiB == 0 {
		return invalid("memory size 0: default_memory must be at least 1 MiB")
	}
	if vm.MemoryMiB > maxMemoryMiB {
		return invalid("memory size %d MiB exceeds %d MiB (units are MiB)", vm.MemoryMiB, maxMemoryMiB)
	}
	if (vm.MemorySlots == 0) != (vm.MaxMemoryMiB == 0) {
		return invalid("memory slots (%d) and max memory (%d MiB) must be set together", vm.MemorySlots, vm.MaxMemoryMiB)
	}
	if vm.MemorySlots > 0 && (vm.MaxMemoryMiB < vm.MemoryMiB || vm.MaxMemoryMiB > maxMemoryMiB) {
		return invalid("max memory %d MiB must be between memory %d MiB and %d MiB", vm.MaxMemoryMiB, vm.MemoryMiB, maxMemoryMiB)
	}
	switch vm.SharedMemory {
	case SharedMemoryOff, SharedMemoryMemfd:
		if vm.MemPath != "" {
			return invalid("mem path %q is only used with shared memory %q", vm.MemPath, SharedMemoryFile)
		}
	case SharedMemoryFile:
	default:
		return invalid("shared memory %q: want %q, %q or off", vm.SharedMemory, SharedMemoryFile, SharedMemoryMemfd)
	}
	if vm.Caps != nil && !vm.Caps.HasMachine(machineOf(vm)) {
		return invalid("machine type %q is not supported by %s", machineOf(vm), vm.Caps.Path)
	}
	if vm.Initrd != "" && vm.Kernel == "" {
		return invalid("initrd %q given without a kernel", vm.Initrd)
	}
	if err := validateImage(vm); err != nil {
		return err
	}
	for _, f := range []struct{ what, path string }{{"kernel", vm.Kernel}, {"initrd", vm.Initrd}, {"console log", vm.ConsoleLog}, {"mem path", vm.MemPath}} {
		if f.path != "" {
			if err := checkFilePath(f.what, f.path); err != nil {
				return err
			}
		}
	}
	for _, p := range vm.KernelParams {
		if p == "" || strings.ContainsFunc(p, isControl) || strings.Contains(p, " ") {
			return invalid("kernel parameter %q must be one non-empty word", p)
		}
	}
	if vm.Kernel != "" {
		if n := len(kernelCmdline(vm, vm.Console)); n >= maxKernelCmdline {
			return invalid("kernel command line is %d bytes; the kernel keeps only %d", n, maxKernelCmdline-1)
		}
	}
	switch vm.Console {
	case "", ConsoleSerial, ConsoleVirtio:
	default:
		return invalid("console %q: want %q or %q", vm.Console, ConsoleSerial, ConsoleVirtio)
	}
	if vm.Console == ConsoleVirtio && vm.ConsoleLog != "" {
		if err := needDevice(vm, "virtio-serial-pci"); err != nil {
			return err
		}
	}
	if err := checkSocketPath("QMP socket", vm.QMPSocket); err != nil {
		return err
	}
	if strings.Contains(vm.QMPSocket, ",") {
		return invalid("QMP socket path %q must not contain a comma", vm.QMPSocket)
	}
	if err := validateAgent(vm); err != nil {
		return err
	}
	if vm.HotplugSlots < 0 || vm.HotplugSlots > maxBridgeSlots {
		return invalid("hot-plug slots %d: want 0..%d", vm.HotplugSlots, maxBridgeSlots)
	}
	if vm.HotplugSlots > 0 {
		if err := needDevice(vm, "pci-bridge"); err != nil {
			return err
		}
	}
	ids := map[string]bool{bridgeID: true, "serial0": true, "channel0": true, "console0": true, "virtio-serial-console": true, vsockDeviceID(vm.Agent.GuestCID): true, hybridVsockID: true}
	for _, id := range []string{imageMemID, imageNVDIMMID, imageDiskID} {
		ids[id] = true
	}
	for i, d := range vm.Devices {
		if d == nil {
			return invalid("device %d is nil", i)
		}
		id := d.DeviceID()
		if !qemuIDRE.MatchString(id) {
			return invalid("device id %q: want a letter then letters, digits, '-', '.', '_' (at most 64)", id)
		}
		if ids[id] {
			return invalid("device id %q is used twice", id)
		}
		ids[id] = true
		if d.vhostUser() && vm.SharedMemory == SharedMemoryOff {
			return fmt.Errorf("device %s (%s): %w", id, d.driver(), ErrSharedMemoryRequired)
		}
		if err := needDevice(vm, d.driver()); err != nil {
			return err
		}
		if err := d.validate(vm); err != nil {
			return fmt.Errorf("device %s (%s): %w", id, d.driver(), err)
		}
	}
	return validateNICs(vm, ids)
}

// validateImage checks the guest image against Kata's rules (image and
// initrd exclusive) and QEMU's (an nvdimm lives in the hot-plug memory area
// of -m slots/maxmem, which must have room for it).
func validateImage(vm *VMConfig) error {
	img := vm.Image
	if img == nil {
		return nil
	}
	if vm.Initrd != "" {
		return invalid("image %q and initrd %q: cannot set both image and initrd at the same time", img.Path, vm.Initrd)
	}
	if vm.Kernel == "" {
		return invalid("image %q given without a kernel", img.Path)
	}
	if err := checkFilePath("image", img.Path); err != nil {
		return err
	}
	if img.VirtioBlk {
		return needDevice(vm, "virtio-blk-pci")
	}
	if img.Size > maxMemoryMiB*mib {
		return invalid("image %q is %d bytes: an nvdimm image above %d MiB is surely a mistake", img.Path, img.Size, uint64(maxMemoryMiB))
	}
	if img.Size == 0 || img.Size%4096 != 0 {
		return invalid("image %q is %d bytes: an nvdimm needs a non-empty multiple of 4 KiB (Kata's images are multiples of 128 MiB)", img.Path, img.Size)
	}
	need := vm.MemoryMiB + (img.Size+mib-1)/mib
	if vm.MemorySlots == 0 || vm.MaxMemoryMiB < need {
		return invalid("image %q on an nvdimm needs memory slots and a max memory of at least memory + image (%d MiB), have %d slots and %d MiB", img.Path, need, vm.MemorySlots, vm.MaxMemoryMiB)
	}
	return needDevice(vm, "nvdimm")
}

func needDevice(vm *VMConfig, driver string) error {
	if vm.Caps != nil && !vm.Caps.HasDevice(driver) {
		return invalid("device %s is not supported by %s", driver, vm.Caps.Path)
	}
	return nil
}

func checkSocketPath(what, p string) error {
	if err := checkFilePath(what, p); err != nil {
		return err
	}
	if len(p) > maxUnixSocketPath {
		return invalid("%s path %q is %d bytes; unix sockets allow %d", what, p, len(p), maxUnixSocketPath)
	}
	if strings.ContainsFunc(p, isControl) {
		return invalid("%s path %q contains control characters", what, p)
	}
	return nil
}

// checkFilePath insists on absolute paths: QEMU reads "proto:..." in
// -drive file= as a protocol (nbd:, http:), which a relative path could spell.
func checkFilePath(what, p string) error {
	if p == "" {
		return invalid("%s path is empty", what)
	}
	if !strings.HasPrefix(p, "/") {
		return invalid("%s path %q must be absolute", what, p)
	}
	if strings.ContainsFunc(p, isControl) {
		return invalid("%s path %q contains control characters", what, p)
	}
	return nil
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

func isPowerOfTwo(n uint64) bool { return n != 0 && n&(n-1) == 0 }

func checkQueueSize(n uint32) error {
	if !isPowerOfTwo(uint64(n)) || n > maxQueueSize {
		return invalid("queue size %d must be a power of two between 1 and %d", n, maxQueueSize)
	}
	return nil
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

func (d *VhostUserFS) validate(vm *VMConfig) error {
	if err := checkSocketPath("virtiofsd socket", d.SocketPath); err != nil {
		return err
	}
	tag := orDefault(d.Tag, defaultFSTag)
	// virtio_fs_config.tag is 36 bytes.
	if len(tag) > 36 || strings.ContainsAny(tag, ",\x00 ") {
		return invalid("tag %q must be at most 36 bytes without commas or spaces", tag)
	}
	if err := checkQueueSize(orDefault(d.QueueSize, defaultFSQueue)); err != nil {
		return err
	}
	if d.DAXWindowMiB > 0 {
		if vm.Caps == nil || !vm.Caps.DAX {
			return ErrDAXUnsupported
		}
		// The window is a 64-bit BAR: the patched QEMU wants a power of two.
		if !isPowerOfTwo(d.DAXWindowMiB) {
			return invalid("DAX window %d MiB must be a power of two", d.DAXWindowMiB)
		}
		limit := vm.MemoryMiB
		if vm.MaxMemoryMiB > limit {
			limit = vm.MaxMemoryMiB
		}
		// A window bigger than all guest RAM only wastes guest address space
		// and host mappings; it is almost always a MiB/byte mix-up.
		if d.DAXWindowMiB > limit {
			return invalid("DAX window %d MiB exceeds the VM memory limit of %d MiB", d.DAXWindowMiB, limit)
		}
	}
	return nil
}

func (d *VhostUserFS) args(loc pciLocation) []string {
	dev := fmt.Sprintf("vhost-user-fs-pci,id=%s,chardev=char-%s,tag=%s,queue-size=%d", d.ID, d.ID, escapeOpt(orDefault(d.Tag, defaultFSTag)), orDefault(d.QueueSize, defaultFSQueue))
	if d.DAXWindowMiB > 0 {
		dev += fmt.Sprintf(",cache-size=%dM", d.DAXWindowMiB)
	}
	return []string{
		"-chardev", fmt.Sprintf("socket,id=char-%s,path=%s", d.ID, escapeOpt(d.SocketPath)),
		"-device", dev + "," + loc.props(),
	}
}

func (d *VhostUserBlk) validate(vm *VMConfig) error {
	if err := checkSocketPath("vhost-user-blk socket", d.SocketPath); err != nil {
		return err
	}
	if n := orDefault(d.NumQueues, 1); n > maxNumQueues {
		return invalid("num-queues %d exceeds %d", n, maxNumQueues)
	}
	return checkQueueSize(orDefault(d.QueueSize, defaultBlkQueue))
}

func (d *VhostUserBlk) args(loc pciLocation) []string {
	return []string{
		"-chardev", fmt.Sprintf("socket,id=char-%s,path=%s", d.ID, escapeOpt(d.SocketPath)),
		"-device", fmt.Sprintf("vhost-user-blk-pci,id=%s,chardev=char-%s,num-queues=%d,queue-size=%d,%s", d.ID, d.ID, orDefault(d.NumQueues, 1), orDefault(d.QueueSize, defaultBlkQueue), loc.props()),
	}
}

func (d *Virtio9P) validate(vm *VMConfig) error {
	if err := checkFilePath("9p share", d.Path); err != nil {
		return err
	}
	tag := orDefault(d.MountTag, defaultFSTag)
	if tag == "" || len(tag) > 31 || strings.ContainsAny(tag, ", \x00") {
		return invalid("mount tag %q must be 1..31 bytes without commas or spaces", tag)
	}
	return nil
}

func (d *Virtio9P) args(loc pciLocation) []string {
	return []string{
		"-fsdev", fmt.Sprintf("local,id=fsdev-%s,path=%s,security_model=none,multidevs=remap", d.ID, escapeOpt(d.Path)),
		"-device", fmt.Sprintf("virtio-9p-pci,id=%s,fsdev=fsdev-%s,mount_tag=%s,%s", d.ID, d.ID, escapeOpt(orDefault(d.MountTag, defaultFSTag)), loc.props()),
	}
}

func (d *VirtioBlk) validate(vm *VMConfig) error {
	if err := checkFilePath("disk", d.Path); err != nil {
		return err
	}
	switch orDefault(d.Format, "raw") {
	case "raw", "qcow2":
	default:
		return invalid("disk format %q: want raw or qcow2", d.Format)
	}
	cache := orDefault(d.Cache, "none")
	switch cache {
	case "none", "writeback", "writethrough", "directsync", "unsafe":
	default:
		return invalid("disk cache %q: want none, writeback, writethrough, directsync or unsafe", d.Cache)
	}
	switch orDefault(d.AIO, "threads") {
	case "threads", "io_uring":
	case "native":
		// Linux AIO only works on O_DIRECT files; QEMU refuses it otherwise.
		if cache != "none" && cache != "directsync" {
			return invalid("aio=native needs cache=none or cache=directsync, not %q", cache)
		}
	default:
		return invalid("disk aio %q: want threads, native or io_uring", d.AIO)
	}
	return nil
}

func (d *VirtioBlk) args(loc pciLocation) []string {
	drive := fmt.Sprintf("file=%s,format=%s,if=none,id=drive-%s,cache=%s,aio=%s", escapeOpt(d.Path), orDefault(d.Format, "raw"), d.ID, orDefault(d.Cache, "none"), orDefault(d.AIO, "threads"))
	if d.ReadOnly {
		drive += ",readonly=on"
	}
	return []string{
		"-drive", drive,
		"-device", fmt.Sprintf("virtio-blk-pci,id=%s,drive=drive-%s,%s", d.ID, d.ID, loc.props()),
	}
}
