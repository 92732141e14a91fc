package critest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// The registries critest pulls from; containerd reaches each through a
// hosts.toml mirror on the loopback registry, whose repositories keep the
// upstream paths (e2e-test-images/busybox, k8s-staging-cri-tools/...).
var mirroredRegistries = []string{"registry.k8s.io", "gcr.io", "k8s.gcr.io"}

// sandboxImage is the pods' pause image, pinned by containerd; a name of
// its own so that critest's image specs, which remove pause:3.9, never
// remove it.
const sandboxImage = "registry.k8s.io/pause:3.10"

// The passwd and group of the upstream busybox image, which the run-as
// specs resolve names against (nobody, www-data).
const (
	busyboxPasswd = `root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
sync:x:4:100:sync:/bin:/bin/sync
mail:x:8:8:mail:/var/spool/mail:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
operator:x:37:37:Operator:/var:/bin/false
nobody:x:65534:65534:nobody:/home:/bin/false
`
	busyboxGroup = `root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
lp:x:7:
mail:x:8:
kmem:x:9:
wheel:x:10:root
cdrom:x:11:
dialout:x:18:
floppy:x:19:
video:x:28:
audio:x:29:
tape:x:32:
www-data:x:33:
operator:x:37:
utmp:x:43:
plugdev:x:46:
staff:x:50:
lock:x:54:
netdev:x:82:
users:x:100:
nogroup:x:65534:
`
)

// standIns are /bin scripts for applets critest runs that Debian's
// busybox-static does not build: pgrep NAME (the execSync timeout spec)
// and ipcs -m (the IPC namespace specs, which look for a segment id).
var standIns = map[string]string{
	"pgrep": `#!/bin/sh
found=1
for d in /proc/[0-9]*; do
	if [ "$(cat "$d/comm" 2>/dev/null)" = "$1" ]; then echo "${d#/proc/}"; found=0; fi
done
exit $found
`,
	"ipcs": `#!/bin/sh
cat /proc/sysvipc/shm
`,
}

// lookalike is one image critest pulls, rebuilt from Debian's static
// busybox: its repositories with tags (on the mirror, without the
// registry host), the files it adds to the busybox tree and its config.
type lookalike struct {
	refs  []string
	files map[string]string
	// fixture: where the image has test/critest/fixture, with its mode.
	fixture map[string]fs.FileMode
	config  ocispec.ImageConfig
}

// lookalikes are the images of cri-tools v1.37.0's pkg/validate and
// images/ (their Dockerfiles and images/build): busybox 1.29-2, nginx
// 1.14-2, the pause images, the user and group images, the hostnet
// nginx and the test-image-* set whose tags and files the image specs
// compare. test-image-digest is pushed too, but critest pulls it by an
// upstream digest that no rebuild can have.
func lookalikes() []lookalike {
	const cri = "k8s-staging-cri-tools/"
	sh := ocispec.ImageConfig{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, Cmd: []string{"sh"}}
	with := func(c ocispec.ImageConfig, f func(*ocispec.ImageConfig)) ocispec.ImageConfig { f(&c); return c }
	// The pause process lives until the CRI stops the pod; as a pid
	// namespace's init it reaps what the pod's processes leave. It is the
	// fixture's program, not a shell loop: a pod's containers share its
	// PID namespace, and a spec that looks for its own killed sleep
	// (execSync with timeout) must not find the pause's.
	pauseConfig := ocispec.ImageConfig{Env: []string{"PATH=/bin"}, Entrypoint: []string{"/pause"}}
	page := map[string]string{"/usr/share/nginx/html/index.html": "<title>Welcome to nginx!</title>\n"}
	nginx := with(sh, func(c *ocispec.ImageConfig) {
		c.Cmd, c.ExposedPorts = []string{"nginx", "-g", "daemon off;"}, map[string]struct{}{"80/tcp": {}}
	})
	l := []lookalike{
		{refs: []string{"e2e-test-images/busybox:1.29-2"}, config: sh},
		{refs: []string{"e2e-test-images/nginx:1.14-2"}, files: page, fixture: map[string]fs.FileMode{"/usr/sbin/nginx": 0o755}, config: nginx},
		{refs: []string{cri + "hostnet-nginx-amd64:latest"}, files: page, fixture: map[string]fs.FileMode{"/usr/sbin/nginx": 0o755},
			config: with(nginx, func(c *ocispec.ImageConfig) { c.Env = append(c.Env, "PORT=12003") })},
		{refs: []string{"e2e-test-images/httpd:2.4.39-4"}, files: map[string]string{"/usr/local/apache2/htdocs/index.html": "<html><body><h1>It works!</h1></body></html>\n"},
			fixture: map[string]fs.FileMode{"/usr/local/apache2/bin/httpd": 0o755},
			config: with(sh, func(c *ocispec.ImageConfig) {
				c.Env, c.Cmd = []string{"PATH=/usr/local/apache2/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, []string{"httpd"}
			})},
		{refs: []string{"e2e-test-images/nonewprivs:1.3"}, fixture: map[string]fs.FileMode{"/usr/local/bin/nnp": 0o755 | fs.ModeSetuid},
			config: with(sh, func(c *ocispec.ImageConfig) { c.Cmd, c.Entrypoint = nil, []string{"/usr/local/bin/nnp"} })},
		// Two images: critest expects pause:3.9's tags to be its own.
		{refs: []string{"pause:3.9"}, fixture: map[string]fs.FileMode{"/pause": 0o755}, config: pauseConfig},
		{refs: []string{"pause:3.10"}, files: map[string]string{"/sandbox": ""}, fixture: map[string]fs.FileMode{"/pause": 0o755}, config: pauseConfig},
		{refs: []string{cri + "test-image-predefined-group:latest"}, files: map[string]string{
			"/etc/passwd": busyboxPasswd + "default-user:x:1000:1000:Linux User,,,:/home/default-user:/bin/sh\n",
			"/etc/group":  busyboxGroup + "default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n",
		}, config: with(sh, func(c *ocispec.ImageConfig) { c.User = "1000" })},
		{refs: []string{cri + "test-image-tags:1", cri + "test-image-tags:2", cri + "test-image-tags:3"}, files: map[string]string{"/same-image": ""}, config: sh},
	}
	for name, user := range map[string]string{"uid": "1002", "username": "www-data", "uid-group": "1003:1004", "username-group": "www-data:1004"} {
		l = append(l, lookalike{refs: []string{cri + "test-image-user-" + name + ":latest"}, config: with(sh, func(c *ocispec.ImageConfig) { c.User = user })})
	}
	for _, name := range []string{"test-image-1", "test-image-2", "test-image-3", "test-image-latest", "test-image-digest"} {
		l = append(l, lookalike{refs: []string{cri + name + ":latest"}, files: map[string]string{"/" + name: ""}, config: sh})
	}
	for _, tag := range []string{"test", "all"} {
		l = append(l, lookalike{refs: []string{cri + "test-image-tag:" + tag}, files: map[string]string{"/" + tag: ""}, config: sh})
	}
	return l
}

// pushLookalikes builds every look-alike and pushes it to r.
func pushLookalikes(t *testing.T, r *registrytest.Registry) {
	t.Helper()
	base := busyboxTree(t)
	fixture := buildFixture(t)
	for _, im := range lookalikes() {
		root := filepath.Join(t.TempDir(), "rootfs")
		if out, err := exec.Command("cp", "-a", base, root).CombinedOutput(); err != nil {
			t.Fatalf("copy busybox tree: %v\n%s", err, out)
		}
		for p, content := range im.files {
			full := filepath.Join(root, p)
			if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(full, []byte(content), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		for p, mode := range im.fixture {
			full := filepath.Join(root, p)
			if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(full, fixture, 0o755); err != nil {
				t.Fatal(err)
			}
			// WriteFile's mode passes through the umask and drops setuid.
			if err := os.Chmod(full, mode); err != nil {
				t.Fatal(err)
			}
		}
		layout := t.TempDir()
		writeImage(t, layout, "img", tarTree(t, root), im.config)
		for _, ref := range im.refs {
			r.Push(t, layout, "img", ref)
		}
	}
}

// buildFixture builds test/critest/fixture, static, and returns it.
func buildFixture(t *testing.T) []byte {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "fixture")
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, "./fixture")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build fixture: %v\n%s", err, out)
	}
	b, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// busyboxTree is a root filesystem of Debian's static busybox with every
// applet linked in /bin and the upstream image's users and groups.
func busyboxTree(t *testing.T) string {
	t.Helper()
	const bb = "/bin/busybox"
	f, err := elf.Open(bb)
	if errors.Is(err, fs.ErrNotExist) {
		testenv.Missing(t, "busybox: %v (apt-get install busybox-static)", err)
	}
	if err != nil {
		t.Fatalf("busybox: %v", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			f.Close()
			testenv.Missing(t, "/bin/busybox is dynamic (apt-get install busybox-static)")
		}
	}
	f.Close()
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc", "root", "home", "var/www", "usr/bin", "usr/sbin", "sbin"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), 0o1777|fs.ModeSticky); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	list, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	// Hard links, as the upstream image has: critest's MaskedPaths spec
	// masks /bin/ls, which through a symlink would mask busybox itself.
	for _, a := range strings.Fields(string(list)) {
		if a == "busybox" {
			continue
		}
		if err := os.Link(filepath.Join(root, "bin", "busybox"), filepath.Join(root, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	// Applets the upstream busybox has and Debian's build lacks, as
	// scripts doing what critest asks of them.
	for name, script := range standIns {
		if err := os.WriteFile(filepath.Join(root, "bin", name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, content := range map[string]string{"passwd": busyboxPasswd, "group": busyboxGroup} {
		if err := os.WriteFile(filepath.Join(root, "etc", name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// tarTree is an uncompressed layer tar of the tree at root, owned by
// root, with each further name of a file as a hard link to its first.
func tarTree(t *testing.T, root string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	seen := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name, h.Uid, h.Gid, h.Uname, h.Gname = filepath.ToSlash(rel), 0, 0, "", ""
		if fi.IsDir() {
			h.Name += "/"
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().IsRegular() && st.Nlink > 1 {
			if first, ok := seen[st.Ino]; ok {
				h.Typeflag, h.Linkname, h.Size = tar.TypeLink, first, 0
				return tw.WriteHeader(h)
			}
			seen[st.Ino] = h.Name
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		t.Fatalf("tar %s: %v", root, err)
	}
	return buf.Bytes()
}

// writeImage writes an OCI image layout in dir whose image, tagged tag,
// has one layer (an uncompressed tar, stored gzip-compressed) and cfg.
func writeImage(t *testing.T, dir, tag string, layer []byte, cfg ocispec.ImageConfig) {
	t.Helper()
	blob := func(data []byte) digest.Digest { return registrytest.WriteBlob(t, dir, data) }
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(layer)
	zw.Close()
	img := ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Config:   cfg,
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(layer)}},
	}
	cb, err := json.Marshal(img)
	if err != nil {
		t.Fatal(err)
	}
	m := ocispec.Manifest{
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: blob(cb), Size: int64(len(cb))},
		Layers:    []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: blob(gz.Bytes()), Size: int64(gz.Len())}},
	}
	m.SchemaVersion = 2
	mb, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest,
		Digest: blob(mb), Size: int64(len(mb)), Annotations: map[string]string{ocispec.AnnotationRefName: tag}}}}
	idx.SchemaVersion = 2
	ib, err := json.Marshal(idx)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "index.json"), ib, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		t.Fatal(err)
	}
}

// writeMirrors writes a certs.d directory whose hosts.toml files send
// pulls of the mirrored registries to r (plain HTTP on loopback).
func writeMirrors(t *testing.T, dir string, r *registrytest.Registry) {
	t.Helper()
	for _, host := range mirroredRegistries {
		body := fmt.Sprintf("server = %q\n\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", "https://"+host, r.Scheme+"://"+r.Addr)
		if err := os.MkdirAll(filepath.Join(dir, host), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, host, "hosts.toml"), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
