package e2e

import (
	"bufio"
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

// lazyImage is a busybox image with a layer of large random files, pushed
// to a loopback registry.
type lazyImage struct {
	reg   *registrytest.Registry
	ref   string            // registry:HOST/REPO:TAG
	md5   map[string]string // guest path -> md5 of the file
	layer digest.Digest     // the big files' layer blob
	size  int64             // its compressed size
}

const lazyBigFiles, lazyBigSize = 4, 16 << 20

func pushLazyImage(t *testing.T) *lazyImage {
	t.Helper()
	reg := registrytest.Start(t, registrytest.Options{})
	data := filepath.Join(t.TempDir(), "data")
	if err := os.MkdirAll(filepath.Join(data, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	img := &lazyImage{reg: reg, ref: "registry:" + reg.Addr + "/lazy/img:v1", md5: map[string]string{}}
	rng := rand.New(rand.NewPCG(17, 18))
	for i := 0; i < lazyBigFiles; i++ {
		b := make([]byte, lazyBigSize)
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		name := fmt.Sprintf("data/big%d", i)
		if err := os.WriteFile(filepath.Join(data, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
		s := md5.Sum(b)
		img.md5["/"+name] = hex.EncodeToString(s[:])
	}
	oci := t.TempDir()
	registrytest.WriteOCI(t, oci, "v1", registrytest.TarDir(t, busyboxRootfs(t)), registrytest.TarDir(t, data))
	var idx struct {
		Manifests []struct{ Digest digest.Digest } `json:"manifests"`
	}
	var m struct {
		Layers []struct {
			Digest digest.Digest `json:"digest"`
			Size   int64         `json:"size"`
		} `json:"layers"`
	}
	readJSON(t, filepath.Join(oci, "index.json"), &idx)
	readJSON(t, filepath.Join(oci, "blobs", "sha256", idx.Manifests[0].Digest.Encoded()), &m)
	img.layer, img.size = m.Layers[1].Digest, m.Layers[1].Size
	reg.Push(t, oci, "v1", "lazy/img:v1")
	return img
}

func readJSON(t *testing.T, p string, v any) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", p, err)
	}
}

// lazyEnv is an env whose [kata_fsx.registry] reaches img's registry.
func lazyEnv(t *testing.T, img *lazyImage, registry string) *env {
	t.Helper()
	e := newEnv(t, "")
	f, err := os.OpenFile(e.config, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fmt.Fprintf(f, "\n[kata_fsx.registry]\nconfig_path = %q\n%s\n", img.reg.HostsDir(t, ""), registry)
	return e
}

// imageIndex runs `kata-fsx image index REF` with the env's config.
func (e *env) imageIndex(ctx context.Context, ref string) result {
	e.t.Helper()
	return runCmd(e.t, exec.CommandContext(ctx, kataFSX(e.t), "image", "index", "--config", e.config, ref))
}

func readStats(t *testing.T, p string) *sandbox.RunStats {
	t.Helper()
	var s sandbox.RunStats
	readJSON(t, p, &s)
	if s.Lazy == nil {
		t.Fatalf("%s has no lazy section", p)
	}
	return &s
}

var md5Line = regexp.MustCompile(`(?m)^([0-9a-f]{32})  (/data/big\d)$`)

// checkMD5s checks every md5sum line of out against the image's files and
// returns how many there were.
func (img *lazyImage) checkMD5s(t *testing.T, out string) int {
	t.Helper()
	ms := md5Line.FindAllStringSubmatch(out, -1)
	for _, m := range ms {
		if img.md5[m[2]] != m[1] {
			t.Errorf("guest read %s with md5 %s, want %s: wrong bytes served", m[2], m[1], img.md5[m[2]])
		}
	}
	return len(ms)
}

// fromArtifactOrCache reports whether every layer's index of an index
// source ("artifact sha256:…", "node cache", or per layer, as
// "node cache (layer 1) + artifact sha256:… (layer 2)" when a pod started
// while the other was filling the cache) came from an artifact or the
// node cache, none by streaming.
func fromArtifactOrCache(src string) bool {
	for _, part := range strings.Split(src, " + ") {
		if i := strings.Index(part, " (layer"); i >= 0 {
			part = part[:i]
		}
		if !strings.HasPrefix(part, "artifact sha256:") && part != "node cache" {
			return false
		}
	}
	return src != ""
}

func TestFromArtifactOrCache(t *testing.T) {
	for src, want := range map[string]bool{
		"artifact sha256:df80": true,
		"node cache":           true,
		"node cache (layer 1) + artifact sha256:df80 (layer 2)":     true,
		"artifact sha256:df80 (layers 1, 3) + node cache (layer 2)": true,
		"node cache (layer 1) + built by streaming (layer 2)":       false,
		"built by streaming": false,
		"":                   false,
	} {
		if got := fromArtifactOrCache(src); got != want {
			t.Errorf("fromArtifactOrCache(%q) = %t, want %t", src, got, want)
		}
	}
}

func TestLazyRegistryPods(t *testing.T) {
	img := pushLazyImage(t)
	e := lazyEnv(t, img, "prefetch = false")
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()

	// The index artifact first, as an image publisher would push it.
	r := e.imageIndex(ctx, img.ref)
	if r.code != 0 {
		t.Fatalf("image index: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}

	// Two pods of the image at once on one node.
	var wg sync.WaitGroup
	res := make([]result, 2)
	statsFiles := []string{filepath.Join(e.dir, "s0.json"), filepath.Join(e.dir, "s1.json")}
	for i := range res {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i] = e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", img.ref, "--stats-file", statsFiles[i], "--",
				"/bin/sh", "-c", "echo ready; md5sum /data/big0")
		}()
	}
	wg.Wait()
	var fetched int64
	for i, r := range res {
		if r.code != 0 || !strings.HasPrefix(r.stdout, "ready\n") {
			t.Fatalf("pod %d: exit %d\nstdout:\n%s\nstderr:\n%s", i, r.code, r.stdout, r.stderr)
		}
		if img.checkMD5s(t, r.stdout) != 1 {
			t.Fatalf("pod %d: no md5sum of /data/big0:\n%s", i, r.stdout)
		}
		s := readStats(t, statsFiles[i])
		if !fromArtifactOrCache(s.Lazy.IndexSource) {
			t.Errorf("pod %d: indexes from %q, want the pushed artifact (or the node cache it filled)", i, s.Lazy.IndexSource)
		}
		t.Logf("pod %d: image %d bytes; fetched %d by the first output, %d by the end; %d range requests; first output %.1fs",
			i, s.Lazy.ImageBytes, s.Lazy.FetchedAtFirstOutput, s.Lazy.FetchedAtEnd, s.Lazy.RangeRequests, s.FirstOutputSeconds)
		// A pod starts having fetched a small fraction of its image.
		if s.Lazy.FetchedAtFirstOutput*10 > s.Lazy.ImageBytes {
			t.Errorf("pod %d: %d of %d image bytes fetched before its first output, want under 10%%", i, s.Lazy.FetchedAtFirstOutput, s.Lazy.ImageBytes)
		}
		fetched += s.Lazy.FetchedAtEnd
	}
	// Both read big0 (a quarter of the big layer): between them, every
	// chunk once, not twice.
	if fetched > img.size/4+img.size/8+4<<20 {
		t.Errorf("two pods fetched %d bytes together; one copy of big0's chunks is about %d", fetched, img.size/4)
	}
	if fetched < img.size/4 {
		t.Errorf("two pods fetched %d bytes together, less than big0's %d compressed bytes: where did big0 come from?", fetched, img.size/4)
	}

	// A third pod on the warm node fetches nothing it already has.
	r = e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", img.ref, "--stats-file", statsFiles[0], "--",
		"/bin/sh", "-c", "echo ready; md5sum /data/big0")
	if r.code != 0 || img.checkMD5s(t, r.stdout) != 1 {
		t.Fatalf("warm pod: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	if s := readStats(t, statsFiles[0]); s.Lazy.FetchedAtEnd != 0 {
		t.Errorf("warm pod fetched %d bytes, want 0: the node store holds them", s.Lazy.FetchedAtEnd)
	}
}

// streamRun runs kata-fsx with args and calls onLine for each stdout line
// as it arrives.
func (e *env) streamRun(ctx context.Context, onLine func(string), args ...string) result {
	e.t.Helper()
	cmd := exec.CommandContext(ctx, kataFSX(e.t), append([]string{args[0], "--config", e.config}, args[1:]...)...)
	var errb syncBuffer
	cmd.Stderr = &errb
	pr, err := cmd.StdoutPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	var out strings.Builder
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
		onLine(sc.Text())
	}
	io.Copy(io.Discard, pr)
	err = cmd.Wait()
	r := result{stdout: out.String(), stderr: errb.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("%v: %v\n%s", cmd.Args, err, r.stderr)
	}
	return r
}

func TestLazyRegistryFaults(t *testing.T) {
	img := pushLazyImage(t)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	// The indexes are pushed while the blob is intact: a node that had to
	// stream an altered layer to index it would refuse it whole.
	if r := lazyEnv(t, img, "").imageIndex(ctx, img.ref); r.code != 0 {
		t.Fatalf("image index: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}

	t.Run("registry killed mid-read", func(t *testing.T) {
		e := lazyEnv(t, img, "prefetch = false\nread_timeout = 3")
		// The guest reads big1 while the registry is down, then again
		// after it is back.
		script := "echo ready; sleep 2; md5sum /data/big1; echo rc=$?; sleep 8; md5sum /data/big1; echo rc2=$?"
		var stoppedAt time.Time
		var failedAfter time.Duration
		r := e.streamRun(ctx, func(l string) {
			switch {
			case l == "ready":
				img.reg.Stop()
				stoppedAt = time.Now()
			case strings.HasPrefix(l, "rc="):
				failedAfter = time.Since(stoppedAt)
				img.reg.Start()
			}
		}, "run", "--backend", "imagefs-blk", "--rootfs", img.ref, "--", "/bin/sh", "-c", script)
		img.reg.Start()
		if r.code != 0 {
			t.Fatalf("exit %d: the pod did not survive the registry's death\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		if !strings.Contains(r.stdout, "rc=1\n") || !strings.Contains(r.stdout, "rc2=0\n") {
			t.Fatalf("want the read to fail while the registry is down (rc=1) and succeed after (rc2=0):\n%s\nstderr:\n%s", r.stdout, r.stderr)
		}
		if !strings.Contains(r.stderr, "Input/output error") {
			t.Errorf("the guest's failed read is not an I/O error:\n%s", r.stderr)
		}
		if img.checkMD5s(t, r.stdout) != 1 {
			t.Errorf("want exactly one md5sum line (the read after the registry returned):\n%s", r.stdout)
		}
		t.Logf("read failed %.1fs after the registry was killed (read_timeout 3s, guest retries included)", failedAfter.Seconds())
	})

	t.Run("altered blob", func(t *testing.T) {
		e := lazyEnv(t, img, "prefetch = false\nread_timeout = 10")
		p := img.reg.BlobPath(img.layer)
		orig, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.WriteFile(p, orig, 0o644) })
		bad := append([]byte(nil), orig...)
		// Inside big1's compressed bytes (the layer holds big0..big3 in order).
		for i := len(bad) * 3 / 8; i < len(bad)*3/8+64; i++ {
			bad[i] ^= 0x5a
		}
		if err := os.WriteFile(p, bad, 0o644); err != nil {
			t.Fatal(err)
		}
		r := e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", img.ref, "--",
			"/bin/sh", "-c", "for f in /data/big0 /data/big1 /data/big2 /data/big3; do md5sum $f || echo failed $f; done")
		if n := img.checkMD5s(t, r.stdout); n != lazyBigFiles-1 {
			t.Errorf("%d files read whole, want %d (all but the altered one)\n%s", n, lazyBigFiles-1, r.stdout)
		}
		if !strings.Contains(r.stdout, "failed /data/big1") {
			t.Errorf("reading the altered file did not fail:\n%s", r.stdout)
		}
		if !strings.Contains(r.stderr, "does not match the index: refused") || !strings.Contains(r.stderr, "Input/output error") {
			t.Errorf("no log line names the refused chunk, or the guest saw no I/O error:\n%s", r.stderr)
		}
	})
}

// TestShimLazyAnnotation: a containerd pod whose annotation names a
// registry image runs from it, read lazily, when the configuration allows
// it (the refusal without it is shim's TestLazyRootfsAnnotationGated).
func TestShimLazyAnnotation(t *testing.T) {
	img := pushLazyImage(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ann := "io.kata-fsx.image.lazy=" + img.ref

	ce := newContainerdEnvFor(t, func() *env { return lazyEnv(t, img, "prefetch = false\nlazy_image_annotation = true") })
	r := ce.ctr(ctx, ce.runArgs("--rm", "--annotation", ann, ce.image, "lazy-on", "/bin/sh", "-c", `md5sum /data/big2; grep " / " /proc/mounts`)...)
	if r.code != 0 {
		t.Fatalf("ctr run: exit %d\nstdout:\n%s\nstderr:\n%s\nshim log:\n%s", r.code, r.stdout, r.stderr, ce.logTail(4000))
	}
	if img.checkMD5s(t, r.stdout) != 1 {
		t.Fatalf("no md5sum of /data/big2 (the registry image's file) in:\n%s", r.stdout)
	}
	if got := rootFstype(r.stdout); got != "ext4" {
		t.Errorf("guest / is %q, want ext4 (imagefs-blk)", got)
	}
	if !strings.Contains(ce.logTail(1<<20), "read lazily on imagefs-blk") {
		t.Errorf("the shim did not log the lazy rootfs")
	}

}
