package sandbox

import "github.com/kata-fsx/kata-fsx/config"

// Decide picks the pod's backend once: the policy (config.Decide) on the
// pod's configuration, annotations, rootfs and volumes, unless the spec
// names a backend, whose reason (Spec.BackendReason) is then the one
// given. New uses spec.Decision when a caller decided earlier (the shim
// decides before the boot, to know whether a remote rootfs is read
// lazily), so every pod is decided exactly once and logs why truly.
func Decide(spec Spec) (config.Decision, error) {
	if spec.Decision != nil {
		return *spec.Decision, nil
	}
	d, err := config.Decide(spec.Config, config.Pod{Annotations: spec.Annotations, Rootfs: spec.Rootfs, HostVolumes: spec.HostVolumes})
	if err != nil {
		return config.Decision{}, err
	}
	if spec.Backend != "" {
		d.Backend, d.Reason = spec.Backend, spec.BackendReason
		if d.Reason == "" {
			d.Reason = "requested explicitly (--backend " + spec.Backend + ")"
		}
	}
	return d, nil
}
