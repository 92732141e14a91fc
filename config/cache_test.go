package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCacheTableValidation: each bad [kata_fsx.cache] key is named with
// its fix, by Load's validation and by ValidateCache.
func TestCacheTableValidation(t *testing.T) {
	for _, tc := range []struct {
		body, key, fix string
	}{
		{`prune = "sometimes"`, "kata_fsx.cache.prune", `use "auto"`},
		{`blobs_mb = 2000000000000`, "kata_fsx.cache.blobs_mb", "or 0 for no budget"},
		{`content_mb = 1099511627777`, "kata_fsx.cache.content_mb", "use 20480"},
		{`prune_interval_minutes = 20000`, "kata_fsx.cache.prune_interval_minutes", "use 30"},
		{`min_age_minutes = 99999`, "kata_fsx.cache.min_age_minutes", "use 10"},
	} {
		p := filepath.Join(t.TempDir(), "c.toml")
		if err := os.WriteFile(p, []byte("[hypervisor.qemu]\n[kata_fsx.cache]\n"+tc.body+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := Load(p)
		if err != nil {
			t.Fatalf("%s: load: %v", tc.body, err)
		}
		err = ValidateCache(c)
		var ce *Error
		if !errors.As(err, &ce) || ce.Key != tc.key || !strings.Contains(ce.Fix, tc.fix) {
			t.Errorf("%s: got %v, want an error on %s with fix %q", tc.body, err, tc.key, tc.fix)
		}
		if err := ValidateSnapshotter(c); err == nil || !strings.Contains(err.Error(), tc.key) {
			t.Errorf("%s: ValidateSnapshotter: %v, want %s named", tc.body, err, tc.key)
		}
	}
}

// TestCacheTableDefaults: an absent table is DefaultCache, 0 is no
// budget, and the shipped file sets the defaults.
func TestCacheTableDefaults(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.toml")
	if err := os.WriteFile(p, []byte("[hypervisor.qemu]\n[kata_fsx.cache]\nblobs_mb = 0\nindexes_mb = 7\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := ValidateCache(c); err != nil {
		t.Fatal(err)
	}
	cc := c.KataFSX.Cache
	if _, ok := cc.Budget("blobs"); ok {
		t.Errorf("blobs_mb = 0 has a budget")
	}
	if b, ok := cc.Budget("indexes"); !ok || b != 7<<20 {
		t.Errorf("indexes budget %d %v, want 7 MiB", b, ok)
	}
	if b, ok := cc.Budget("content"); !ok || b != int64(DefaultCache().ContentMB)<<20 {
		t.Errorf("content budget %d %v, want the default", b, ok)
	}
	if cc.Prune != PruneAuto || cc.MinAge().Minutes() != 10 {
		t.Errorf("defaults not kept: %+v", cc)
	}
	data, err := os.ReadFile("../configuration.toml.in")
	if err != nil {
		t.Fatal(err)
	}
	d := DefaultCache()
	for _, want := range []string{"[kata_fsx.cache]", "metadata_mb = 4096", "indexes_mb = 1024", "blobs_mb = 20480", "content_mb = 20480",
		`prune = "auto"`, "prune_interval_minutes = 30", "min_age_minutes = 10"} {
		if !strings.Contains(string(data), want) {
			t.Errorf("configuration.toml.in lacks %s (defaults %+v)", want, d)
		}
	}
}
