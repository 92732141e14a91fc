package registry

import (
	"net/url"
	"testing"
)

// TestSameOrigin: only the registry's own scheme, host and port (default
// ports spelled or not, host in any case) count as the registry.
func TestSameOrigin(t *testing.T) {
	for _, tc := range []struct {
		target, scheme, host string
		want                 bool
	}{
		{"https://reg.example/v2/x", "https", "reg.example", true},
		{"https://REG.example:443/v2/x", "https", "reg.example", true},
		{"https://reg.example/v2/x", "https", "reg.example:443", true},
		{"http://reg.example:80/v2/x", "http", "reg.example", true},
		{"https://[::1]:5000/x", "https", "[::1]:5000", true},
		{"http://reg.example/v2/x", "https", "reg.example", false},       // downgrade
		{"http://reg.example:443/v2/x", "https", "reg.example", false},   // downgrade, same port
		{"https://reg.example:5001/v2/x", "https", "reg.example", false}, // another port
		{"https://storage.reg.example/x", "https", "reg.example", false}, // a subdomain is another host
		{"https://reg.example.evil/x", "https", "reg.example", false},
		{"https://[::1]:5001/x", "https", "[::1]:5000", false},
	} {
		u, err := url.Parse(tc.target)
		if err != nil {
			t.Fatal(err)
		}
		if got := sameOrigin(u, Host{Scheme: tc.scheme, Host: tc.host}); got != tc.want {
			t.Errorf("sameOrigin(%s, %s://%s) = %v, want %v", tc.target, tc.scheme, tc.host, got, tc.want)
		}
	}
}
