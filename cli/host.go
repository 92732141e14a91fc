package cli

import (
	"bufio"
	"context"
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

// hostState is everything env and check learn about the host for a configuration.
type hostState struct {
	caps      *hypervisor.Caps
	capsErr   error
	daemon    *virtiofs.Daemon
	daemonErr error
	accel     hypervisor.Accel
	accelWhy  string
	vsock     bool
	vsockWhy  string
	memfd     bool
	memfdWhy  string
	mem       memInfo
	shmFree   uint64 // MiB
	shmErr    error
}

type memInfo struct {
	TotalKiB, FreeKiB, AvailableKiB uint64
}

func probeHost(ctx context.Context, c *config.Config) *hostState {
	h := &hostState{}
	q := c.QEMU()
	h.caps, h.capsErr = hypervisor.Probe(ctx, q.Path)
	if q.VirtioFSDaemon != "" {
		h.daemon, h.daemonErr = virtiofs.Detect(ctx, q.VirtioFSDaemon)
	}
	h.accel, h.accelWhy = hypervisor.ChooseAccel(ctx, c.KataFSX.Accelerator, q.Path, q.Kernel, AccelCacheDir(c))
	h.vsock, h.vsockWhy = hypervisor.VsockAvailable()
	h.memfd, h.memfdWhy = hypervisor.MemfdAvailable()
	h.mem = readMeminfo()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		h.shmErr = err
	} else {
		h.shmFree = st.Bavail * uint64(st.Bsize) >> 20
	}
	return h
}

// facts converts what was probed into config.HostFacts for Validate.
func (h *hostState) facts() config.HostFacts {
	f := config.HostFacts{HostMemMiB: h.mem.TotalKiB >> 10}
	if h.daemon != nil {
		f.DaemonFlavour = h.daemon.Flavour
	}
	if h.caps != nil {
		f.QEMUProbed = true
		f.QEMUHasDAX = h.caps.DAX
	}
	if h.shmErr == nil {
		f.ShmProbed = true
		f.ShmFreeMiB = h.shmFree
	}
	return f
}

// transport resolves kata_fsx.agent_transport for this host.
func (h *hostState) transport(c *config.Config) (string, string) {
	switch c.KataFSX.AgentTransport {
	case config.TransportVsock:
		return config.TransportVsock, "kata_fsx.agent_transport = \"vsock\""
	case config.TransportVirtioSerial:
		return config.TransportVirtioSerial, "kata_fsx.agent_transport = \"virtio-serial\""
	}
	if h.vsock {
		return config.TransportVsock, "auto: /dev/vhost-vsock is usable"
	}
	return config.TransportVirtioSerial, "auto: " + h.vsockWhy
}

func readMeminfo() memInfo {
	var m memInfo
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return m
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 2 {
			continue
		}
		v, _ := strconv.ParseUint(fields[1], 10, 64)
		switch fields[0] {
		case "MemTotal:":
			m.TotalKiB = v
		case "MemFree:":
			m.FreeKiB = v
		case "MemAvailable:":
			m.AvailableKiB = v
		}
	}
	return m
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

func osRelease() (name, version string) {
	data, err := os.ReadFile("/etc/os-release")
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

func cpuInfo() (vendor, model string) {
	data, err := os.ReadFile("/proc/cpuinfo")
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

// AccelCacheDir is where the accelerator verdict is cached: the runtime's
// state directory for root, the user's cache directory otherwise.
func AccelCacheDir(c *config.Config) string {
	if os.Geteuid() == 0 {
		return c.KataFSX.StateDir
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "kata-fsx")
	}
	return ""
}

func goarch() string { return runtime.GOARCH }
