package config

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestInterNetworkingModel(t *testing.T) {
	host := HostFacts{QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	if got := Default().InterNetworking(); got != "tcfilter" {
		t.Errorf("default internetworking_model: %q, want Kata's tcfilter", got)
	}
	for _, tc := range []struct{ value, model, refusal string }{
		{"tcfilter", "tcfilter", ""},
		{"none", "none", ""},
		{"default", "tcfilter", ""},
		{"macvtap", "", "valid for Kata but not supported by kata-fsx"},
		{"bridged", "", "unknown internetworking model"},
	} {
		dir := t.TempDir()
		p := writeFile(t, filepath.Join(dir, "c.toml"), "[hypervisor.qemu]\n[runtime]\ninternetworking_model = \""+tc.value+"\"\n", 0o644)
		c, err := LoadFile(p)
		if err != nil {
			t.Fatalf("%s: %v", tc.value, err)
		}
		for _, k := range c.Ignored {
			if strings.Contains(k.Key, "internetworking_model") {
				t.Errorf("%s: the key is honoured, yet listed as ignored: %v", tc.value, k)
			}
		}
		c.QEMU().VirtioFSDaemon = validConfig(t).QEMU().VirtioFSDaemon
		c.QEMU().Kernel, c.QEMU().Initrd = "/k", "/i"
		err = Validate(c, host)
		if tc.refusal == "" {
			if err != nil {
				t.Errorf("%s refused: %v", tc.value, err)
			} else if got := c.InterNetworking(); got != tc.model {
				t.Errorf("%s: model %q, want %q", tc.value, got, tc.model)
			}
			continue
		}
		var ce *Error
		if err == nil || !errors.As(err, &ce) || ce.Key != "runtime.internetworking_model" || !strings.Contains(err.Error(), tc.refusal) || !strings.Contains(ce.Fix, "tcfilter") {
			t.Errorf("%s: got %v, want an error naming runtime.internetworking_model (%s) with a fix", tc.value, err, tc.refusal)
		}
	}
}

// Kata's disable_new_netns is not honoured: setting it is reported.
func TestDisableNewNetnsReported(t *testing.T) {
	p := writeFile(t, filepath.Join(t.TempDir(), "c.toml"), "[hypervisor.qemu]\n[runtime]\ndisable_new_netns = true\n", 0o644)
	c, err := LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range c.Ignored {
		if k.Key == "runtime.disable_new_netns" && strings.Contains(k.String(), `internetworking_model = "none"`) {
			return
		}
	}
	t.Errorf("disable_new_netns = true not reported as ignored: %v", c.Ignored)
}
