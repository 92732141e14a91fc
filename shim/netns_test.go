package shim

import (
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestNetNSPath(t *testing.T) {
	withNS := func(nss ...specs.LinuxNamespace) *specs.Spec {
		return &specs.Spec{Linux: &specs.Linux{Namespaces: nss}}
	}
	for _, tc := range []struct {
		name string
		spec *specs.Spec
		want string
	}{
		{"CRI pod", withNS(specs.LinuxNamespace{Type: specs.PIDNamespace}, specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: "/var/run/netns/cni-1"}), "/var/run/netns/cni-1"},
		{"new namespace", withNS(specs.LinuxNamespace{Type: specs.NetworkNamespace}), ""},
		{"host network", withNS(specs.LinuxNamespace{Type: specs.PIDNamespace}), ""},
		{"no linux section", &specs.Spec{}, ""},
		{"no spec", nil, ""},
	} {
		if got := netNSPath(tc.spec); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
