package shim

import (
	"os"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/mount"
)

// A server that start did not give a mount namespace of its own refuses to
// serve rather than make its binds in the host's table (and, there, make
// the host's mounts slaves).
func TestEnterOwnMountsRefusesTheHosts(t *testing.T) {
	f, err := os.Open("/proc/self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	host, err := mount.NamespaceOf(f)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	err = enterOwnMounts(host)
	if err == nil || !strings.Contains(err.Error(), "host's mount namespace") {
		t.Fatalf("enterOwnMounts in the host's own namespace: %v, want a refusal", err)
	}
}
