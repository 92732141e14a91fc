package hypervisor

import (
	"errors"
	"fmt"
	"os"
)

// Errors returned by Build when a VMConfig cannot give a working VM.
var (
	// ErrInvalidConfig is wrapped by every configuration error.
	ErrInvalidConfig = errors.New("invalid VM configuration")
	// ErrSharedMemoryRequired reports a vhost-user device on private guest memory.
	ErrSharedMemoryRequired = fmt.Errorf("%w: vhost-user devices need shared guest memory (shared memory is required: without share=on the backend cannot map guest RAM and the guest hangs on the first file operation)", ErrInvalidConfig)
	// ErrDAXUnsupported reports a DAX window on a QEMU without vhost-user-fs-pci cache-size.
	ErrDAXUnsupported = fmt.Errorf("%w: virtio-fs DAX is not supported by this QEMU (vhost-user-fs-pci has no cache-size property; upstream QEMU never merged it): set virtio_fs_cache_size = 0", ErrInvalidConfig)
	// ErrNoHotplugSlot reports that every reserved hot-plug slot is in use.
	ErrNoHotplugSlot = errors.New("no free PCI hot-plug slot")
)

// SharedMemory selects how guest RAM is backed.
type SharedMemory string

// Guest RAM backends.
const (
	// SharedMemoryOff keeps guest RAM private to QEMU; vhost-user devices cannot work.
	SharedMemoryOff SharedMemory = ""
	// SharedMemoryFile backs RAM with a share=on file under MemPath (default /dev/shm), as Kata does.
	SharedMemoryFile SharedMemory = "file"
	// SharedMemoryMemfd backs RAM with a share=on memfd.
	SharedMemoryMemfd SharedMemory = "memfd"
)

// ConsoleKind selects the guest console device.
type ConsoleKind string

// Guest consoles.
const (
	// ConsoleSerial is the ISA serial port (ttyS0): built into every kernel, so early boot messages show.
	ConsoleSerial ConsoleKind = "serial"
	// ConsoleVirtio is a virtio console (hvc0), as Kata uses; it needs virtio_console in the guest.
	ConsoleVirtio ConsoleKind = "virtio"
)

// AgentTransport selects the channel the guest agent's ttrpc stream uses.
type AgentTransport string

// Agent channels.
const (
	// AgentVsock is vhost-vsock-pci; needs /dev/vhost-vsock on the host. The agent listens on vsock port 1024.
	AgentVsock AgentTransport = "vsock"
	// AgentHybridVsock is vhost-user-vsock-pci, its backend (the guest's vsock device) served by kata-fsx over a vhost-user socket.
	AgentHybridVsock AgentTransport = "hybrid-vsock"
	// AgentSerial is a virtio-serial port named agent.channel.0 behind a unix socket QEMU listens on.
	AgentSerial AgentTransport = "serial"
)

// AgentChannel configures the host<->agent channel.
type AgentChannel struct {
	Transport AgentTransport
	// GuestCID is the guest's vsock context id (3..MaxGuestCID) for AgentVsock.
	GuestCID uint32
	// VhostFD, for AgentVsock, is an open /dev/vhost-vsock that already
	// holds GuestCID (FindContextID); QEMU inherits it as vhostfd=, as
	// Kata passes it. Nil lets QEMU open the device itself. The caller
	// owns it and closes it once QEMU has exited.
	VhostFD *os.File
	// SocketPath is the unix socket QEMU listens on for AgentSerial, and
	// the vhost-user socket of the vsock backend QEMU connects to for
	// AgentHybridVsock (the backend must listen before Start).
	SocketPath string
}

// VMConfig is everything Build and Start need to run one sandbox VM.
// Sizes are in MiB as in configuration.toml.
type VMConfig struct {
	// Name is the VM name (-name); ID-like, e.g. "sandbox-<id>".
	Name string
	// UUID is the SMBIOS UUID (-uuid); optional.
	UUID string
	// Dir is the per-VM runtime directory Start creates (0700) and Stop removes.
	Dir string
	// QEMUPath is the qemu-system binary.
	QEMUPath string
	// Caps is the Probe result for QEMUPath; Build uses it to refuse devices or DAX the binary lacks.
	Caps *Caps

	// MachineType is a q35 or pc machine type (default "q35").
	MachineType string
	// Accel is the accelerator (see DetectAccel); -cpu host with KVM, -cpu max with TCG.
	Accel Accel
	VCPUs uint32
	// MemoryMiB is the boot RAM size.
	MemoryMiB uint64
	// MemorySlots and MaxMemoryMiB reserve room for memory hot-plug; both or neither.
	MemorySlots  uint32
	MaxMemoryMiB uint64
	// SharedMemory selects the RAM backend; mandatory for vhost-user devices.
	SharedMemory SharedMemory
	// MemPath is the directory for SharedMemoryFile (default /dev/shm).
	MemPath string
	// MemPrealloc allocates all guest RAM when QEMU starts (Kata's
	// enable_mem_prealloc): prealloc=on on the shared backend, -mem-prealloc
	// without one.
	MemPrealloc bool

	// Kernel, Initrd and KernelParams boot the guest; with no Kernel the VM only runs firmware.
	Kernel       string
	Initrd       string
	KernelParams []string
	// Image is the guest root filesystem image booted instead of an initrd (Kata's `image`); nil for none.
	Image *RootImage
	// Debug turns on guest kernel and agent debug output instead of "quiet".
	Debug bool

	// Console selects the console device (default ConsoleSerial); ConsoleLog is the host file it writes to (none if empty).
	Console    ConsoleKind
	ConsoleLog string
	// QMPSocket is the unix socket path QEMU listens on for QMP (Start defaults it to Dir/qmp.sock).
	QMPSocket string
	// Agent is the agent channel.
	Agent AgentChannel
	// Devices are cold-plugged in order, each on its own root-bus slot.
	Devices []Device
	// NICs are cold-plugged after Devices, each on its own root-bus slot.
	NICs []*NIC
	// HotplugSlots reserves this many slots (at most 31) behind a pci-bridge for device_add.
	HotplugSlots int
	// Paused starts QEMU with its CPUs stopped (-S); QMP cont starts them.
	Paused bool
	// StderrLog is where QEMU's stderr is copied (Start defaults it to Dir/qemu.log).
	StderrLog string
}

// RootImage is a guest root filesystem image in Kata's layout (an MBR disk
// whose first partition is the ext4 root, with the nvdimm DAX header Kata's
// image builder writes), attached read-only as Kata attaches it on QEMU.
type RootImage struct {
	// Path is the image file.
	Path string
	// Size is the file's size in bytes: the nvdimm's size, as Kata sizes it at boot.
	Size uint64
	// VirtioBlk puts the image on a read-only virtio-blk disk (root=/dev/vda1)
	// instead of an nvdimm (root=/dev/pmem0p1, DAX): Kata's disable_image_nvdimm.
	VirtioBlk bool
}

// Device is a cold-plugged PCI device: *VhostUserFS, *VhostUserBlk, *Virtio9P or *VirtioBlk.
type Device interface {
	// DeviceID is the QEMU id of the device, unique in the VM.
	DeviceID() string
	driver() string
	vhostUser() bool
	validate(vm *VMConfig) error
	args(loc pciLocation) []string
}

// VhostUserFS is a virtio-fs share served by virtiofsd over vhost-user.
type VhostUserFS struct {
	ID string
	// SocketPath is virtiofsd's vhost-user socket.
	SocketPath string
	// Tag is the mount tag (default "kataShared").
	Tag string
	// QueueSize is the virtqueue size (default 1024, a power of two).
	QueueSize uint32
	// DAXWindowMiB is the DAX cache window (virtio_fs_cache_size); 0 disables DAX.
	DAXWindowMiB uint64
}

// VhostUserBlk is a disk served over vhost-user (imagefs-blk or qemu-storage-daemon).
type VhostUserBlk struct {
	ID         string
	SocketPath string
	// NumQueues must match the backend's queue count (default 1).
	NumQueues uint32
	// QueueSize is the virtqueue size (default 128, a power of two).
	QueueSize uint32
}

// Virtio9P is a 9p share of a host directory (deprecated; for comparison only).
type Virtio9P struct {
	ID   string
	Path string
	// MountTag defaults to "kataShared".
	MountTag string
}

// VirtioBlk is a virtio-blk disk on a host file, handled by QEMU's own block layer.
type VirtioBlk struct {
	ID   string
	Path string
	// Format is the image format (default "raw").
	Format string
	// Cache is the -drive cache mode (default "none"): none, writeback, writethrough, directsync or unsafe.
	Cache string
	// AIO is the -drive aio mode (default "threads"): threads, native or io_uring.
	AIO      string
	ReadOnly bool
}

// DeviceID implements Device.
func (d *VhostUserFS) DeviceID() string { return d.ID }

// DeviceID implements Device.
func (d *VhostUserBlk) DeviceID() string { return d.ID }

// DeviceID implements Device.
func (d *Virtio9P) DeviceID() string { return d.ID }

// DeviceID implements Device.
func (d *VirtioBlk) DeviceID() string { return d.ID }

func (d *VhostUserFS) driver() string  { return "vhost-user-fs-pci" }
func (d *VhostUserBlk) driver() string { return "vhost-user-blk-pci" }
func (d *Virtio9P) driver() string     { return "virtio-9p-pci" }
func (d *VirtioBlk) driver() string    { return "virtio-blk-pci" }

func (d *VhostUserFS) vhostUser() bool  { return true }
func (d *VhostUserBlk) vhostUser() bool { return true }
func (d *Virtio9P) vhostUser() bool     { return false }
func (d *VirtioBlk) vhostUser() bool    { return false }

var (
	_ Device = (*VhostUserFS)(nil)
	_ Device = (*VhostUserBlk)(nil)
	_ Device = (*Virtio9P)(nil)
	_ Device = (*VirtioBlk)(nil)
)
