package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeFile(t *testing.T, path, content string, mode os.FileMode) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestStockKataConfigLoads(t *testing.T) {
	c, err := LoadFile("testdata/kata-stock.toml")
	if err != nil {
		t.Fatalf("stock Kata configuration did not load: %v", err)
	}
	q := c.QEMU()
	if q.Path != "/opt/kata/bin/qemu-system-x86_64" || q.SharedFS != "virtio-fs" || q.VirtioFSDaemon != "/opt/kata/libexec/virtiofsd" {
		t.Fatalf("keys not read: %+v", q)
	}
	if got := strings.Join(q.VirtioFSExtraArgs, " "); got != "--thread-pool-size=1 --announce-submounts" {
		t.Fatalf("virtio_fs_extra_args = %q", got)
	}
	if c.AgentKata().DialTimeout != 45 || c.SharedFS() != "virtio-fs" {
		t.Fatalf("dial_timeout %d shared_fs %q", c.AgentKata().DialTimeout, c.SharedFS())
	}
	// Keys Kata sets that we do not: our defaults must fill them.
	if c.KataFSX.ImagefsBlk.BlockSize != 4096 || c.KataFSX.Accelerator != "auto" {
		t.Fatalf("kata_fsx defaults missing: %+v", c.KataFSX)
	}
}

func TestDropInsMergePerKeyInLexicalOrder(t *testing.T) {
	dir := t.TempDir()
	base := writeFile(t, filepath.Join(dir, "configuration.toml"), `
[hypervisor.qemu]
default_memory = 1024
default_vcpus = 2
virtio_fs_cache = "auto"
[kata_fsx.imagefs_blk]
num_queues = 2
`, 0o644)
	writeFile(t, filepath.Join(dir, "config.d", "20-b.toml"), "[hypervisor.qemu]\ndefault_memory = 4096\n", 0o644)
	writeFile(t, filepath.Join(dir, "config.d", "10-a.toml"), "[hypervisor.qemu]\ndefault_memory = 3072\nvirtio_fs_cache = \"always\"\n", 0o644)
	writeFile(t, filepath.Join(dir, "config.d", "ignored.txt"), "[hypervisor.qemu]\ndefault_memory = 1\n", 0o644)
	c, err := LoadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	q := c.QEMU()
	if q.DefaultMemory != 4096 || q.DefaultVCPUs != 2 || q.VirtioFSCache != "always" || c.KataFSX.ImagefsBlk.NumQueues != 2 {
		t.Fatalf("merge wrong: mem %d vcpus %d cache %q queues %d", q.DefaultMemory, q.DefaultVCPUs, q.VirtioFSCache, c.KataFSX.ImagefsBlk.NumQueues)
	}
	if len(c.DropIns) != 2 || filepath.Base(c.DropIns[0]) != "10-a.toml" {
		t.Fatalf("drop-ins %v", c.DropIns)
	}
}

func TestLocateOrder(t *testing.T) {
	t.Setenv(EnvConfigFile, "/from/env.toml")
	if p, _ := Locate("/explicit.toml"); p != "/explicit.toml" {
		t.Fatalf("explicit path not first: %s", p)
	}
	if p, _ := Locate(""); p != "/from/env.toml" {
		t.Fatalf("env not second: %s", p)
	}
}

func TestBadTOMLNamesLine(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\npath = \"/x\"\ndefault_memory = = 3\n", 0o644)
	_, err := LoadFile(p)
	if err == nil || !strings.Contains(err.Error(), p+":3:") {
		t.Fatalf("want error naming line 3, got %v", err)
	}
}

func TestWrongTypeNamesKey(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\ndefault_memory = \"lots\"\n", 0o644)
	_, err := LoadFile(p)
	if err == nil || !strings.Contains(err.Error(), "default_memory") {
		t.Fatalf("want error naming default_memory, got %v", err)
	}
}

func TestUnknownKataFSXKeyRejected(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nblock_sise = 4096\n", 0o644)
	_, err := LoadFile(p)
	var ce *Error
	if !errors.As(err, &ce) || ce.Key != "kata_fsx.imagefs_blk.block_sise" {
		t.Fatalf("want *Error for the misspelt key, got %v", err)
	}
}

func TestNoQEMUTable(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.clh]\npath = \"/x\"\n", 0o644)
	if _, err := LoadFile(p); err == nil || !strings.Contains(err.Error(), "hypervisor.qemu") {
		t.Fatalf("want error naming hypervisor.qemu, got %v", err)
	}
}

// validConfig returns a configuration that passes Validate on a host with
// an executable fake daemon path.
func validConfig(t *testing.T) *Config {
	t.Helper()
	c := Default()
	c.QEMU().VirtioFSDaemon = writeFile(t, filepath.Join(t.TempDir(), "virtiofsd"), "#!/bin/sh\n", 0o755)
	c.QEMU().Kernel = "/k"
	c.QEMU().Initrd = "/i"
	return c
}

func TestValidateOK(t *testing.T) {
	c := validConfig(t)
	if err := Validate(c, HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}); err != nil {
		t.Fatalf("valid configuration refused: %v", err)
	}
}

// TestValidateAgentTransports: every transport agent_transport names is
// accepted; whether it works on the host is package host's to say.
func TestValidateAgentTransports(t *testing.T) {
	for _, tr := range []string{TransportAuto, TransportVsock, TransportHybridVsock, TransportVirtioSerial} {
		c := validConfig(t)
		c.KataFSX.AgentTransport = tr
		if err := Validate(c, HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}); err != nil {
			t.Errorf("agent_transport = %q refused: %v", tr, err)
		}
	}
	c := validConfig(t)
	c.QEMU().SharedFS = SharedFS9P
	if err := Validate(c, HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 64}); err != nil {
		t.Errorf("9p over virtio-serial needs no /dev/shm: %v", err)
	}
}

// TestValidateMemfdGuestRAMIgnoresShm: guest RAM in a memfd does not
// depend on /dev/shm, so a full one refuses nothing; a file_mem_backend
// in /dev/shm still needs the room there.
func TestValidateMemfdGuestRAMIgnoresShm(t *testing.T) {
	c := validConfig(t)
	full := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 0, GuestRAMMemfd: true}
	if err := Validate(c, full); err != nil {
		t.Errorf("memfd guest RAM refused for a full /dev/shm: %v", err)
	}
	c.QEMU().FileMemBackend = "/dev/shm"
	full.GuestRAMMemfd = false
	if err := Validate(c, full); err == nil || !strings.Contains(err.Error(), "/dev/shm") {
		t.Errorf("file_mem_backend = /dev/shm with none free: %v, want an error naming /dev/shm", err)
	}
}

func TestValidateErrorsNameTheKey(t *testing.T) {
	host := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	cases := []struct {
		name  string
		edit  func(c *Config, h *HostFacts)
		key   string
		words string
	}{
		{"unknown shared_fs", func(c *Config, h *HostFacts) { c.QEMU().SharedFS = "nfs" }, "hypervisor.qemu.shared_fs", "unknown shared filesystem"},
		{"unknown kata_fsx shared_fs", func(c *Config, h *HostFacts) { c.KataFSX.SharedFS = "blk" }, "kata_fsx.shared_fs", "unknown"},
		{"virtio-fs without daemon", func(c *Config, h *HostFacts) { c.QEMU().VirtioFSDaemon = "" }, "hypervisor.qemu.virtio_fs_daemon", "without daemon path"},
		{"daemon missing", func(c *Config, h *HostFacts) { c.QEMU().VirtioFSDaemon = "/nonexistent/virtiofsd" }, "hypervisor.qemu.virtio_fs_daemon", "no such file"},
		{"daemon not executable", func(c *Config, h *HostFacts) {
			c.QEMU().VirtioFSDaemon = writeFile(t, filepath.Join(t.TempDir(), "vfsd"), "x", 0o644)
		}, "hypervisor.qemu.virtio_fs_daemon", "not executable"},
		{"unknown cache mode", func(c *Config, h *HostFacts) { c.QEMU().VirtioFSCache = "sometimes" }, "hypervisor.qemu.virtio_fs_cache", "unknown cache mode"},
		{"the daemon's dialect", func(c *Config, h *HostFacts) { h.Dialect = refusingDialect{} }, "hypervisor.qemu.virtio_fs_extra_args", "not in this dialect"},
		{"DAX unsupported", func(c *Config, h *HostFacts) { c.QEMU().VirtioFSCacheSize = 1024 }, "hypervisor.qemu.virtio_fs_cache_size", "cache-size"},
		{"DAX window too big", func(c *Config, h *HostFacts) {
			c.QEMU().VirtioFSCacheSize = 1 << 20
			h.QEMUHasDAX = true
		}, "hypervisor.qemu.virtio_fs_cache_size", "does not fit"},
		{"default_memory 0", func(c *Config, h *HostFacts) { c.QEMU().DefaultMemory = 0 }, "hypervisor.qemu.default_memory", "needs memory"},
		{"shm too small", func(c *Config, h *HostFacts) { h.ShmFreeMiB = 64 }, "hypervisor.qemu.default_memory", "/dev/shm"},
		{"queue size", func(c *Config, h *HostFacts) { c.KataFSX.ImagefsBlk.QueueSize = 100 }, "kata_fsx.imagefs_blk.queue_size", "power of two"},
		{"block size", func(c *Config, h *HostFacts) { c.KataFSX.ImagefsBlk.BlockSize = 8192 }, "kata_fsx.imagefs_blk.block_size", "1024, 2048 or 4096"},
		{"accelerator", func(c *Config, h *HostFacts) { c.KataFSX.Accelerator = "hvf" }, "kata_fsx.accelerator", "unknown accelerator"},
		{"transport", func(c *Config, h *HostFacts) { c.KataFSX.AgentTransport = "tcp" }, "kata_fsx.agent_transport", "use auto, vsock, hybrid-vsock or virtio-serial"},
		{"shm too small for hybrid vsock", func(c *Config, h *HostFacts) {
			c.QEMU().SharedFS = SharedFS9P
			h.ShmFreeMiB, h.AgentSharesMemory = 64, true
		}, "hypervisor.qemu.default_memory", "/dev/shm"},
		{"block aio", func(c *Config, h *HostFacts) { c.QEMU().BlockDeviceAIO = "posix" }, "hypervisor.qemu.block_device_aio", "unknown aio mode"},
		{"native aio without O_DIRECT", func(c *Config, h *HostFacts) { c.QEMU().BlockDeviceAIO = "native" }, "hypervisor.qemu.block_device_aio", "needs O_DIRECT"},
		{"image and initrd", func(c *Config, h *HostFacts) { c.QEMU().Image = "/img" }, "hypervisor.qemu.initrd", `cannot set both image and initrd at the same time (hypervisor.qemu.image = "/img")`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig(t)
			h := host
			tc.edit(c, &h)
			err := Validate(c, h)
			if err == nil {
				t.Fatal("accepted")
			}
			var found bool
			for _, e := range unjoin(err) {
				var ce *Error
				if errors.As(e, &ce) && ce.Key == tc.key && strings.Contains(ce.Error(), tc.words) && ce.Fix != "" {
					found = true
				}
			}
			if !found {
				t.Fatalf("no error for key %s containing %q with a fix; got:\n%v", tc.key, tc.words, err)
			}
		})
	}
}

func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// refusingDialect is a daemon dialect that accepts every cache mode and
// refuses every extra argument list, so that a test sees Validate ask it.
type refusingDialect struct{}

func (refusingDialect) CacheMode(mode string) (string, error) { return mode, nil }

func (refusingDialect) ExtraArgs(args []string) ([]string, error) {
	return nil, &Error{Key: "hypervisor.qemu.virtio_fs_extra_args", Problem: "not in this dialect", Fix: "any"}
}
