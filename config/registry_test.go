package config

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestRegistryConfigPath(t *testing.T) {
	host := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	c, err := LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if c.KataFSX.Registry.ConfigPath != "/etc/containerd/certs.d" {
		t.Fatalf("default config_path %q, want containerd's", c.KataFSX.Registry.ConfigPath)
	}
	c, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n[kata_fsx.registry]\nconfig_path = \"certs.d\"\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	err = Validate(c, host)
	var ce *Error
	found := false
	for _, e := range unwrapAll(err) {
		if errors.As(e, &ce) && ce.Key == "kata_fsx.registry.config_path" {
			found = true
		}
	}
	if !found {
		t.Fatalf("relative config_path: %v, want an error naming kata_fsx.registry.config_path", err)
	}
	c.KataFSX.Registry.ConfigPath = ""
	for _, e := range unwrapAll(Validate(c, host)) {
		if errors.As(e, &ce) && ce.Key == "kata_fsx.registry.config_path" {
			t.Fatalf("empty config_path (none) refused: %v", e)
		}
	}
}

func unwrapAll(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	if err == nil {
		return nil
	}
	return []error{err}
}

func TestRegistryLazyStoreKeys(t *testing.T) {
	host := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	c, err := LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if r := c.KataFSX.Registry; r != DefaultRegistry() || !r.Prefetch || r.ReadDeadline().Seconds() != DefaultReadTimeout || r.MaxIndexMB != 64 {
		t.Fatalf("defaults %+v, want %+v", r, DefaultRegistry())
	}
	// A node replays traces but pushes none of its own unless told to.
	if r := c.KataFSX.Registry; r.PushTrace || r.MaxTraceMB != 512 {
		t.Fatalf("defaults push_trace %v, max_trace_mb %d; want false, 512", r.PushTrace, r.MaxTraceMB)
	}
	c, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n[kata_fsx.registry]\npush_trace = true\nmax_trace_mb = 64\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if r := c.KataFSX.Registry; !r.PushTrace || r.MaxTraceMB != 64 || !r.Prefetch {
		t.Fatalf("push_trace = true, max_trace_mb = 64 read as %+v", r)
	}
	if err := Validate(c, host); err != nil {
		for _, e := range unwrapAll(err) {
			var ce *Error
			if errors.As(e, &ce) && strings.HasPrefix(ce.Key, "kata_fsx.registry.") {
				t.Fatalf("push_trace = true, max_trace_mb = 64 refused: %v", e)
			}
		}
	}
	body := "[hypervisor.qemu]\n[kata_fsx.registry]\nauth_file = \"auth.json\"\nread_timeout = 0\ncache_memory_mb = -1\nmax_fetch_mb = 4096\nbackground_fill_mbps = -5\ntrace_seconds = 0\nmax_trace_mb = 0\nmax_index_mb = 4097\n"
	c, err = LoadFile(writeFile(t, filepath.Join(t.TempDir(), "c.toml"), body, 0o644))
	if err != nil {
		t.Fatal(err)
	}
	bad := map[string]bool{}
	var ce *Error
	for _, e := range unwrapAll(Validate(c, host)) {
		if errors.As(e, &ce) {
			bad[ce.Key] = true
		}
	}
	for _, k := range []string{"auth_file", "read_timeout", "cache_memory_mb", "max_fetch_mb", "max_index_mb", "background_fill_mbps", "trace_seconds", "max_trace_mb"} {
		if !bad["kata_fsx.registry."+k] {
			t.Errorf("bad %s not refused by name (refused: %v)", k, bad)
		}
	}
}
