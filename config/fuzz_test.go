package config

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzLoadFile feeds arbitrary bytes as configuration.toml: loading and
// validating must return an error or a configuration, never panic.
func FuzzLoadFile(f *testing.F) {
	stock, _ := os.ReadFile("testdata/kata-stock.toml")
	f.Add(stock)
	kata, _ := os.ReadFile("testdata/kata-configuration-qemu.toml")
	f.Add(kata)
	f.Add([]byte("[hypervisor.qemu]\nshared_fs = \"auto\"\n[kata_fsx.imagefs_blk]\nqueue_size = 0\n"))
	f.Add([]byte("[hypervisor.qemu]\nvirtio_fs_extra_args = [\"-o\"]\n"))
	f.Add([]byte("[hypervisor]\nqemu = 3\n"))
	// One file rewritten per input: a temporary directory per input cost
	// more than the load itself (about 200 executions a second).
	p := filepath.Join(f.TempDir(), "c.toml")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		c, err := LoadFile(p)
		if err != nil {
			return
		}
		_ = Validate(c, HostFacts{})
		_ = Validate(c, HostFacts{Dialect: refusingDialect{}})
	})
}

// FuzzApplyAnnotations checks that hostile annotation values (bad JSON,
// huge numbers, odd regexes in the config) give errors, never panics.
func FuzzApplyAnnotations(f *testing.F) {
	f.Add("shared_fs", "imagefs-blk", ".*")
	f.Add("virtio_fs_extra_args", `["--xattr"`, "virtio")
	f.Add("default_memory", "99999999999999999999", "(")
	f.Add("virtio_fs_daemon", "/usr/bin/../bin/sh", "daemon")
	f.Fuzz(func(t *testing.T, key, value, enable string) {
		c := Default()
		c.QEMU().EnableAnnotations = []string{enable}
		c.QEMU().ValidVirtioFSDaemonPaths = []string{"/usr/lib/qemu/*"}
		_, _ = Decide(c, Pod{Annotations: map[string]string{AnnotationHypervisorPrefix + key: value}, Rootfs: Rootfs{Kind: RootfsDir, Layers: []string{"/r"}}})
	})
}
