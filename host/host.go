// Package host probes the machine pods run on, once, for everyone who
// needs to know: the shim boots a pod (through package sandbox) with what
// Probe finds, and `kata-fsx env`, `kata-fsx check` and `kata-fsx bench`
// report the same Host, so what env prints is what a pod on this host
// gets, with the reason for each choice.
//
// The agent transport: agent_transport = "auto" resolves to virtio-serial
// even where /dev/vhost-vsock opens, with the reason "vsock agent transport
// not implemented yet". The shim cannot reach an agent over vsock yet, and
// /dev/vhost-vsock opens on every Kata host, so resolving auto to vsock
// would refuse every pod there. An explicit agent_transport = "vsock"
// resolves to vsock and carries TransportErr: the refusal every pod gets
// from the shim, which env and check report as such.
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

// ReasonVsockNotImplemented is why agent_transport = "auto" never picks vsock.
const ReasonVsockNotImplemented = "vsock agent transport not implemented yet"

// ErrVsockNotWired is wrapped by TransportErr when the configuration asks
// for the vsock agent transport, which the shim cannot use yet.
var ErrVsockNotWired = errors.New("vsock agent transport is not wired yet")

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

	// Transport is the agent transport pods get (config.TransportVsock or
	// config.TransportVirtioSerial) and TransportReason why; TransportErr,
	// when set, is the shim's refusal of every pod with this transport.
	Transport       string
	TransportReason string
	TransportErr    error

	// Memfd reports whether memfd_create works; MemfdReason says why not.
	Memfd       bool
	MemfdReason string

	// ShmFreeMiB is the free space of /dev/shm, meaningful when ShmErr is nil.
	ShmFreeMiB uint64
	ShmErr     error

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
	h.Transport, h.TransportReason, h.TransportErr = chooseTransport(c.KataFSX.AgentTransport, h.Vsock, h.VsockReason)
	h.Memfd, h.MemfdReason = hypervisor.MemfdAvailable()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		h.ShmErr = fmt.Errorf("statfs /dev/shm: %w", err)
	} else {
		h.ShmFreeMiB = st.Bavail * uint64(st.Bsize) >> 20
	}
	h.Memory, h.MemoryErr = readMeminfo("/proc/meminfo")
	h.System = probeSystem()
	return h
}

// chooseTransport resolves kata_fsx.agent_transport; see the package doc
// for why auto never picks vsock.
func chooseTransport(setting string, vsock bool, vsockWhy string) (transport, why string, err error) {
	switch setting {
	case config.TransportVsock:
		return config.TransportVsock, `kata_fsx.agent_transport = "vsock"`,
			fmt.Errorf("%w; set kata_fsx.agent_transport = %q or %q", ErrVsockNotWired, config.TransportAuto, config.TransportVirtioSerial)
	case config.TransportVirtioSerial:
		return config.TransportVirtioSerial, `kata_fsx.agent_transport = "virtio-serial"`, nil
	}
	if vsock {
		return config.TransportVirtioSerial, "auto: /dev/vhost-vsock is usable, but " + ReasonVsockNotImplemented, nil
	}
	return config.TransportVirtioSerial, "auto: " + vsockWhy, nil
}

// Facts converts what was probed into what config.Validate checks against;
// what could not be probed stays zero, which skips its checks.
func (h *Host) Facts() config.HostFacts {
	var f config.HostFacts
	if h.QEMU != nil {
		f.QEMUProbed, f.QEMUHasDAX = true, h.QEMU.DAX
	}
	if h.Daemon != nil {
		f.DaemonFlavour = h.Daemon.Flavour
	}
	if h.ShmErr == nil {
		f.ShmProbed, f.ShmFreeMiB = true, h.ShmFreeMiB
	}
	if h.MemoryErr == nil {
		f.HostMemMiB = h.Memory.TotalKiB >> 10
	}
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
