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
// key that no enable_annotations regex matches (unanchored).
func ApplyAnnotations(c *Config, annotations map[string]string) (*Config, error) {
	n := c.Clone()
	q := n.QEMU()
	for _, k := range slices.Sorted(maps.Keys(annotations)) {
		if !strings.HasPrefix(k, AnnotationHypervisorPrefix) {
			continue
		}
		if !regexpContains(q.EnableAnnotations, strings.TrimPrefix(k, AnnotationHypervisorPrefix)) {
			return nil, fmt.Errorf("annotation %v is not enabled", k)
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
		q.VirtioFSExtraArgs = append(q.VirtioFSExtraArgs, args...)
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
		q.DefaultVCPUsRequested = float32(x)
		q.DefaultVCPUs = resolveVCPUs(q.DefaultVCPUsRequested, hostCPUs())
	}
	if v, ok := set(AnnotationKernelParams); ok {
		q.KernelParams = strings.TrimSpace(q.KernelParams + " " + v)
	}
	n.applyKataDefaults()
	return n, nil
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
