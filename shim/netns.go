package shim

import specs "github.com/opencontainers/runtime-spec/specs-go"

// netNSPath is the pod's network namespace as the spec of its first (the
// pause) container names it: CRI puts the CNI-made namespace there, `ctr
// run --with-ns network:PATH` its PATH. A spec without a path (a new
// namespace or none) gives the pod no NIC.
func netNSPath(spec *specs.Spec) string {
	if spec == nil || spec.Linux == nil {
		return ""
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			return ns.Path
		}
	}
	return ""
}
