package config

import (
	"errors"
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

// ValidateSnapshotter checks what `kata-fsx snapshotter` uses of c: the
// [kata_fsx.snapshotter] and [kata_fsx.registry] tables, naming each bad
// key. (Validate checks the whole file against the host, VM keys too.)
func ValidateSnapshotter(c *Config) error {
	var errs []error
	add := func(e *Error) { errs = append(errs, e) }
	validateSnapshotter(&c.KataFSX.Snapshotter, add)
	validateRegistry(&c.KataFSX.Registry, add)
	validateCache(&c.KataFSX.Cache, add)
	if c.KataFSX.ImagefsBlk.StateDir == "" || !filepath.IsAbs(c.KataFSX.ImagefsBlk.StateDir) {
		add(&Error{Key: "kata_fsx.imagefs_blk.state_dir", Value: c.KataFSX.ImagefsBlk.StateDir, Problem: "must be an absolute path",
			Fix: "use /var/lib/kata-fsx/imagefs-blk (the default): the node store of remote layers is under it"})
	}
	return errors.Join(errs...)
}
