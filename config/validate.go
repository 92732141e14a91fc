package config

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// HostFacts is what Validate needs to know about the host; the caller
// probes it (virtiofs.Detect, hypervisor.Probe, /proc/meminfo, statfs).
// Zero values mean "not probed" and skip the checks that need them.
type HostFacts struct {
	// Dialect is virtio_fs_daemon's command-line dialect (its
	// virtiofs.Flavour); nil checks the settings against Kata's spellings only.
	Dialect    DaemonDialect
	QEMUProbed bool   // QEMUHasDAX is meaningful
	QEMUHasDAX bool   // vhost-user-fs-pci has a cache-size property
	HostMemMiB uint64 // MemTotal
	ShmFreeMiB uint64 // free space of /dev/shm
	ShmProbed  bool
	// AgentSharesMemory: the agent transport the host resolved is hybrid
	// vsock, a vhost-user device, so guest RAM is shared whatever shared_fs is.
	AgentSharesMemory bool
	// GuestRAMMemfd: shared guest RAM is a memfd (memfd_create works and
	// file_mem_backend is unset), which /dev/shm's free space does not bound.
	GuestRAMMemfd bool
}

// NeedsVirtioFS reports whether the effective shared_fs can end up running virtiofsd.
func (c *Config) NeedsVirtioFS() bool {
	switch c.SharedFS() {
	case SharedFSVirtioFS, SharedFSAuto:
		return true
	}
	return false
}

// NeedsSharedMemory reports whether the guest RAM must be shared with a
// vhost-user backend: virtio-fs and imagefs-blk are both vhost-user devices.
func (c *Config) NeedsSharedMemory() bool {
	switch c.SharedFS() {
	case SharedFSVirtioFS, SharedFSAuto, SharedFSImagefsBlk:
		return true
	}
	return false
}

// Validate checks the configuration and returns every problem found, each
// an *Error naming the key, joined with errors.Join.
func Validate(c *Config, host HostFacts) error {
	var errs []error
	add := func(e *Error) { errs = append(errs, e) }
	q := c.QEMU()

	switch fs := c.SharedFS(); fs {
	case SharedFSVirtioFS, SharedFS9P, SharedFSImagefsBlk, SharedFSAuto:
	case SharedFSVirtioFSNydus, SharedFSNone:
		add(&Error{Key: c.SharedFSKey(), Value: fs, Problem: "valid for Kata but not supported by kata-fsx",
			Fix: "use virtio-fs, virtio-9p, imagefs-blk or auto"})
	default:
		add(&Error{Key: c.SharedFSKey(), Value: fs, Problem: "unknown shared filesystem",
			Fix: "use virtio-fs, virtio-9p, imagefs-blk or auto"})
	}

	if c.NeedsVirtioFS() && q.VirtioFSDaemon == "" {
		add(&Error{Key: "hypervisor.qemu.virtio_fs_daemon", Problem: "cannot enable virtio-fs without daemon path",
			Fix: "set it to the virtiofsd binary, e.g. /usr/lib/qemu/virtiofsd (C) or /usr/libexec/virtiofsd (Rust)"})
	}
	if q.VirtioFSDaemon != "" {
		if err := checkExecutable(q.VirtioFSDaemon); err != nil {
			add(&Error{Key: "hypervisor.qemu.virtio_fs_daemon", Value: q.VirtioFSDaemon, Problem: err.Error(), Host: true,
				Fix: "install virtiofsd (Debian: qemu-system-common ships /usr/lib/qemu/virtiofsd) or correct the path"})
		} else if c.NeedsVirtioFS() || c.SharedFS() == SharedFSImagefsBlk {
			if host.Dialect == nil {
				if err := CheckVirtioFSCache(q.VirtioFSCache); err != nil {
					errs = append(errs, err)
				}
			} else {
				if _, err := host.Dialect.CacheMode(q.VirtioFSCache); err != nil {
					errs = append(errs, err)
				}
				if _, err := host.Dialect.ExtraArgs(q.VirtioFSExtraArgs); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	// Kata passes any queue size on and QEMU refuses a bad one at boot;
	// QEMU's rule (a power of two up to 1024) is checked here instead.
	if q.VirtioFSQueueSize == 0 || q.VirtioFSQueueSize&(q.VirtioFSQueueSize-1) != 0 || q.VirtioFSQueueSize > 1024 {
		add(&Error{Key: "hypervisor.qemu.virtio_fs_queue_size", Value: fmt.Sprint(q.VirtioFSQueueSize),
			Problem: "QEMU needs a power of two between 1 and 1024", Fix: "use 1024 (Kata's default), or 0 for it"})
	}
	switch q.BlockDeviceAIO {
	case "threads", "native", "io_uring":
	default:
		add(&Error{Key: "hypervisor.qemu.block_device_aio", Value: q.BlockDeviceAIO,
			Problem: "unknown aio mode", Fix: `use "io_uring" (Kata's default), "threads" or "native"`})
	}
	if q.BlockDeviceAIO == "native" && !q.BlockDeviceCacheDirect {
		add(&Error{Key: "hypervisor.qemu.block_device_aio", Value: q.BlockDeviceAIO,
			Problem: "QEMU's native aio needs O_DIRECT", Fix: `set block_device_cache_direct = true, or use "io_uring"`})
	}
	if q.VirtioFSCacheSize > 0 {
		if host.QEMUProbed && !host.QEMUHasDAX {
			add(&Error{Key: "hypervisor.qemu.virtio_fs_cache_size", Value: fmt.Sprint(q.VirtioFSCacheSize),
				Problem: fmt.Sprintf("DAX needs the cache-size property of vhost-user-fs-pci, which %s does not have (upstream QEMU never merged it)", q.Path),
				Fix:     "set virtio_fs_cache_size = 0, or use a QEMU build with virtio-fs DAX", Host: true})
		}
		if host.HostMemMiB > 0 && uint64(q.VirtioFSCacheSize)+uint64(q.DefaultMemory) > host.HostMemMiB {
			add(&Error{Key: "hypervisor.qemu.virtio_fs_cache_size", Value: fmt.Sprint(q.VirtioFSCacheSize),
				Problem: fmt.Sprintf("a %d MiB DAX window plus %d MiB of guest memory does not fit in the host's %d MiB", q.VirtioFSCacheSize, q.DefaultMemory, host.HostMemMiB),
				Fix:     "lower virtio_fs_cache_size", Host: true})
		}
	}
	if q.DefaultMemory == 0 {
		add(&Error{Key: "hypervisor.qemu.default_memory", Value: "0", Problem: "a VM needs memory",
			Fix: "set it in MiB, e.g. 2048 (Kata's default)"})
	} else if (c.NeedsSharedMemory() || host.AgentSharesMemory) && host.ShmProbed && !host.GuestRAMMemfd && sharesShm(q) && uint64(q.DefaultMemory) > host.ShmFreeMiB {
		add(&Error{Key: "hypervisor.qemu.default_memory", Value: fmt.Sprint(q.DefaultMemory),
			Problem: fmt.Sprintf("vhost-user devices need guest RAM shared, here a file in /dev/shm, which has only %d MiB free", host.ShmFreeMiB),
			Fix:     "lower default_memory or grow /dev/shm (mount -o remount,size=... /dev/shm); where memfd_create works, leaving file_mem_backend unset keeps guest RAM out of /dev/shm", Host: true})
	}
	if q.DefaultVCPUs < 1 {
		add(&Error{Key: "hypervisor.qemu.default_vcpus", Value: fmt.Sprint(q.DefaultVCPUsRequested), Problem: "is not a number of vCPUs",
			Fix: "set a number: 0 for Kata's default of 1, a negative value for all host CPUs"})
	}
	if q.Image != "" && q.Initrd != "" {
		// Kata's words (virtcontainers: conflictingAssets).
		add(&Error{Key: "hypervisor.qemu.initrd", Value: q.Initrd,
			Problem: fmt.Sprintf("cannot set both image and initrd at the same time (hypervisor.qemu.image = %q)", q.Image),
			Fix:     "remove hypervisor.qemu.image to boot the initrd, or hypervisor.qemu.initrd to boot the image"})
	}
	switch m := c.Runtime.InterNetworkingModel; m {
	case "tcfilter", "none", "default":
	case "macvtap":
		add(&Error{Key: "runtime.internetworking_model", Value: m, Problem: "valid for Kata but not supported by kata-fsx",
			Fix: `use "tcfilter" (Kata's default) or "none" (no network device)`})
	default:
		add(&Error{Key: "runtime.internetworking_model", Value: m, Problem: "unknown internetworking model",
			Fix: `use "tcfilter" (Kata's default) or "none" (no network device)`})
	}
	if c.AgentKata().DialTimeout == 0 {
		add(&Error{Key: "agent.kata.dial_timeout", Value: "0", Problem: "the agent would never be reached", Fix: "set it in seconds, e.g. 45"})
	}

	k := &c.KataFSX
	switch k.Accelerator {
	case AccelAuto, AccelKVM, AccelTCG:
	default:
		add(&Error{Key: "kata_fsx.accelerator", Value: k.Accelerator, Problem: "unknown accelerator", Fix: "use auto, kvm or tcg"})
	}
	switch k.AgentTransport {
	case TransportAuto, TransportVsock, TransportHybridVsock, TransportVirtioSerial:
	default:
		add(&Error{Key: "kata_fsx.agent_transport", Value: k.AgentTransport, Problem: "unknown agent transport", Fix: "use auto, vsock, hybrid-vsock or virtio-serial"})
	}
	b := &k.ImagefsBlk
	switch b.BlockSize {
	case 1024, 2048, 4096:
	default:
		add(&Error{Key: "kata_fsx.imagefs_blk.block_size", Value: fmt.Sprint(b.BlockSize), Problem: "ext4 block size must be 1024, 2048 or 4096", Fix: "use 4096"})
	}
	if b.NumQueues == 0 || b.NumQueues > 64 {
		add(&Error{Key: "kata_fsx.imagefs_blk.num_queues", Value: fmt.Sprint(b.NumQueues), Problem: "must be between 1 and 64", Fix: "use 1, or the number of vCPUs"})
	}
	if b.QueueSize == 0 || b.QueueSize&(b.QueueSize-1) != 0 || b.QueueSize > 1024 {
		add(&Error{Key: "kata_fsx.imagefs_blk.queue_size", Value: fmt.Sprint(b.QueueSize), Problem: "must be a power of two between 1 and 1024", Fix: "use 256 (the default) or 128"})
	}
	if b.StateDir == "" || !strings.HasPrefix(b.StateDir, "/") {
		add(&Error{Key: "kata_fsx.imagefs_blk.state_dir", Value: b.StateDir, Problem: "must be an absolute path", Fix: "use /var/lib/kata-fsx/imagefs-blk"})
	}
	if k.StateDir == "" || !strings.HasPrefix(k.StateDir, "/") {
		add(&Error{Key: "kata_fsx.state_dir", Value: k.StateDir, Problem: "must be an absolute path", Fix: "use /run/kata-fsx"})
	}
	for _, bud := range []struct {
		key string
		v   uint64
		max uint64
		fix string
	}{
		{"max_entries", b.MaxEntries, 1 << 28, "use 4194304 (the default)"},
		{"max_layer_mb", b.MaxLayerMB, 1 << 30, "use 65536 (the default, 64 GiB)"},
		{"max_metadata_mb", b.MaxMetadataMB, 1 << 30, "use 4096 (the default, 4 GiB)"},
		{"max_build_memory_mb", b.MaxBuildMemoryMB, 1 << 30, "use 1024 (the default, 1 GiB)"},
	} {
		if bud.v == 0 || bud.v > bud.max {
			add(&Error{Key: "kata_fsx.imagefs_blk." + bud.key, Value: fmt.Sprint(bud.v), Problem: fmt.Sprintf("budget must be between 1 and %d", bud.max), Fix: bud.fix})
		}
	}
	validateRegistry(&k.Registry, add)
	validateSnapshotter(&k.Snapshotter, add)
	validateCache(&k.Cache, add)
	if b.Journal && b.JournalSizeMB == 0 {
		add(&Error{Key: "kata_fsx.imagefs_blk.journal_size_mb", Value: "0", Problem: "journal is on but has no size", Fix: "set e.g. 16, or journal = false"})
	}
	return errors.Join(errs...)
}

func sharesShm(q *QEMU) bool {
	return q.FileMemBackend == "" || strings.HasPrefix(q.FileMemBackend, "/dev/shm")
}

func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		if os.IsNotExist(err) {
			return fmt.Errorf("no such file")
		}
		return err
	}
	if fi.IsDir() {
		return fmt.Errorf("is a directory, not an executable")
	}
	if fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("is not executable (mode %v)", fi.Mode().Perm())
	}
	return nil
}
