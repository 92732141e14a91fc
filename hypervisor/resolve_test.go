package hypervisor

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolveAccelUsesAndRefreshesCache(t *testing.T) {
	qemu := qemuBinary(t)
	if a, why := DetectAccel(context.Background(), qemu); a != AccelKVM {
		// Without usable KVM there is no boot probe and so nothing to cache:
		// check that ResolveAccel is DetectAccel and writes no verdict.
		// CI machines have no /dev/kvm, so this is their branch.
		dir := t.TempDir()
		if ra, rwhy := ResolveAccel(context.Background(), qemu, filepath.Join(dir, "vmlinux"), dir); ra != a || rwhy != why {
			t.Fatalf("without KVM ResolveAccel = %s, %q; DetectAccel says %s, %q", ra, rwhy, a, why)
		}
		if _, err := os.Stat(filepath.Join(dir, "accel.json")); !os.IsNotExist(err) {
			t.Fatalf("a verdict was cached without a boot probe: %v", err)
		}
		t.Skipf("no usable /dev/kvm (%s): checked that ResolveAccel returns DetectAccel's verdict uncached; the probe-and-cache path needs KVM", why)
	}
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinux")
	os.WriteFile(kernel, []byte("not a kernel"), 0o644)
	// A kernel that cannot boot makes the probe fail: TCG, with the reason.
	a, why := ResolveAccel(context.Background(), qemu, kernel, dir)
	if a != AccelTCG || !strings.Contains(why, "does not boot under KVM") {
		t.Fatalf("got %s: %s", a, why)
	}
	// The verdict is cached...
	b, err := os.ReadFile(filepath.Join(dir, "accel.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v accelVerdict
	if err := json.Unmarshal(b, &v); err != nil || v.Accel != AccelTCG {
		t.Fatalf("cache %s %v", b, err)
	}
	// ...and believed while its key holds: a forged KVM verdict is returned as such.
	v.Accel, v.Reason = AccelKVM, "forged"
	b, _ = json.Marshal(v)
	os.WriteFile(filepath.Join(dir, "accel.json"), b, 0o600)
	if a, why := ResolveAccel(context.Background(), qemu, kernel, dir); a != AccelKVM || !strings.Contains(why, "cached") {
		t.Fatalf("cache not used: %s %s", a, why)
	}
	// Changing the kernel invalidates it.
	os.WriteFile(kernel, []byte("another non-kernel"), 0o644)
	if a, _ := ResolveAccel(context.Background(), qemu, kernel, dir); a != AccelTCG {
		t.Fatalf("stale cache used: %s", a)
	}
}

// TestChooseAccel: an explicit setting stands without any probe; auto is
// ResolveAccel's verdict (with no kernel, DetectAccel's).
func TestChooseAccel(t *testing.T) {
	ctx := context.Background()
	for _, s := range []string{"kvm", "tcg"} {
		a, why := ChooseAccel(ctx, s, "/nonexistent/qemu", "", "")
		if string(a) != s || why != `kata_fsx.accelerator = "`+s+`"` {
			t.Errorf("ChooseAccel(%q) = %s, %q", s, a, why)
		}
	}
	qemu := qemuBinary(t)
	want, wantWhy := DetectAccel(ctx, qemu)
	if a, why := ChooseAccel(ctx, "auto", qemu, "", ""); a != want || why != wantWhy {
		t.Errorf("ChooseAccel(auto) = %s, %q; DetectAccel says %s, %q", a, why, want, wantWhy)
	}
}
