package config

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Annotation keys kata-fsx honours, with Kata's names.
const (
	AnnotationHypervisorPrefix = "io.katacontainers.config.hypervisor."

	AnnotationSharedFS          = AnnotationHypervisorPrefix + "shared_fs"
	AnnotationVirtioFSDaemon    = AnnotationHypervisorPrefix + "virtio_fs_daemon"
	AnnotationVirtioFSCache     = AnnotationHypervisorPrefix + "virtio_fs_cache"
	AnnotationVirtioFSCacheSize = AnnotationHypervisorPrefix + "virtio_fs_cache_size"
	AnnotationVirtioFSExtraArgs = AnnotationHypervisorPrefix + "virtio_fs_extra_args"
	AnnotationVirtioFSQueueSize = AnnotationHypervisorPrefix + "virtio_fs_queue_size"
	AnnotationDefaultMemory     = AnnotationHypervisorPrefix + "default_memory"
	AnnotationDefaultVCPUs      = AnnotationHypervisorPrefix + "default_vcpus"
	AnnotationKernelParams      = AnnotationHypervisorPrefix + "kernel_params"

	// CRI annotations that tell a sandbox from a container.
	AnnotationContainerType     = "io.kubernetes.cri.container-type"
	AnnotationCRIOContainerType = "io.kubernetes.cri-o.ContainerType"
	AnnotationSandboxID         = "io.kubernetes.cri.sandbox-id"
)

const errAnnotationPositiveNumericKey = "Error parsing annotation for %s: Please specify positive numeric value"

// Clone returns a deep copy of c.
func (c *Config) Clone() *Config {
	n := *c
	q := &n.Hypervisor.QEMU
	q.EnableAnnotations = append([]string(nil), q.EnableAnnotations...)
	q.ValidVirtioFSDaemonPaths = append([]string(nil), q.ValidVirtioFSDaemonPaths...)
	q.VirtioFSExtraArgs = append([]string(nil), q.VirtioFSExtraArgs...)
	q.ValidHypervisorPaths = append([]string(nil), q.ValidHypervisorPaths...)
	n.Agent.Kata.KernelModules = append([]string(nil), c.Agent.Kata.KernelModules...)
	n.DropIns = append([]string(nil), c.DropIns...)
	n.Ignored = append([]IgnoredKey(nil), c.Ignored...)
	if c.Annotated != nil {
		n.Annotated = make(map[string]string, len(c.Annotated))
		for k, v := range c.Annotated {
			n.Annotated[k] = v
		}
	}
	return &n
}

// ApplyAnnotations returns a copy of c with the pod's hypervisor annotations
// applied, refusing, as Kata does, any io.katacontainers.config.hypervisor.*
// key that no enable_annotations regex matches (unanchored). Annotations
// are the pod author's input: virtiofsd arguments pass PodExtraArgs'
// allow-list, memory, vCPUs and the DAX window are bounded by
// default_maxmemory and default_maxvcpus, an annotation for a Kata key
// kata-fsx ignores is listed in Ignored, and any other key it does not
// honour is refused.
func ApplyAnnotations(c *Config, annotations map[string]string) (*Config, error) {
	n := c.Clone()
	q := n.QEMU()
	for _, k := range slices.Sorted(maps.Keys(annotations)) {
		if !strings.HasPrefix(k, AnnotationHypervisorPrefix) {
			continue
		}
		name := strings.TrimPrefix(k, AnnotationHypervisorPrefix)
		if !regexpContains(q.EnableAnnotations, name) {
			return nil, fmt.Errorf("annotation %v is not enabled", k)
		}
		if honouredAnnotations[name] {
			continue
		}
		// Nothing is dropped silently: a Kata key kata-fsx ignores is
		// reported as the same key in the file is; any other is refused.
		row, ok := ignoredAnnotation(name)
		if !ok {
			return nil, &Error{Key: "annotation " + k, Value: annotations[k], Problem: "kata-fsx does not honour this annotation",
				Fix: "remove it; kata-fsx honours " + strings.Join(slices.Sorted(maps.Keys(honouredAnnotations)), ", ") +
					" (docs/configuration.md), and other settings belong in the configuration file"}
		}
		if v := annotations[k]; !matchesInert(v, row.inert) {
			n.Ignored = append(n.Ignored, IgnoredKey{Key: "annotation " + k, Value: v, Default: row.inert, Reason: row.reason})
		}
	}
	set := func(k string) (string, bool) {
		v, ok := annotations[k]
		if ok {
			if n.Annotated == nil {
				n.Annotated = map[string]string{}
			}
			n.Annotated[k] = v
		}
		return v, ok
	}
	if v, ok := set(AnnotationSharedFS); ok {
		supported := []string{SharedFS9P, SharedFSVirtioFS, SharedFSImagefsBlk, SharedFSAuto}
		valid := false
		for _, s := range supported {
			valid = valid || s == v
		}
		if !valid {
			//lint:ignore ST1005 Kata's wording, kept so operators recognise it
			return nil, fmt.Errorf("Invalid hypervisor shared file system %v specified for annotation shared_fs, (supported file systems: %v)", v, supported)
		}
		n.KataFSX.SharedFS = v
	}
	if v, ok := set(AnnotationVirtioFSDaemon); ok {
		if !pathInGlobs(q.ValidVirtioFSDaemonPaths, v) {
			return nil, fmt.Errorf("virtiofs daemon %v required from annotation is not valid", v)
		}
		q.VirtioFSDaemon = v
	}
	if v, ok := set(AnnotationVirtioFSExtraArgs); ok {
		var args []string
		if err := json.Unmarshal([]byte(v), &args); err != nil {
			return nil, fmt.Errorf("Error parsing virtiofsd extra arguments: %w", err)
		}
		// The pod's arguments pass the allow-list whatever enable_annotations
		// says: the daemon runs as root, so its sandbox is the host's.
		pod, err := PodExtraArgs(args)
		if err != nil {
			return nil, err
		}
		q.VirtioFSExtraArgs = append(q.VirtioFSExtraArgs, pod...)
	}
	if v, ok := set(AnnotationVirtioFSCache); ok {
		q.VirtioFSCache = v
	}
	for _, u := range []struct {
		key string
		dst *uint32
	}{
		{AnnotationVirtioFSCacheSize, &q.VirtioFSCacheSize},
		{AnnotationVirtioFSQueueSize, &q.VirtioFSQueueSize},
		{AnnotationDefaultMemory, &q.DefaultMemory},
	} {
		if v, ok := set(u.key); ok {
			x, err := strconv.ParseUint(v, 10, 32)
			if err != nil {
				return nil, fmt.Errorf(errAnnotationPositiveNumericKey, u.key)
			}
			*u.dst = uint32(x)
		}
	}
	if v, ok := annotations[AnnotationDefaultMemory]; ok && q.DefaultMemory < minMemoryMiB {
		//lint:ignore ST1005 Kata's wording, kept so operators recognise it
		return nil, fmt.Errorf("Memory specified in annotation %s is less than minimum required %d, please specify a larger value (got %s)", AnnotationDefaultMemory, minMemoryMiB, v)
	}
	if v, ok := annotations[AnnotationVirtioFSQueueSize]; ok && (q.VirtioFSQueueSize == 0 || q.VirtioFSQueueSize&(q.VirtioFSQueueSize-1) != 0 || q.VirtioFSQueueSize > 1024) {
		return nil, &Error{Key: "annotation " + AnnotationVirtioFSQueueSize, Value: v,
			Problem: "QEMU needs a power of two between 1 and 1024", Fix: "ask for 1024, 512, 256, ..."}
	}
	if err := checkMemoryAnnotations(q, annotations); err != nil {
		return nil, err
	}
	if v, ok := set(AnnotationDefaultVCPUs); ok {
		// Kata's annotation is a float too, refused above the host's CPUs
		// rather than clamped as the file's value is.
		x, err := strconv.ParseFloat(v, 32)
		if err != nil || x < 0 || math.IsNaN(x) {
			return nil, fmt.Errorf(errAnnotationPositiveNumericKey, AnnotationDefaultVCPUs)
		}
		if n := hostCPUs(); x > float64(n) {
			//lint:ignore ST1005 Kata's wording, kept so operators recognise it
			return nil, fmt.Errorf("Number of cpus %f specified in annotation default_vcpus is greater than the number of CPUs %d on the system", x, n)
		}
		// Kata's VM cannot have more vCPUs than default_maxvcpus (QEMU's
		// maxcpus); kata-fsx has no hot-plug, so the key is the ceiling of
		// what a pod may ask for.
		if m := q.DefaultMaxVCPUs; m > 0 && x > float64(m) {
			return nil, &Error{Key: "annotation " + AnnotationDefaultVCPUs, Value: v,
				Problem: fmt.Sprintf("above hypervisor.qemu.default_maxvcpus = %d", m),
				Fix:     "ask for fewer vCPUs, or raise default_maxvcpus in the configuration"}
		}
		q.DefaultVCPUsRequested = float32(x)
		q.DefaultVCPUs = resolveVCPUs(q.DefaultVCPUsRequested, hostCPUs())
	}
	if v, ok := set(AnnotationKernelParams); ok {
		q.KernelParams = strings.TrimSpace(q.KernelParams + " " + v)
	}
	n.applyKataDefaults()
	return n, nil
}

// honouredAnnotations are the io.katacontainers.config.hypervisor.* keys
// ApplyAnnotations applies.
var honouredAnnotations = map[string]bool{
	"shared_fs": true, "virtio_fs_daemon": true, "virtio_fs_cache": true, "virtio_fs_cache_size": true,
	"virtio_fs_extra_args": true, "virtio_fs_queue_size": true, "default_memory": true, "default_vcpus": true,
	"kernel_params": true,
}

// annotationFileKeys are Kata's annotation names that differ from the
// [hypervisor.qemu] key they override.
var annotationFileKeys = map[string]string{
	"blk_logical_sector_size":  "block_device_logical_sector_size",
	"blk_physical_sector_size": "block_device_physical_sector_size",
}

// ignoredAnnotation returns the kataIgnored row of the [hypervisor.qemu]
// key a hypervisor annotation overrides.
func ignoredAnnotation(name string) (struct{ key, inert, reason string }, bool) {
	if k, ok := annotationFileKeys[name]; ok {
		name = k
	}
	for _, row := range kataIgnored {
		if row.key == "hypervisor.qemu."+name {
			return row, true
		}
	}
	return struct{ key, inert, reason string }{}, false
}

// matchesInert reports whether an annotation's string value means the
// inert value of an ignored key, written in TOML syntax.
func matchesInert(v, inert string) bool {
	switch {
	case strings.HasPrefix(inert, `"`):
		s, err := strconv.Unquote(inert)
		return err == nil && v == s
	case inert == "true" || inert == "false":
		b, err := strconv.ParseBool(v)
		return err == nil && b == (inert == "true")
	case inert == "[]":
		return v == "" || v == "[]"
	}
	x, err1 := strconv.ParseFloat(v, 64)
	y, err2 := strconv.ParseFloat(inert, 64)
	return err1 == nil && err2 == nil && x == y
}

// memoryCeiling is the most guest memory a pod may ask for, in MiB: Kata's
// default_maxmemory, where 0 or more than the host has means the host's
// RAM (katautils: defaultMaxMemSz). It is 0 when nothing bounds it.
func memoryCeiling(q *QEMU) uint64 {
	host := hostMemMiB()
	if q.DefaultMaxMemory > 0 && (host == 0 || q.DefaultMaxMemory < host) {
		return q.DefaultMaxMemory
	}
	return host
}

// checkMemoryAnnotations bounds the guest memory and DAX window a pod's
// annotations ask for by memoryCeiling: Kata refuses guest memory above it
// (QEMU's maxmem), and the DAX window is host address space beside it.
func checkMemoryAnnotations(q *QEMU, annotations map[string]string) error {
	mem, memSet := annotations[AnnotationDefaultMemory]
	dax, daxSet := annotations[AnnotationVirtioFSCacheSize]
	if !memSet && !daxSet {
		return nil
	}
	ceiling := memoryCeiling(q)
	fix := "ask for less, or raise hypervisor.qemu.default_maxmemory in the configuration (0 means the host's RAM)"
	if ceiling == 0 {
		key, v := AnnotationDefaultMemory, mem
		if !memSet {
			key, v = AnnotationVirtioFSCacheSize, dax
		}
		return &Error{Key: "annotation " + key, Value: v, Problem: "cannot bound it: /proc/meminfo is unreadable and default_maxmemory is 0",
			Fix: "set hypervisor.qemu.default_maxmemory in the configuration"}
	}
	if memSet && uint64(q.DefaultMemory) > ceiling {
		return &Error{Key: "annotation " + AnnotationDefaultMemory, Value: mem,
			Problem: fmt.Sprintf("above the %d MiB a pod may have (default_maxmemory = %d, capped at the host's RAM)", ceiling, q.DefaultMaxMemory), Fix: fix}
	}
	if q.VirtioFSCacheSize > 0 && uint64(q.VirtioFSCacheSize)+uint64(q.DefaultMemory) > ceiling {
		key, v := AnnotationVirtioFSCacheSize, dax
		if !daxSet {
			key, v = AnnotationDefaultMemory, mem
		}
		return &Error{Key: "annotation " + key, Value: v,
			Problem: fmt.Sprintf("a %d MiB DAX window plus %d MiB of guest memory is above the %d MiB a pod may have (default_maxmemory = %d, capped at the host's RAM)",
				q.VirtioFSCacheSize, q.DefaultMemory, ceiling, q.DefaultMaxMemory), Fix: fix}
	}
	return nil
}

func regexpContains(regexps []string, s string) bool {
	for _, r := range regexps {
		if ok, _ := regexp.MatchString(r, s); ok {
			return true
		}
	}
	return false
}

func pathInGlobs(globs []string, path string) bool {
	for _, g := range globs {
		matches, _ := filepath.Glob(g)
		for _, m := range matches {
			if m == path {
				return true
			}
		}
	}
	return false
}
