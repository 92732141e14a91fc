package config

import (
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
)

func TestResolveVCPUsAsKata(t *testing.T) {
	for _, tc := range []struct {
		req  float32
		host int
		want int32
	}{
		{0, 8, 1}, {1, 8, 1}, {0.5, 8, 1}, {1.5, 8, 2}, {2.01, 8, 3}, {8, 8, 8},
		{9, 8, 8}, {-1, 8, 8}, {-0.5, 8, 8}, {float32(math.Inf(1)), 8, 8}, {float32(math.NaN()), 8, 0},
	} {
		if got := resolveVCPUs(tc.req, tc.host); got != tc.want {
			t.Errorf("resolveVCPUs(%v, %d) = %d, want %d", tc.req, tc.host, got, tc.want)
		}
	}
}

func TestZeroValuesMeanKataDefaults(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), `[hypervisor.qemu]
default_vcpus = 0
default_memory = 0
virtio_fs_cache = ""
virtio_fs_queue_size = 0
`, 0o644)
	c, err := LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	q := c.QEMU()
	if q.DefaultVCPUs != 1 || q.DefaultMemory != 2048 || q.VirtioFSCache != "never" || q.VirtioFSQueueSize != 1024 {
		t.Fatalf("zero values not defaulted as Kata: vcpus %d mem %d cache %q queue %d", q.DefaultVCPUs, q.DefaultMemory, q.VirtioFSCache, q.VirtioFSQueueSize)
	}
	// Below Kata's minimum of 256 MiB is the default too.
	p = writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\ndefault_memory = 128\n", 0o644)
	if c, err = LoadFile(p); err != nil || c.QEMU().DefaultMemory != 2048 {
		t.Fatalf("default_memory = 128: %v %v", c, err)
	}
}

func TestFloatVCPUsLoad(t *testing.T) {
	for _, tc := range []struct {
		value string
		want  int32
	}{{"1.5", 2}, {"2", 2}, {"-1", int32(hostCPUs())}, {"100000", int32(hostCPUs())}} {
		p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\ndefault_vcpus = "+tc.value+"\n", 0o644)
		c, err := LoadFile(p)
		if err != nil {
			t.Fatalf("default_vcpus = %s: %v", tc.value, err)
		}
		if c.QEMU().DefaultVCPUs != tc.want {
			t.Errorf("default_vcpus = %s gives %d vCPUs, want %d", tc.value, c.QEMU().DefaultVCPUs, tc.want)
		}
	}
}

func TestVCPUAndMemoryAnnotationsAsKata(t *testing.T) {
	c := Default()
	c.QEMU().EnableAnnotations = []string{"default_vcpus", "default_memory"}
	n, err := ApplyAnnotations(c, map[string]string{AnnotationDefaultVCPUs: "0.5"})
	if err != nil || n.QEMU().DefaultVCPUs != 1 {
		t.Fatalf("default_vcpus 0.5: %v", err)
	}
	if _, err := ApplyAnnotations(c, map[string]string{AnnotationDefaultVCPUs: "100000"}); err == nil || !strings.Contains(err.Error(), "greater than the number of CPUs") {
		t.Fatalf("too many vCPUs: %v", err)
	}
	if _, err := ApplyAnnotations(c, map[string]string{AnnotationDefaultVCPUs: "-1"}); err == nil || !strings.Contains(err.Error(), "positive numeric value") {
		t.Fatalf("negative vCPUs: %v", err)
	}
	if _, err := ApplyAnnotations(c, map[string]string{AnnotationDefaultMemory: "100"}); err == nil || !strings.Contains(err.Error(), "less than minimum required 256") {
		t.Fatalf("small memory: %v", err)
	}
}

// TestKataStockConfigIgnoredKeys loads Kata's own configuration-qemu.toml,
// rendered from Kata's repository, and holds the exact list of VM-changing
// keys it sets that kata-fsx does not implement.
func TestKataStockConfigIgnoredKeys(t *testing.T) {
	c, err := LoadFile("testdata/kata-configuration-qemu.toml")
	if err != nil {
		t.Fatalf("Kata's configuration-qemu.toml did not load: %v", err)
	}
	q := c.QEMU()
	if q.Path != "/usr/bin/qemu-system-x86_64" || q.VirtioFSDaemon != "/usr/libexec/virtiofsd" || q.DefaultVCPUs != 1 || q.DefaultMemory != 2048 || q.VirtioFSCache != "auto" {
		t.Fatalf("keys not read: %+v", q)
	}
	var got []string
	for _, k := range c.Ignored {
		got = append(got, k.Key+" = "+k.Value)
	}
	want := []string{
		`hypervisor.qemu.block_device_driver = "virtio-scsi"`,
		`hypervisor.qemu.cpu_features = "pmu=off"`,
		`hypervisor.qemu.disable_block_device_use = true`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("ignored keys of Kata's stock file:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestIgnoredKeysFollowDropIns(t *testing.T) {
	dir := t.TempDir()
	base := writeFile(t, filepath.Join(dir, "configuration.toml"), "[hypervisor.qemu]\nenable_hugepages = true\nmemory_offset = 8192\n[factory]\nenable_template = true\n", 0o644)
	writeFile(t, filepath.Join(dir, "config.d", "10.toml"), "[hypervisor.qemu]\nenable_hugepages = false\n[agent.kata]\ndebug_console_enabled = true\n", 0o644)
	c, err := LoadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, k := range c.Ignored {
		got = append(got, k.String())
	}
	want := []string{
		"agent.kata.debug_console_enabled = true ignored by kata-fsx: no debug console in the guest (set it to false or remove it)",
		"factory.enable_template = true ignored by kata-fsx: no VM templating (set it to false or remove it)",
		"hypervisor.qemu.memory_offset = 8192 ignored by kata-fsx: no memory hot-plug (set it to 0 or remove it)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("got:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestIgnoredTableKeysAreKatas checks that every key of the table is a key
// of Kata's configuration-qemu.toml, so a misspelt row cannot hide.
func TestIgnoredTableKeysAreKatas(t *testing.T) {
	data, err := os.ReadFile("testdata/kata-configuration-qemu.toml")
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if _, err := toml.Decode(string(data), &raw); err != nil {
		t.Fatal(err)
	}
	for _, row := range kataIgnored {
		var v any = raw
		for _, part := range strings.Split(row.key, ".") {
			m, _ := v.(map[string]any)
			v = m[part]
		}
		if v == nil {
			t.Errorf("%s is not a key of Kata's configuration-qemu.toml", row.key)
		}
		if row.reason == "" || strings.Contains(row.reason, "\n") {
			t.Errorf("%s: want a one-line reason", row.key)
		}
	}
}

// TestOwnConfigurationIgnoresNothing keeps kata-fsx's shipped
// configuration from setting a key that check would then call ignored.
func TestOwnConfigurationIgnoresNothing(t *testing.T) {
	b, err := os.ReadFile("../configuration.toml.in")
	if err != nil {
		t.Fatal(err)
	}
	rendered := regexp.MustCompile(`@[A-Z]+@`).ReplaceAll(b, []byte("/rendered"))
	p := filepath.Join(t.TempDir(), "configuration-fsx.toml")
	if err := os.WriteFile(p, rendered, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := LoadFile(p)
	if err != nil {
		t.Fatalf("configuration.toml.in, rendered, does not load: %v", err)
	}
	for _, k := range c.Ignored {
		t.Errorf("configuration.toml.in sets an ignored key: %s", k)
	}
}

// TestImageKeysRead holds that Kata's image keys are read, not reported
// as ignored: kata-fsx boots the image.
func TestImageKeysRead(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\nkernel = \"/k\"\nimage = \"/usr/share/kata-containers/kata-containers.img\"\ndisable_image_nvdimm = true\nrootfs_type = \"ext4\"\n", 0o644)
	c, err := LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if q := c.QEMU(); q.Image != "/usr/share/kata-containers/kata-containers.img" || !q.DisableImageNvdimm {
		t.Fatalf("image keys not read: image %q disable_image_nvdimm %v", q.Image, q.DisableImageNvdimm)
	}
	if len(c.Ignored) != 0 {
		t.Fatalf("ignored: %v", c.Ignored)
	}
	p = writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\nrootfs_type = \"erofs\"\n", 0o644)
	if c, err = LoadFile(p); err != nil {
		t.Fatal(err)
	}
	if len(c.Ignored) != 1 || c.Ignored[0].Key != "hypervisor.qemu.rootfs_type" {
		t.Fatalf("rootfs_type erofs: %v", c.Ignored)
	}
}

// TestStaticSandboxResourceMgmt: Kata's [runtime] key is read and honoured,
// so setting it reports nothing as ignored.
func TestStaticSandboxResourceMgmt(t *testing.T) {
	dir := t.TempDir()
	c, err := LoadFile(writeFile(t, filepath.Join(dir, "configuration.toml"), "[hypervisor.qemu]\n[runtime]\nstatic_sandbox_resource_mgmt = true\n", 0o644))
	if err != nil {
		t.Fatal(err)
	}
	if !c.Runtime.StaticSandboxResourceMgmt {
		t.Error("static_sandbox_resource_mgmt = true not read")
	}
	if c.Runtime.DisableGuestSeccomp {
		t.Error("disable_guest_seccomp absent but read as true")
	}
	if len(c.Ignored) != 0 {
		t.Errorf("reported as ignored: %v", c.Ignored)
	}
	c, err = LoadFile(writeFile(t, filepath.Join(dir, "off.toml"), "[hypervisor.qemu]\n[runtime]\nenable_debug = true\ndisable_guest_seccomp = true\n", 0o644))
	if err != nil || c.Runtime.StaticSandboxResourceMgmt || !c.Runtime.DisableGuestSeccomp {
		t.Errorf("absent static key, disable_guest_seccomp = true: %v %v %v", c.Runtime.StaticSandboxResourceMgmt, c.Runtime.DisableGuestSeccomp, err)
	}
}
