package config

import (
	"path/filepath"
)

// Defaults of the [kata_fsx.snapshotter] table.
const (
	DefaultSnapshotterAddress = "/run/kata-fsx/snapshotter.sock"
	DefaultSnapshotterRoot    = "/var/lib/kata-fsx/snapshotter"
)

// Snapshotter is the [kata_fsx.snapshotter] table: the containerd proxy
// snapshotter `kata-fsx snapshotter` serves.
type Snapshotter struct {
	// Address is the unix socket containerd's [proxy_plugins.kata-fsx]
	// address names.
	Address string `toml:"address"`
	// Root holds the snapshots and their metadata database.
	Root string `toml:"root"`
	// Remote makes layers CRI pulls remote (index only, no data
	// downloaded); off, the snapshotter is containerd's overlayfs one.
	Remote bool `toml:"remote"`
}

// DefaultSnapshotter is the [kata_fsx.snapshotter] table when the file
// has none.
func DefaultSnapshotter() Snapshotter {
	return Snapshotter{Address: DefaultSnapshotterAddress, Root: DefaultSnapshotterRoot, Remote: true}
}

func validateSnapshotter(s *Snapshotter, add func(*Error)) {
	for _, k := range []struct{ key, v, def string }{
		{"address", s.Address, DefaultSnapshotterAddress},
		{"root", s.Root, DefaultSnapshotterRoot},
	} {
		if k.v == "" || !filepath.IsAbs(k.v) {
			add(&Error{Key: "kata_fsx.snapshotter." + k.key, Value: k.v, Problem: "must be an absolute path",
				Fix: "use " + k.def + " (the default)"})
		}
	}
	// A unix socket path is limited by sun_path (108 bytes with its NUL).
	if len(s.Address) > 107 {
		add(&Error{Key: "kata_fsx.snapshotter.address", Value: s.Address, Problem: "longer than a unix socket path may be (107 bytes)",
			Fix: "use " + DefaultSnapshotterAddress + " (the default) or another short path"})
	}
}
