package config

import "path/filepath"

// DefaultRegistryConfigPath is containerd's own hosts.toml directory, so
// kata-fsx reaches registries exactly as the node's containerd does.
const DefaultRegistryConfigPath = "/etc/containerd/certs.d"

// Registry is the [kata_fsx.registry] table: how lazy image content
// reaches OCI registries.
type Registry struct {
	// ConfigPath is a directory in containerd's certs.d layout: one
	// subdirectory per registry host holding a hosts.toml (mirrors, CAs,
	// client certificates, plain HTTP). Empty means none: https to every
	// registry itself.
	ConfigPath string `toml:"config_path"`
}

func validateRegistry(r *Registry, add func(*Error)) {
	if r.ConfigPath != "" && !filepath.IsAbs(r.ConfigPath) {
		add(&Error{Key: "kata_fsx.registry.config_path", Value: r.ConfigPath, Problem: "must be an absolute path",
			Fix: "use " + DefaultRegistryConfigPath + " (containerd's), or \"\" for none"})
	}
}
