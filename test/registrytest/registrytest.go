// Package registrytest runs Debian's docker-registry (distribution 2.8) on
// loopback for tests, pushes OCI layouts to it with Debian's skopeo, and
// reaches into its storage where a test must alter what it serves.
package registrytest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/opencontainers/go-digest"
)

// Options tune Start.
type Options struct {
	TLSCert, TLSKey string // serve HTTPS with this certificate
	// Extra is YAML appended under the config's top level (auth, ...).
	Extra string
}

// Registry is one docker-registry process with storage of the test's own.
type Registry struct {
	t       testing.TB
	Addr    string // host:port on 127.0.0.1
	Scheme  string // "http" or "https"
	DataDir string // the filesystem storage's root directory
	config  string
	cmd     *exec.Cmd
}

// Start writes a registry config and starts the registry; the test's
// cleanup stops it.
func Start(t testing.TB, opts Options) *Registry {
	t.Helper()
	testenv.Tool(t, "docker-registry", "docker-registry")
	dir := t.TempDir()
	r := &Registry{t: t, Addr: FreePort(t), Scheme: "http", DataDir: filepath.Join(dir, "data"), config: filepath.Join(dir, "config.yml")}
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n", r.DataDir, r.Addr)
	if opts.TLSCert != "" {
		r.Scheme = "https"
		cfg += fmt.Sprintf("  tls:\n    certificate: %s\n    key: %s\n", opts.TLSCert, opts.TLSKey)
	}
	cfg += opts.Extra
	if err := os.WriteFile(r.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	r.Start()
	t.Cleanup(r.Stop)
	return r
}

// FreePort returns a loopback address no one listens on (yet).
func FreePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// Start (re)starts a stopped registry on the same address and storage.
func (r *Registry) Start() {
	r.t.Helper()
	if r.cmd != nil {
		return
	}
	cmd := exec.Command("docker-registry", "serve", r.config)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	r.cmd = cmd
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.DialTimeout("tcp", r.Addr, time.Second); err == nil {
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.Stop()
	r.t.Fatalf("registry on %s did not start: %s", r.Addr, out.String())
}

// Stop kills the registry (as a crash would); Start brings it back.
func (r *Registry) Stop() {
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
	r.cmd = nil
}

// HostsDir writes a certs.d directory with one hosts.toml for the
// registry; an empty body points server at the registry's own URL.
func (r *Registry) HostsDir(t testing.TB, body string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, r.Addr), 0o755); err != nil {
		t.Fatal(err)
	}
	if body == "" {
		body = fmt.Sprintf("server = %q\n", r.Scheme+"://"+r.Addr)
	}
	if err := os.WriteFile(filepath.Join(dir, r.Addr, "hosts.toml"), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// BlobPath is where the registry stores a blob's bytes (distribution's
// filesystem driver layout), for tests that alter what it serves.
func (r *Registry) BlobPath(d digest.Digest) string {
	hex := d.Encoded()
	return filepath.Join(r.DataDir, "docker", "registry", "v2", "blobs", d.Algorithm().String(), hex[:2], hex, "data")
}

// Push copies the OCI layout dir's image tagged tag to REPO:TAG on the
// registry (plain HTTP, layers gzip-compressed) with skopeo.
func (r *Registry) Push(t testing.TB, dir, tag, repoTag string) {
	t.Helper()
	PushOCI(t, dir, tag, r.Addr+"/"+repoTag)
}

// PushOCI copies the OCI layout dir's image tagged tag to dest
// (HOST/REPO:TAG) with skopeo, layers gzip-compressed, TLS unchecked.
func PushOCI(t testing.TB, dir, tag, dest string) {
	t.Helper()
	testenv.Tool(t, "skopeo", "skopeo")
	out, err := exec.Command("skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false", "--dest-compress-format", "gzip",
		"oci:"+dir+":"+tag, "docker://"+dest).CombinedOutput()
	if err != nil {
		t.Fatalf("skopeo copy to %s: %v\n%s", dest, err, out)
	}
}
