package hypervisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/atomicfile"
)

// kvmBootTimeout bounds the KVM boot probe; a working KVM boots the probe
// kernel to its panic in about a second.
const kvmBootTimeout = 15 * time.Second

// accelVerdict is the cached outcome of ResolveAccel for one host, QEMU and kernel.
type accelVerdict struct {
	Key    string `json:"key"`
	Accel  Accel  `json:"accel"`
	Reason string `json:"reason"`
}

// ChooseAccel resolves a kata_fsx.accelerator setting: "kvm" and "tcg"
// stand as written, anything else ("auto") is ResolveAccel's verdict.
func ChooseAccel(ctx context.Context, setting, qemuPath, kernel, cacheDir string) (Accel, string) {
	switch a := Accel(setting); a {
	case AccelKVM, AccelTCG:
		return a, fmt.Sprintf("kata_fsx.accelerator = %q", setting)
	}
	return ResolveAccel(ctx, qemuPath, kernel, cacheDir)
}

// ResolveAccel is accelerator = "auto": KVM when DetectAccel accepts
// /dev/kvm and the guest kernel really boots under it (ProbeBoot), else
// TCG with the reason. The boot probe costs up to kvmBootTimeout, so its
// verdict is cached in cacheDir (keyed by host kernel, QEMU binary and
// guest kernel) and reused until one of them changes; an empty cacheDir
// disables the cache. Without a kernel the ioctl checks alone decide.
func ResolveAccel(ctx context.Context, qemuPath, kernel, cacheDir string) (Accel, string) {
	accel, why := DetectAccel(ctx, qemuPath)
	if accel != AccelKVM || kernel == "" {
		return accel, why
	}
	key, ok := verdictKey(qemuPath, kernel)
	cache := ""
	if ok && cacheDir != "" {
		cache = filepath.Join(cacheDir, "accel.json")
		if b, err := os.ReadFile(cache); err == nil {
			var v accelVerdict
			if json.Unmarshal(b, &v) == nil && v.Key == key && (v.Accel == AccelKVM || v.Accel == AccelTCG) {
				return v.Accel, v.Reason + " (cached in " + cache + ")"
			}
		}
	}
	pctx, cancel := context.WithTimeout(ctx, kvmBootTimeout)
	err := ProbeBoot(pctx, qemuPath, kernel, AccelKVM)
	cancel()
	if ctx.Err() != nil {
		return AccelTCG, fmt.Sprintf("KVM boot probe interrupted: %v", ctx.Err())
	}
	v := accelVerdict{Key: key, Accel: AccelKVM, Reason: why + "; the guest kernel boots under KVM"}
	if err != nil {
		v.Accel, v.Reason = AccelTCG, fmt.Sprintf("/dev/kvm is present but the guest kernel does not boot under KVM (%v)", err)
	}
	if cache != "" {
		if err := os.MkdirAll(cacheDir, 0o700); err == nil {
			if b, err := json.Marshal(v); err == nil {
				_ = atomicfile.WriteFile(cache, b, 0o600)
			}
		}
	}
	return v.Accel, v.Reason
}

// verdictKey identifies what a boot probe verdict depends on.
func verdictKey(qemuPath, kernel string) (string, bool) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "", false
	}
	key := unix.ByteSliceToString(u.Release[:])
	for _, p := range []string{qemuPath, kernel} {
		fi, err := os.Stat(p)
		if err != nil {
			return "", false
		}
		key += fmt.Sprintf("|%s:%d:%d", p, fi.Size(), fi.ModTime().UnixNano())
	}
	return key, true
}
