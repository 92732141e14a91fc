package sandbox

import (
	"context"
	"fmt"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// hostProbe is what a sandbox needs to know about the host before it boots.
type hostProbe struct {
	caps      *hypervisor.Caps
	accel     hypervisor.Accel
	vsock     bool
	daemon    *virtiofs.Daemon
	daemonErr error
	facts     config.HostFacts
}

func probe(ctx context.Context, c *config.Config) (*hostProbe, error) {
	q := c.QEMU()
	h := &hostProbe{}
	var err error
	if h.caps, err = hypervisor.Probe(ctx, q.Path); err != nil {
		return nil, fmt.Errorf("hypervisor.qemu.path: %w", err)
	}
	h.facts.QEMUProbed, h.facts.QEMUHasDAX = true, h.caps.DAX
	var why string
	if h.accel, why = hypervisor.ChooseAccel(ctx, c.KataFSX.Accelerator, q.Path, q.Kernel, c.KataFSX.StateDir); h.accel == hypervisor.AccelTCG && c.KataFSX.Accelerator != config.AccelTCG {
		log.G(ctx).Warnf("no KVM (%s): the guest runs under TCG, slowly", why)
	}
	switch c.KataFSX.AgentTransport {
	case config.TransportVsock:
		h.vsock = true
	case config.TransportAuto:
		h.vsock, _ = hypervisor.VsockAvailable()
	}
	if q.VirtioFSDaemon != "" {
		h.daemon, h.daemonErr = virtiofs.Detect(ctx, q.VirtioFSDaemon)
		if h.daemon != nil {
			h.facts.DaemonFlavour = h.daemon.Flavour
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err == nil {
		h.facts.ShmProbed, h.facts.ShmFreeMiB = true, st.Bavail*uint64(st.Bsize)>>20
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err == nil {
		h.facts.HostMemMiB = si.Totalram * uint64(si.Unit) >> 20
	}
	return h, nil
}
