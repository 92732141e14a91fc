package registry

import (
	"strings"
	"testing"
)

func TestParseReference(t *testing.T) {
	const d = "sha256:" + "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for in, want := range map[string]string{
		"alpine":                            "docker.io/library/alpine:latest",
		"user/app:1.0":                      "docker.io/user/app:1.0",
		"index.docker.io/library/busybox":   "docker.io/library/busybox:latest",
		"docker.io/busybox":                 "docker.io/library/busybox:latest",
		"localhost/app":                     "localhost/app:latest",
		"127.0.0.1:5000/a/b:v1":             "127.0.0.1:5000/a/b:v1",
		"[::1]:5000/a":                      "[::1]:5000/a:latest",
		"ghcr.io/o/r@" + d:                  "ghcr.io/o/r@" + d,
		"ghcr.io/o/r:t@" + d:                "ghcr.io/o/r:t@" + d,
		"registry.example.com:443/x__y/z-z": "registry.example.com:443/x__y/z-z:latest",
	} {
		r, err := ParseReference(in)
		if err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		if r.String() != want {
			t.Errorf("%s = %s, want %s", in, r, want)
		}
	}
	for _, in := range []string{"", "a/UPPER", "a/b:", "a/b@sha256:short", "a//b", "host:5000/", "a/b:" + strings.Repeat("t", 129), "a/-b", "ex ample.com/a"} {
		if r, err := ParseReference(in); err == nil {
			t.Errorf("%q accepted as %s", in, r)
		} else if !strings.Contains(err.Error(), "HOST[:PORT]/REPO") {
			t.Errorf("%q: error %v does not say the form", in, err)
		}
	}
}

func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"alpine", "127.0.0.1:5000/a/b:v1", "a/b@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "[::1]/x", "A/b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReference(s)
		if err != nil {
			return
		}
		// A normalised reference parses to itself.
		r2, err := ParseReference(r.String())
		if err != nil || r2 != r {
			t.Fatalf("%q -> %q -> %+v %v", s, r.String(), r2, err)
		}
	})
}
