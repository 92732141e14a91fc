package network

import (
	"strings"
	"testing"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

func TestIPNet(t *testing.T) {
	for _, tc := range []struct {
		addr, mask, want string
	}{
		{"10.254.61.3", "24", "10.254.61.3/24"},
		{"fd00::3", "64", "fd00::3/64"},
		{"10.0.0.1", "", "10.0.0.1/32"},
	} {
		got, err := ipNet(&pb.IPAddress{Address: tc.addr, Mask: tc.mask})
		if err != nil || got.String() != tc.want {
			t.Errorf("ipNet(%s, %q) = %v, %v; want %s", tc.addr, tc.mask, got, err, tc.want)
		}
	}
	for _, tc := range []struct{ addr, mask, words string }{
		{"10.0.0.300", "24", "not an IP address"},
		{"10.0.0.1", "33", "want a prefix length 0..32"},
		{"fd00::1", "255.255.255.0", "want a prefix length 0..128"},
	} {
		if _, err := ipNet(&pb.IPAddress{Address: tc.addr, Mask: tc.mask}); err == nil || !strings.Contains(err.Error(), tc.words) {
			t.Errorf("ipNet(%s, %q): %v, want an error with %q", tc.addr, tc.mask, err, tc.words)
		}
	}
}
