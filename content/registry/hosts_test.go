package registry

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseHostsFileMirrors(t *testing.T) {
	src := `server = "https://registry.example.com"

[host."https://mirror-b.example"]
  capabilities = ["pull", "resolve"]
  ca = "b.pem"

[host."http://mirror-a.example:5000/base"]
  capabilities = ["pull"]
  skip_verify = true
  client = [["c.crt", "c.key"]]
  [host."http://mirror-a.example:5000/base".header]
    x-custom = "1"

[host."https://mirror-c.example/custom"]
  override_path = true
  dial_timeout = "3s"
`
	hs, err := ParseHostsFile("/etc/certs.d/registry.example.com/hosts.toml", []byte(src), "registry.example.com")
	if err != nil {
		t.Fatal(err)
	}
	var urls []string
	for _, h := range hs {
		urls = append(urls, h.URL())
	}
	want := []string{"https://mirror-b.example/v2", "http://mirror-a.example:5000/base/v2", "https://mirror-c.example/custom", "https://registry.example.com/v2"}
	if strings.Join(urls, " ") != strings.Join(want, " ") {
		t.Fatalf("hosts %v, want in file order then the server: %v", urls, want)
	}
	if hs[0].Capabilities != CapPull|CapResolve || hs[1].Capabilities != CapPull || hs[2].Capabilities != capAll || hs[3].Capabilities != capAll {
		t.Fatalf("capabilities %v %v %v %v", hs[0].Capabilities, hs[1].Capabilities, hs[2].Capabilities, hs[3].Capabilities)
	}
	if hs[0].CAs[0] != "/etc/certs.d/registry.example.com/b.pem" {
		t.Fatalf("relative ca not anchored at the host directory: %v", hs[0].CAs)
	}
	if !hs[1].SkipVerify || hs[1].Clients[0] != (ClientCert{"/etc/certs.d/registry.example.com/c.crt", "/etc/certs.d/registry.example.com/c.key"}) || hs[1].Header["x-custom"][0] != "1" {
		t.Fatalf("mirror a: %+v", hs[1])
	}
	if hs[2].DialTimeout != 3*time.Second {
		t.Fatalf("dial_timeout %v", hs[2].DialTimeout)
	}
	if !hs[0].Mirror || hs[3].Mirror {
		t.Fatal("mirror flags wrong")
	}
}

func TestLookupHostsDefaults(t *testing.T) {
	dir := t.TempDir()
	// No file: https on the registry, Docker Hub on its API host.
	for host, want := range map[string]string{"docker.io": "https://registry-1.docker.io/v2", "127.0.0.1:5000": "https://127.0.0.1:5000/v2"} {
		hs, err := LookupHosts(dir, host)
		if err != nil || len(hs) != 1 || hs[0].URL() != want {
			t.Fatalf("%s: %v %v, want %s", host, hs, err, want)
		}
	}
	// _default applies to hosts without a directory of their own.
	os.MkdirAll(filepath.Join(dir, "_default"), 0o755)
	os.WriteFile(filepath.Join(dir, "_default", "hosts.toml"), []byte("[host.\"https://m.example\"]\n"), 0o644)
	hs, err := LookupHosts(dir, "other.example")
	if err != nil || len(hs) != 2 || hs[0].URL() != "https://m.example/v2" || hs[1].URL() != "https://other.example/v2" {
		t.Fatalf("_default: %v %v", hs, err)
	}
	// A host directory without hosts.toml is Docker's certs.d: CAs and
	// client pairs for https on the registry.
	os.MkdirAll(filepath.Join(dir, "legacy.example"), 0o755)
	for _, f := range []string{"ca.crt", "me.cert", "me.key"} {
		os.WriteFile(filepath.Join(dir, "legacy.example", f), nil, 0o644)
	}
	hs, err = LookupHosts(dir, "legacy.example")
	if err != nil || len(hs) != 1 || hs[0].URL() != "https://legacy.example/v2" || len(hs[0].CAs) != 1 || len(hs[0].Clients) != 1 ||
		hs[0].Clients[0].Key != filepath.Join(dir, "legacy.example", "me.key") {
		t.Fatalf("legacy directory: %+v %v", hs, err)
	}
	// Top-level settings without server apply to the default server.
	os.MkdirAll(filepath.Join(dir, "docker.io"), 0o755)
	os.WriteFile(filepath.Join(dir, "docker.io", "hosts.toml"), []byte("capabilities = [\"pull\"]\n"), 0o644)
	hs, err = LookupHosts(dir, "docker.io")
	if err != nil || len(hs) != 1 || hs[0].URL() != "https://registry-1.docker.io/v2" || hs[0].Capabilities != CapPull {
		t.Fatalf("docker.io: %+v %v", hs, err)
	}
}

func TestParseHostsFileRefusals(t *testing.T) {
	for _, tc := range []struct{ src, where string }{
		{"server = \"https://a\"\nservr = 1\n", "servr"},
		{"server = \"ftp://a\"\n", "server"},
		{"[host.\"a.example\"]\n", `host."a.example"`},
		{"[host.\"https://a\"]\ncapabilities = [\"pull\", \"delete\"]\n", `host."https://a".capabilities`},
		{"[host.\"https://a\"]\nca = 5\n", `host."https://a".ca`},
		{"[host.\"https://a\"]\nclient = [[\"a\"]]\n", `host."https://a".client`},
		{"[host.\"https://a\"]\nhost = 1\n", `host."https://a".host`},
		{"server = \"https://a\"\n\nserver = [\n", "line 3"},
		{"server = \"https://u:p@a\"\n", "server"},
		{"[host.\"https://a\"]\ndial_timeout = \"soon\"\n", `host."https://a".dial_timeout`},
	} {
		_, err := ParseHostsFile("h.toml", []byte(tc.src), "x")
		var he *HostsFileError
		if !errors.As(err, &he) {
			t.Errorf("%q: %v, want a HostsFileError", tc.src, err)
			continue
		}
		if !strings.Contains(he.Where, tc.where) && !strings.Contains(he.Error(), tc.where) {
			t.Errorf("%q: %v, want it to name %s", tc.src, err, tc.where)
		}
	}
}

func FuzzParseHostsFile(f *testing.F) {
	f.Add([]byte("server = \"https://r\"\n[host.\"http://m:5000\"]\ncapabilities=[\"pull\"]\nca=[\"a\",\"b\"]\nclient=[[\"c\",\"k\"],\"d\"]\n"))
	f.Add([]byte("[host.\"https://a/x\"]\noverride_path=true\n[host.\"https://a/x\".header]\nk=[\"v\"]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		hs, err := ParseHostsFile("/c/h/hosts.toml", data, "h")
		if err != nil {
			return
		}
		for _, h := range hs {
			if h.Scheme != "https" && h.Scheme != "http" || h.Host == "" || !strings.HasPrefix(h.Path, "/") {
				t.Fatalf("accepted a bad host %+v", h)
			}
		}
		if hs[len(hs)-1].Mirror {
			t.Fatal("last host is not the server")
		}
	})
}
