package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

type status string

const (
	pass status = "PASS"
	warn status = "WARN"
	fail status = "FAIL"
)

type checkLine struct {
	st     status
	name   string
	detail string
	fix    string
}

func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (default: the usual lookup, see kata-fsx env --help)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	c, err := config.Load(*cfgPath, config.DevPath())
	if err != nil {
		fmt.Fprintf(stdout, "%s  %-22s %v\n", fail, "configuration", err)
		return 1
	}
	lines := append(hostChecks(c, host.Probe(ctx, c)), ignoredChecks(c)...)
	failed := false
	for _, l := range lines {
		fmt.Fprintf(stdout, "%s  %-22s %s", l.st, l.name, l.detail)
		if l.fix != "" && l.st != pass {
			fmt.Fprintf(stdout, " (fix: %s)", l.fix)
		}
		fmt.Fprintln(stdout)
		failed = failed || l.st == fail
	}
	if failed {
		return 1
	}
	return 0
}

// ignoredChecks names each Kata key the configuration sets to change the VM
// in a way kata-fsx does not implement.
func ignoredChecks(c *config.Config) []checkLine {
	var out []checkLine
	for _, k := range c.Ignored {
		// The trailing space keeps two spaces after keys longer than the column.
		out = append(out, checkLine{warn, k.Key + " ", fmt.Sprintf("ignored by kata-fsx: %s (it is %s)", k.Reason, k.Value), "remove it, or set it to " + k.Default})
	}
	return out
}

func hostChecks(c *config.Config, h *host.Host) []checkLine {
	q := c.QEMU()
	var out []checkLine
	add := func(st status, name, detail, fix string) { out = append(out, checkLine{st, name, detail, fix}) }

	add(pass, "configuration", fmt.Sprintf("%s (shared_fs %s from %s)", c.Path, c.SharedFS(), c.SharedFSKey()), "")
	if err := config.Validate(c, h.Facts()); err != nil {
		for _, e := range unjoin(err) {
			add(fail, "configuration", e.Error(), "")
		}
	}

	if h.QEMUErr != nil {
		add(fail, "qemu", h.QEMUErr.Error(), "apt-get install qemu-system-x86, or set hypervisor.qemu.path")
	} else {
		add(pass, "qemu", fmt.Sprintf("%s: %s", h.QEMU.Path, h.QEMU.VersionLine), "")
		dev := func(name string, have bool, needed bool, why, fix string) {
			switch {
			case have:
				add(pass, name, "supported by this QEMU", "")
			case needed:
				add(fail, name, "not supported by this QEMU: "+why, fix)
			default:
				add(warn, name, "not supported by this QEMU: "+why, fix)
			}
		}
		dev("vhost-user-fs-pci", h.QEMU.VhostUserFS, c.NeedsVirtioFS(), "virtio-fs pods cannot run", "use a QEMU with virtio-fs")
		dev("vhost-user-blk-pci", h.QEMU.VhostUserBlk, c.SharedFS() == config.SharedFSImagefsBlk || c.SharedFS() == config.SharedFSAuto, "imagefs-blk pods cannot run", "use a QEMU with vhost-user-blk")
		dev("virtio-9p-pci", h.QEMU.Virtio9P, c.SharedFS() == config.SharedFS9P, "virtio-9p comparison runs cannot run", "use a QEMU with virtfs")
		setting := c.KataFSX.AgentTransport
		dev("vhost-vsock-pci", h.QEMU.VhostVsock, false, "the agent cannot use vhost-vsock", "")
		dev("vhost-user-vsock-pci", h.QEMU.VhostUserVsock, setting == config.TransportHybridVsock, "the agent cannot use hybrid vsock", "use a QEMU with vhost-user-vsock-pci")
		dev("virtio-serial-pci", h.QEMU.VirtioSerial, setting == config.TransportVirtioSerial, "the test agent's virtio-serial channel cannot be used", "use a QEMU with virtio-serial")
		switch {
		case h.QEMU.DAX:
			add(pass, "virtio-fs DAX", "cache-size supported by this QEMU", "")
		case q.VirtioFSCacheSize > 0:
			add(fail, "virtio-fs DAX", fmt.Sprintf("virtio_fs_cache_size = %d but this QEMU has no cache-size property on vhost-user-fs-pci (upstream QEMU never merged DAX)", q.VirtioFSCacheSize), "set virtio_fs_cache_size = 0")
		default:
			add(pass, "virtio-fs DAX", "not supported by this QEMU (no cache-size property); not needed: virtio_fs_cache_size = 0", "")
		}
	}

	switch {
	case q.VirtioFSDaemon == "" && c.NeedsVirtioFS():
		add(fail, "virtiofsd", "virtio_fs_daemon is not set", "set hypervisor.qemu.virtio_fs_daemon")
	case q.VirtioFSDaemon == "":
		add(pass, "virtiofsd", "not configured (not needed for shared_fs = "+c.SharedFS()+")", "")
	case h.DaemonErr != nil:
		st := warn
		if c.NeedsVirtioFS() {
			st = fail
		}
		add(st, "virtiofsd", h.DaemonErr.Error(), "install virtiofsd (Debian: qemu-system-common has /usr/lib/qemu/virtiofsd) or fix virtio_fs_daemon")
	default:
		d := h.Daemon
		add(pass, "virtiofsd", fmt.Sprintf("%s: %s flavour, version %s", d.Path, flavourName(d.Flavour), d.Version), "")
		if m, err := d.Flavour.CacheMode(q.VirtioFSCache); err != nil {
			add(fail, "virtiofsd cache mode", err.Error(), "")
		} else {
			add(pass, "virtiofsd cache mode", fmt.Sprintf("virtio_fs_cache = %q is %q for this daemon", q.VirtioFSCache, m), "")
		}
		if a, err := d.Flavour.ExtraArgs(q.VirtioFSExtraArgs); err != nil {
			add(fail, "virtiofsd extra args", err.Error(), "")
		} else {
			add(pass, "virtiofsd extra args", fmt.Sprintf("%q", a), "")
		}
	}

	if h.Accel == hypervisor.AccelKVM {
		add(pass, "kvm", h.AccelReason, "")
	} else {
		fix := "load kvm_intel/kvm_amd and give the runtime access to /dev/kvm"
		if strings.Contains(h.AccelReason, "does not boot under KVM") {
			fix = "this host's KVM (often nested virtualization) cannot run the guest; fix the host's KVM, or set kata_fsx.accelerator = \"tcg\" to skip the probe"
		}
		add(warn, "kvm", "not usable: "+h.AccelReason+"; guests run under TCG, much slower", fix)
	}
	switch {
	case h.TransportErr != nil:
		// The error names the key and the fix.
		add(fail, "agent transport", fmt.Sprintf("%s: the shim refuses every pod: %v", h.Transport, h.TransportErr), "")
	case h.Transport == config.TransportVirtioSerial && c.KataFSX.AgentTransport == config.TransportAuto:
		add(warn, "agent transport", fmt.Sprintf("%s (%s): Kata's agent cannot be reached, only kata-fsx's test agent", h.Transport, h.TransportReason),
			"load vhost_vsock (modprobe vhost_vsock), or use a QEMU with vhost-user-vsock-pci")
	default:
		add(pass, "agent transport", fmt.Sprintf("%s (%s)", h.Transport, h.TransportReason), "")
	}
	switch {
	case h.Vsock:
		add(pass, "vhost-vsock", "/dev/vhost-vsock usable", "")
	case h.Transport == config.TransportHybridVsock:
		add(pass, "vhost-vsock", "not usable: "+h.VsockReason+"; the agent uses hybrid vsock instead", "")
	default:
		add(pass, "vhost-vsock", "not usable: "+h.VsockReason, "")
	}
	ram, ramPath, ramWhy := guestRAMInfo(c, h)
	inShm := ram == "file" && (ramPath == "/dev/shm" || strings.HasPrefix(ramPath, "/dev/shm/"))
	switch {
	case ram == "unavailable":
		add(fail, "guest RAM", ramWhy, "make memfd_create work, or mount a tmpfs on /dev/shm")
	case inShm:
		fix := "make memfd_create work: guest RAM is then a memfd"
		if h.Memfd {
			fix = "unset file_mem_backend: guest RAM is then a memfd"
		}
		add(warn, "guest RAM", fmt.Sprintf("a share=on file in %s: every local user can fill /dev/shm, and a guest that then touches a new page dies of SIGBUS", ramPath), fix)
	case ram == "file":
		add(pass, "guest RAM", fmt.Sprintf("a share=on file in %s (%s)", ramPath, ramWhy), "")
	default:
		add(pass, "guest RAM", ram+": "+ramWhy, "")
	}
	switch {
	case h.ShmErr != nil && !inShm && ram != "file":
		add(pass, "/dev/shm", h.ShmErr.Error()+"; guest RAM does not use it", "")
	case h.ShmErr != nil:
		add(warn, "/dev/shm", h.ShmErr.Error(), "mount a tmpfs on /dev/shm")
	case inShm && uint64(q.DefaultMemory) > h.ShmFreeMiB:
		add(fail, "/dev/shm", fmt.Sprintf("%d MiB free, default_memory is %d MiB and vhost-user devices need guest RAM there", h.ShmFreeMiB, q.DefaultMemory), "grow /dev/shm or lower default_memory")
	case inShm:
		add(pass, "/dev/shm", fmt.Sprintf("%d MiB free for %d MiB of guest memory", h.ShmFreeMiB, q.DefaultMemory), "")
	default:
		add(pass, "/dev/shm", fmt.Sprintf("%d MiB free; guest RAM is not there", h.ShmFreeMiB), "")
	}
	if h.Memfd {
		add(pass, "memfd", "memfd_create works", "")
	} else {
		add(warn, "memfd", h.MemfdReason, "")
	}
	for _, p := range []struct{ key, path string }{{"kernel", q.Kernel}, {"image", q.Image}, {"initrd", q.Initrd}} {
		switch {
		case p.path == "" && p.key == "kernel":
			add(fail, "kernel", "hypervisor.qemu.kernel is not set", "run 'make guest' or set it")
		case p.path == "":
			continue
		default:
			if fi, err := os.Stat(p.path); err != nil {
				fix := "run 'make guest' or fix the path"
				if p.key != "initrd" {
					fix = "run 'make guest-image' (kata-fsx's test kernel and image) or fix the path"
				}
				add(fail, p.key, fmt.Sprintf("hypervisor.qemu.%s = %s: %v", p.key, p.path, err), fix)
			} else {
				add(pass, p.key, fmt.Sprintf("%s (%d bytes)", p.path, fi.Size()), "")
			}
		}
	}
	if q.Image == "" && q.Initrd == "" {
		add(fail, "image/initrd", "neither hypervisor.qemu.image nor initrd is set", "run 'make guest' or set one")
	}
	return out
}

func flavourName(f virtiofs.Flavour) string {
	switch f {
	case virtiofs.FlavourC:
		return "C (QEMU)"
	case virtiofs.FlavourRust:
		return "Rust"
	}
	return strings.TrimSpace(string(f))
}
