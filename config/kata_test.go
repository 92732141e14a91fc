package config

import (
	"math"
	"path/filepath"
	"strings"
	"testing"
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
