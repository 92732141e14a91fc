package config

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"
)

// IgnoredKey is a Kata key that would change the VM, set to a value kata-fsx
// does not honour: LoadFile lists them so that check and the shim can say so
// instead of dropping them silently.
type IgnoredKey struct {
	Key     string // dotted, e.g. hypervisor.qemu.enable_hugepages
	Value   string // as written, in TOML syntax
	Default string // the value kata-fsx's VM already matches, in TOML syntax
	Reason  string
}

func (k IgnoredKey) String() string {
	return fmt.Sprintf("%s = %s ignored by kata-fsx: %s (set it to %s or remove it)", k.Key, k.Value, k.Reason, k.Default)
}

// kataIgnored lists every key of Kata's configuration-qemu.toml.in that
// changes the VM and that kata-fsx does not implement, with the value that
// asks nothing of the VM (Kata's built-in default for an absent key, except
// where the comment says otherwise) and why the key is not honoured. A key
// is reported only when a file sets it to another value.
var kataIgnored = []struct{ key, inert, reason string }{
	// image and disable_image_nvdimm are honoured; an image's root is always ext4.
	// default_maxvcpus and default_maxmemory are honoured too, not as
	// hot-plug limits (there is no hot-plug) but as the ceilings of the
	// default_vcpus and default_memory annotations.
	{"hypervisor.qemu.rootfs_type", `"ext4"`, "a guest image is always booted as ext4 (rootfstype=ext4)"},
	{"hypervisor.qemu.rootless", `false`, "QEMU runs as the shim's user, never as a dedicated unprivileged user"},
	{"hypervisor.qemu.firmware", `""`, "QEMU's built-in firmware is used"},
	{"hypervisor.qemu.firmware_volume", `""`, "QEMU's built-in firmware is used"},
	{"hypervisor.qemu.pflashes", `[]`, "no pflash images are attached"},
	{"hypervisor.qemu.machine_accelerators", `""`, "-machine gets only the machine type and kata-fsx's accelerator"},
	{"hypervisor.qemu.cpu_features", `""`, "-cpu is host (KVM) or max (TCG), without extra features"},
	{"hypervisor.qemu.seccompsandbox", `""`, "QEMU runs without -sandbox"},
	{"hypervisor.qemu.default_bridges", `1`, "the VM always has one PCI bridge, for hot-plugged disks"},
	{"hypervisor.qemu.memory_slots", `10`, "no memory hot-plug: the slots only hold a guest image's nvdimm"},
	{"hypervisor.qemu.memory_offset", `0`, "no memory hot-plug"},
	{"hypervisor.qemu.enable_virtio_mem", `false`, "no virtio-mem device"},
	{"hypervisor.qemu.enable_hugepages", `false`, "guest memory is a shared file or memfd without huge pages"},
	{"hypervisor.qemu.reclaim_guest_freed_memory", `false`, "no virtio-balloon device"},
	{"hypervisor.qemu.enable_numa", `false`, "the VM has one NUMA node"},
	{"hypervisor.qemu.numa_mapping", `[]`, "the VM has one NUMA node"},
	{"hypervisor.qemu.enable_iommu", `false`, "no vIOMMU"},
	{"hypervisor.qemu.enable_iommu_platform", `false`, "no vIOMMU"},
	{"hypervisor.qemu.disable_block_device_use", `false`, "the container rootfs path is chosen by shared_fs (imagefs-blk or a block rootfs), not by this key"},
	// kata-fsx attaches every disk as virtio-blk, so that is the value that
	// asks for nothing it does not do; Kata's default, virtio-scsi, does.
	{"hypervisor.qemu.block_device_driver", `"virtio-blk"`, "kata-fsx attaches its disks as vhost-user-blk or virtio-blk"},
	{"hypervisor.qemu.block_device_cache_set", `false`, "disk cache options come from block_device_cache_direct only"},
	{"hypervisor.qemu.block_device_cache_noflush", `false`, "disk cache options come from block_device_cache_direct only"},
	{"hypervisor.qemu.block_device_logical_sector_size", `0`, "disks use QEMU's default sector sizes"},
	{"hypervisor.qemu.block_device_physical_sector_size", `0`, "disks use QEMU's default sector sizes"},
	{"hypervisor.qemu.enable_iothreads", `false`, "no I/O threads"},
	{"hypervisor.qemu.indep_iothreads", `0`, "no I/O threads"},
	{"hypervisor.qemu.enable_vhost_user_store", `false`, "no vhost-user devices other than kata-fsx's own"},
	{"hypervisor.qemu.vhost_user_reconnect_timeout_sec", `0`, "vhost-user sockets do not reconnect"},
	{"hypervisor.qemu.extra_monitor_socket", `""`, "QEMU has one QMP socket, kata-fsx's"},
	{"hypervisor.qemu.hot_plug_vfio", `"no-port"`, "no VFIO devices"},
	{"hypervisor.qemu.cold_plug_vfio", `"no-port"`, "no VFIO devices"},
	{"hypervisor.qemu.pcie_root_port", `0`, "no PCIe root ports are added"},
	{"hypervisor.qemu.rx_rate_limiter_max_rate", `0`, "the pod's NICs have no rate limiter"},
	{"hypervisor.qemu.tx_rate_limiter_max_rate", `0`, "the pod's NICs have no rate limiter"},
	{"hypervisor.qemu.entropy_source", `"/dev/urandom"`, "no virtio-rng device"},
	{"hypervisor.qemu.guest_hook_path", `""`, "no guest hooks are sent to the agent"},
	{"hypervisor.qemu.guest_memory_dump_path", `""`, "no pvpanic device, no memory dump"},
	{"hypervisor.qemu.enable_guest_swap", `false`, "no guest swap disk"},
	{"hypervisor.qemu.use_legacy_serial", `false`, "the console is kata-fsx's own"},
	{"hypervisor.qemu.disable_selinux", `false`, "QEMU gets no SELinux label"},
	// Kata's absent-key default is false (guest SELinux on when the host has
	// it); kata-fsx never enables it, which is what true asks for.
	{"hypervisor.qemu.disable_guest_selinux", `true`, "guest SELinux is never enabled"},
	{"factory.enable_template", `false`, "no VM templating"},
	{"factory.vm_cache_number", `0`, "no VM cache"},
	{"agent.kata.debug_console_enabled", `false`, "no debug console in the guest"},
	{"agent.kata.enable_tracing", `false`, "no agent tracing"},
	{"runtime.disable_new_netns", `false`, "QEMU stays in the shim's network namespace and gets the pod's taps as fds; for no NIC set internetworking_model = \"none\""},
	{"runtime.enable_vcpus_pinning", `false`, "vCPUs are not pinned"},
	{"runtime.guest_selinux_label", `""`, "guest SELinux is never enabled"},
	{"runtime.sandbox_bind_mounts", `[]`, "no bind mounts are shared into the guest"},
	{"runtime.vfio_mode", `"guest-kernel"`, "no VFIO devices"},
	{"runtime.emptydir_mode", `"shared-fs"`, "emptyDir volumes are host directories like any other"},
}

// collectWritten records, by dotted key, the value of every kataIgnored key
// data sets, a later file's value replacing an earlier one's.
func collectWritten(data string, written map[string]string) {
	var raw map[string]any
	if _, err := toml.Decode(data, &raw); err != nil {
		return
	}
	for _, row := range kataIgnored {
		var v any = raw
		for _, part := range strings.Split(row.key, ".") {
			m, ok := v.(map[string]any)
			if !ok {
				v = nil
				break
			}
			v = m[part]
		}
		if v != nil {
			written[row.key] = tomlValue(v)
		}
	}
}

// ignoredKeys returns the written keys whose value differs from the inert one, sorted by key.
func ignoredKeys(written map[string]string) []IgnoredKey {
	var out []IgnoredKey
	for _, row := range kataIgnored {
		if v, ok := written[row.key]; ok && v != row.inert {
			out = append(out, IgnoredKey{Key: row.key, Value: v, Default: row.inert, Reason: row.reason})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// tomlValue writes a decoded TOML value back in TOML syntax, so that values
// compare and print as an operator wrote them.
func tomlValue(v any) string {
	switch x := v.(type) {
	case string:
		return strconv.Quote(x)
	case bool:
		return strconv.FormatBool(x)
	case int64:
		return strconv.FormatInt(x, 10)
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			parts[i] = tomlValue(e)
		}
		return "[" + strings.Join(parts, ", ") + "]"
	case []map[string]any:
		return fmt.Sprintf("[%d tables]", len(x))
	case map[string]any:
		return "{table}"
	}
	return fmt.Sprint(v)
}
