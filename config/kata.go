package config

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"runtime"
)

// Kata's loader defaults for keys whose zero value means "the default"
// (src/runtime/pkg/katautils/config-settings.go.in and config.go).
const (
	defaultVCPUs         = 1
	defaultMemoryMiB     = 2048
	minMemoryMiB         = 256 // virtcontainers.MinHypervisorMemory: below it Kata uses the default
	defaultVirtioFSQueue = 1024
	// defaultVirtioFSCache is what Kata's loader uses for an empty or absent
	// virtio_fs_cache; the "auto" of the shipped file is only that file's value.
	defaultVirtioFSCache = "never"
	// maxVCPUs is govmm's MaxVCPUs on x86_64, the cap Kata puts on the host
	// CPU count before comparing default_vcpus with it.
	maxVCPUs = 240
)

// hostCPUs returns the host CPU count Kata compares default_vcpus with: the
// processors of /proc/cpuinfo (runtime.NumCPU when it cannot be read),
// capped at QEMU's x86_64 limit of 240.
func hostCPUs() int {
	n := 0
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(data))
		for sc.Scan() {
			if bytes.HasPrefix(sc.Bytes(), []byte("processor")) {
				n++
			}
		}
	}
	if n == 0 {
		n = runtime.NumCPU()
	}
	return min(n, maxVCPUs)
}

// resolveVCPUs applies Kata's rule for default_vcpus: negative or above
// hostCPUs means hostCPUs, 0 means 1, and a fraction rounds up. NaN, which
// Kata turns into garbage, resolves to 0 so that Validate refuses it.
func resolveVCPUs(requested float32, hostCPUs int) int32 {
	switch {
	case math.IsNaN(float64(requested)):
		return 0
	case requested < 0 || requested > float32(hostCPUs):
		return int32(hostCPUs)
	case requested == 0:
		return defaultVCPUs
	}
	return int32(math.Ceil(float64(requested)))
}

// applyKataDefaults replaces the zero values Kata reads as "the default"
// with that default, so that a file Kata accepts is accepted here with the
// same meaning. It is idempotent.
func (c *Config) applyKataDefaults() {
	q := c.QEMU()
	if q.DefaultMemory < minMemoryMiB {
		q.DefaultMemory = defaultMemoryMiB
	}
	if q.VirtioFSCache == "" {
		q.VirtioFSCache = defaultVirtioFSCache
	}
	if q.VirtioFSQueueSize == 0 {
		q.VirtioFSQueueSize = defaultVirtioFSQueue
	}
}

// hostMemMiB returns MemTotal of /proc/meminfo in MiB, 0 when unreadable.
func hostMemMiB() uint64 {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		var kib uint64
		if n, _ := fmt.Sscanf(sc.Text(), "MemTotal: %d kB", &kib); n == 1 {
			return kib / 1024
		}
	}
	return 0
}
