// Package host probes the machine pods run on, once, for everyone who
// needs to know: the shim boots a pod (through package sandbox) with what
// Probe finds, and `kata-fsx env`, `kata-fsx check` and `kata-fsx bench`
// report the same Host, so what env prints is what a pod on this host
// gets, with the reason for each choice.
//
// The agent transport is decided here and nowhere else (chooseTransport).
// agent_transport = "auto" takes, in order: vhost-vsock (as Kata on QEMU:
// /dev/vhost-vsock opens and QEMU has vhost-vsock-pci), hybrid vsock
// (QEMU has vhost-user-vsock-pci, served in process by kata-fsx, and guest
// RAM can be shared, see GuestRAM), then a virtio-serial port,
// which only kata-fsx's test agent speaks. "vsock" is Kata's meaning:
// vhost-vsock, else hybrid vsock. An explicit choice that cannot work on
// this host resolves to itself with TransportErr set, naming the key and
// the fix: the refusal every pod gets, which env and check report.
//
// Guest RAM that vhost-user backends map is decided here too (guestRAM):
// a share=on memfd wherever memfd_create works, unless file_mem_backend
// names a directory, which keeps Kata's meaning (a share=on file there).
// A memfd lives in no file system anyone else can write: a share=on file
// in /dev/shm, Kata's default, lives in a tmpfs every local user can fill
// (mode 1777), and a guest whose next page finds it full takes SIGBUS,
// which kills QEMU. /dev/shm is the fallback only where memfd fails.
package host

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// ErrTransportUnavailable is wrapped by TransportErr when no agent
// transport the configuration allows works on this host.
var ErrTransportUnavailable = errors.New("agent transport unavailable on this host")

// Host is what one probe learned about the machine for one configuration.
type Host struct {
	// QEMU is what hypervisor.Probe found at hypervisor.qemu.path; nil,
	// with QEMUErr set, when that binary could not be probed.
	QEMU    *hypervisor.Caps
	QEMUErr error

	// Daemon is the virtio_fs_daemon's flavour and version; nil when no
	// daemon is configured (DaemonErr nil too) or it could not be detected.
	Daemon    *virtiofs.Daemon
	DaemonErr error

	// Accel is the accelerator pods boot with and AccelReason why;
	// AccelCacheDir is where the KVM boot probe's verdict is cached.
	Accel         hypervisor.Accel
	AccelReason   string
	AccelCacheDir string

	// Vsock reports whether /dev/vhost-vsock opens; VsockReason says why not.
	Vsock       bool
	VsockReason string

	// Transport is the agent transport pods get (config.TransportVsock for
	// vhost-vsock, config.TransportHybridVsock or
	// config.TransportVirtioSerial) and TransportReason why; TransportErr,
	// when set, is the shim's refusal of every pod, Transport then being
	// the setting that cannot work.
	Transport       string
	TransportReason string
	TransportErr    error

	// Memfd reports whether memfd_create works; MemfdReason says why not.
	Memfd       bool
	MemfdReason string

	// ShmFreeMiB is the free space of /dev/shm, meaningful when ShmErr is nil.
	ShmFreeMiB uint64
	ShmErr     error

	// GuestRAM is how guest RAM is backed in a pod whose RAM vhost-user
	// backends map (virtio-fs, imagefs-blk, hybrid vsock):
	// hypervisor.SharedMemoryMemfd, or hypervisor.SharedMemoryFile with
	// the file in GuestRAMDir; hypervisor.SharedMemoryOff when it cannot
	// be shared at all. GuestRAMReason says why.
	GuestRAM       hypervisor.SharedMemory
	GuestRAMDir    string
	GuestRAMReason string

	// Memory is /proc/meminfo's view, meaningful when MemoryErr is nil.
	Memory    Memory
	MemoryErr error

	// System names the host's kernel, distribution and CPU.
	System System
}

// Memory is the host's memory in KiB, as /proc/meminfo (and kata-runtime env) report it.
type Memory struct {
	TotalKiB, FreeKiB, AvailableKiB uint64
}

// System is the host's identity as kata-runtime env reports it.
type System struct {
	Kernel        string // uname release
	Architecture  string // GOARCH
	DistroName    string // os-release NAME
	DistroVersion string // os-release VERSION_ID
	CPUVendor     string
	CPUModel      string
	CPUs          int
}

// Probe learns everything a pod with configuration c depends on: QEMU's
// devices, the virtiofsd flavour, the accelerator (a KVM boot probe when
// /dev/kvm is usable, its verdict cached), vsock, memfd, /dev/shm and
// memory. What it cannot learn is recorded in the Err fields, never
// returned: env and check report it, the sandbox refuses to boot on it.
func Probe(ctx context.Context, c *config.Config) *Host {
	q := c.QEMU()
	h := &Host{AccelCacheDir: AccelCacheDir(c)}
	if caps, err := hypervisor.Probe(ctx, q.Path); err != nil {
		h.QEMUErr = fmt.Errorf("hypervisor.qemu.path: %w", err)
	} else {
		h.QEMU = caps
	}
	if q.VirtioFSDaemon != "" {
		if d, err := virtiofs.Detect(ctx, q.VirtioFSDaemon); err != nil {
			h.DaemonErr = fmt.Errorf("hypervisor.qemu.virtio_fs_daemon: %w", err)
		} else {
			h.Daemon = d
		}
	}
	h.Accel, h.AccelReason = hypervisor.ChooseAccel(ctx, c.KataFSX.Accelerator, q.Path, q.Kernel, h.AccelCacheDir)
	h.Vsock, h.VsockReason = hypervisor.VsockAvailable()
	h.Memfd, h.MemfdReason = hypervisor.MemfdAvailable()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		h.ShmErr = fmt.Errorf("statfs /dev/shm: %w", err)
	} else {
		h.ShmFreeMiB = st.Bavail * uint64(st.Bsize) >> 20
	}
	tf := transportFacts{
		caps: h.QEMU, vsock: h.Vsock, vsockWhy: h.VsockReason,
		memfd: h.Memfd, memfdWhy: h.MemfdReason, shmErr: h.ShmErr, fileMemBackend: q.FileMemBackend,
	}
	h.GuestRAM, h.GuestRAMDir, h.GuestRAMReason = tf.guestRAM()
	h.Transport, h.TransportReason, h.TransportErr = chooseTransport(c.KataFSX.AgentTransport, tf)
	h.Memory, h.MemoryErr = readMeminfo("/proc/meminfo")
	h.System = probeSystem()
	return h
}

// transportFacts is what the agent transport depends on.
type transportFacts struct {
	// caps is QEMU's probe; nil when it failed, which rules out no
	// transport here (the sandbox refuses the pod on QEMUErr anyway).
	caps     *hypervisor.Caps
	vsock    bool // /dev/vhost-vsock opens
	vsockWhy string
	memfd    bool
	memfdWhy string
	shmErr   error
	// fileMemBackend is hypervisor.qemu.file_mem_backend.
	fileMemBackend string
}

// guestRAM decides how shared guest RAM is backed; see the package doc.
func (f transportFacts) guestRAM() (mem hypervisor.SharedMemory, dir, why string) {
	switch {
	case f.fileMemBackend != "":
		return hypervisor.SharedMemoryFile, f.fileMemBackend, "a share=on file in " + f.fileMemBackend + " (hypervisor.qemu.file_mem_backend)"
	case f.memfd:
		return hypervisor.SharedMemoryMemfd, "", "a share=on memfd (no file system other users can fill)"
	case f.shmErr == nil:
		return hypervisor.SharedMemoryFile, "/dev/shm", "a share=on file in /dev/shm, as memfd_create fails (" + f.memfdWhy + "): every local user can fill /dev/shm, and a guest that then touches a new page dies of SIGBUS"
	}
	return hypervisor.SharedMemoryOff, "", fmt.Sprintf("guest RAM cannot be shared: %s, and %v", f.memfdWhy, f.shmErr)
}

// vhostVsock says whether vhost-vsock works, and why or why not.
func (f transportFacts) vhostVsock() (bool, string) {
	switch {
	case !f.vsock:
		return false, f.vsockWhy
	case !f.has("vhost-vsock-pci"):
		return false, "QEMU has no vhost-vsock-pci"
	}
	return true, "/dev/vhost-vsock opens and QEMU has vhost-vsock-pci"
}

// hybridVsock says whether hybrid vsock works, and why or why not: the
// in-process device is a vhost-user backend, so guest RAM must be shared.
func (f transportFacts) hybridVsock() (bool, string) {
	if !f.has("vhost-user-vsock-pci") {
		return false, "QEMU has no vhost-user-vsock-pci"
	}
	mem, _, why := f.guestRAM()
	if mem == hypervisor.SharedMemoryOff {
		return false, fmt.Sprintf("the in-process vsock device cannot map guest RAM: %s", why)
	}
	return true, "QEMU has vhost-user-vsock-pci and guest RAM is shared: " + why
}

func (f transportFacts) has(device string) bool {
	return f.caps == nil || f.caps.HasDevice(device)
}

// chooseTransport resolves kata_fsx.agent_transport on this host; see
// the package doc for the order and why.
func chooseTransport(setting string, f transportFacts) (transport, why string, err error) {
	key := fmt.Sprintf("kata_fsx.agent_transport = %q", setting)
	refuse := func(problem, fix string) (string, string, error) {
		return setting, key, fmt.Errorf("%s: %w: %s (fix: %s)", key, ErrTransportUnavailable, problem, fix)
	}
	const fixVsock = "load vhost_vsock (modprobe vhost_vsock) and let the runtime open /dev/vhost-vsock, or use a QEMU with vhost-user-vsock-pci and shared memory (memfd or /dev/shm)"
	const fixHybrid = "use a QEMU with vhost-user-vsock-pci and make memfd or /dev/shm usable"
	serialOK := f.has("virtio-serial-pci")
	vhostOK, vhostWhy := f.vhostVsock()
	hybridOK, hybridWhy := f.hybridVsock()
	switch setting {
	case config.TransportVirtioSerial:
		if !serialOK {
			return refuse("QEMU has no virtio-serial-pci", `set kata_fsx.agent_transport = "auto"`)
		}
		return config.TransportVirtioSerial, key + " (kata-fsx's test agent only: Kata's agent listens on vsock)", nil
	case config.TransportHybridVsock:
		if !hybridOK {
			return refuse(hybridWhy, fixHybrid+`, or set kata_fsx.agent_transport = "auto"`)
		}
		return config.TransportHybridVsock, key + ": " + hybridWhy, nil
	case config.TransportVsock:
		switch {
		case vhostOK:
			return config.TransportVsock, key + ": vhost-vsock: " + vhostWhy, nil
		case hybridOK:
			return config.TransportHybridVsock, key + ": no vhost-vsock (" + vhostWhy + "), so hybrid vsock, as Kata: " + hybridWhy, nil
		}
		return refuse("no vhost-vsock ("+vhostWhy+") and no hybrid vsock ("+hybridWhy+")", fixVsock)
	}
	switch {
	case vhostOK:
		return config.TransportVsock, "auto: vhost-vsock: " + vhostWhy, nil
	case hybridOK:
		return config.TransportHybridVsock, "auto: no vhost-vsock (" + vhostWhy + "); hybrid vsock: " + hybridWhy, nil
	case serialOK:
		return config.TransportVirtioSerial, "auto: no vhost-vsock (" + vhostWhy + "), no hybrid vsock (" + hybridWhy + "): virtio-serial, which only kata-fsx's test agent speaks", nil
	}
	return refuse("no vhost-vsock ("+vhostWhy+"), no hybrid vsock ("+hybridWhy+") and QEMU has no virtio-serial-pci", fixVsock)
}

// Facts converts what was probed into what config.Validate checks against;
// what could not be probed stays zero, which skips its checks.
func (h *Host) Facts() config.HostFacts {
	var f config.HostFacts
	if h.QEMU != nil {
		f.QEMUProbed, f.QEMUHasDAX = true, h.QEMU.DAX
	}
	if h.Daemon != nil {
		f.Dialect = h.Daemon.Flavour
	}
	if h.ShmErr == nil {
		f.ShmProbed, f.ShmFreeMiB = true, h.ShmFreeMiB
	}
	if h.MemoryErr == nil {
		f.HostMemMiB = h.Memory.TotalKiB >> 10
	}
	f.AgentSharesMemory = h.TransportErr == nil && h.Transport == config.TransportHybridVsock
	f.GuestRAMMemfd = h.GuestRAM == hypervisor.SharedMemoryMemfd
	return f
}

// AccelCacheDir is where the KVM boot probe's verdict is cached: the
// runtime's state directory for root (the shim, `kata-fsx run`, and `sudo
// kata-fsx env` share one verdict), the user's cache directory otherwise,
// because an unprivileged user cannot write the state directory.
func AccelCacheDir(c *config.Config) string {
	if os.Geteuid() == 0 {
		return c.KataFSX.StateDir
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "kata-fsx")
	}
	return ""
}

func readMeminfo(path string) (Memory, error) {
	f, err := ProcFields(path)
	if err != nil {
		return Memory{}, fmt.Errorf("host memory: %w", err)
	}
	m := Memory{TotalKiB: f["MemTotal"], FreeKiB: f["MemFree"], AvailableKiB: f["MemAvailable"]}
	if m.TotalKiB == 0 {
		return m, fmt.Errorf("host memory: %s has no MemTotal", path)
	}
	return m, nil
}

// ProcFields parses the "key: number [kB]" lines of a /proc file
// (meminfo, PID/status, PID/io); lines of another shape are skipped.
func ProcFields(path string) (map[string]uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	m := map[string]uint64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		if n, err := strconv.ParseUint(f[0], 10, 64); err == nil {
			m[k] = n
		}
	}
	return m, nil
}

func probeSystem() System {
	s := System{Architecture: runtime.GOARCH, CPUs: runtime.NumCPU()}
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		s.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	s.DistroName, s.DistroVersion = osRelease("/etc/os-release")
	s.CPUVendor, s.CPUModel = cpuInfo("/proc/cpuinfo")
	return s
}

func osRelease(path string) (name, version string) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", ""
	}
	for _, l := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			continue
		}
		v = strings.Trim(v, `"`)
		switch k {
		case "NAME":
			name = v
		case "VERSION_ID":
			version = v
		}
	}
	return name, version
}

func cpuInfo(path string) (vendor, model string) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", ""
	}
	for _, l := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if k == "vendor_id" && vendor == "" {
			vendor = v
		}
		if k == "model name" && model == "" {
			model = v
		}
	}
	return vendor, model
}
