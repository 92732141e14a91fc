package hypervisor

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestProbeKVMMissingNode(t *testing.T) {
	ok, reason := probeKVM(filepath.Join(t.TempDir(), "kvm"))
	if ok || !strings.Contains(reason, "no such file") {
		t.Fatalf("ok=%v reason=%q", ok, reason)
	}
}

func TestProbeKVMNotKVM(t *testing.T) {
	// /dev/null opens read-write but rejects KVM ioctls: the open alone must not count.
	ok, reason := probeKVM("/dev/null")
	if ok || !strings.Contains(reason, "KVM_GET_API_VERSION") {
		t.Fatalf("ok=%v reason=%q", ok, reason)
	}
}

func TestDetectAccelMatchesHost(t *testing.T) {
	accel, reason := DetectAccel(context.Background(), "")
	if reason == "" {
		t.Error("empty reason")
	}
	_, statErr := os.Stat("/dev/kvm")
	switch accel {
	case AccelKVM:
		if statErr != nil {
			t.Fatalf("KVM chosen without /dev/kvm: %v", statErr)
		}
	case AccelTCG:
		t.Logf("TCG: %s", reason)
		if os.IsNotExist(statErr) && !strings.Contains(reason, "no such file") {
			t.Errorf("reason %q does not say /dev/kvm is missing", reason)
		}
	default:
		t.Fatalf("accel %q", accel)
	}
	if qemu := qemuBinaryOrEmpty(); qemu != "" {
		a2, r2 := DetectAccel(context.Background(), qemu)
		if accel == AccelTCG && a2 != AccelTCG {
			t.Errorf("binary check turned TCG into %s (%s)", a2, r2)
		}
	}
	if a, r := DetectAccel(context.Background(), "/nonexistent/qemu"); accel == AccelKVM && (a != AccelTCG || !strings.Contains(r, "/nonexistent/qemu")) {
		t.Errorf("missing binary: %s %q", a, r)
	}
}

func TestVsockAndMemfd(t *testing.T) {
	ok, reason := VsockAvailable()
	_, err := os.Stat("/dev/vhost-vsock")
	if os.IsNotExist(err) && (ok || !strings.Contains(reason, "/dev/vhost-vsock: no such file")) {
		t.Errorf("vsock ok=%v reason=%q with no device node", ok, reason)
	}
	if ok, reason := MemfdAvailable(); !ok {
		t.Errorf("memfd_create unavailable on this host: %s", reason)
	}
}

func qemuBinaryOrEmpty() string {
	p, err := resolveBinary("qemu-system-x86_64")
	if err != nil {
		return ""
	}
	return p
}
