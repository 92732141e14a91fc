package lazyimage

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
)

// defaultCap is the default [kata_fsx.registry] max_index_mb in bytes,
// written out so that these tests state the bound they hold the code to.
const defaultCap = 64 << 20

// created is when the fake artifacts were pushed: artifact i at
// created+i seconds, so the larger i the sooner it is tried.
var created = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// rssChildEnv makes the test binary run the measured part of
// TestResolveHostileIndexMemory, in a process of its own.
const rssChildEnv = "KATA_FSX_LAZYIMAGE_RSS_CHILD"

// TestResolveHostileIndexMemory: a registry whose index artifacts claim
// an index blob of 1 GiB (under the bound a 600 MiB layer gives, over the
// absolute one), answer with a Content-Length of 1 GiB, or send a body
// that never ends, each with garbage made on the fly, leaves Resolve's
// peak RSS within the absolute bound plus 16 MiB. The measurement runs in
// a child process so that no other test's memory counts.
func TestResolveHostileIndexMemory(t *testing.T) {
	if os.Getenv(rssChildEnv) == "1" {
		hostileIndexResolve(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestResolveHostileIndexMemory$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), rssChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	var base, peak int64
	for _, line := range strings.Split(string(out), "\n") {
		if _, serr := fmt.Sscanf(line, "vmhwm: baseline %d KiB, peak %d KiB", &base, &peak); serr == nil {
			break
		}
	}
	if base == 0 || peak == 0 {
		t.Fatalf("the child printed no measurement (%v):\n%s", err, out)
	}
	limit := base + (defaultCap+16<<20)>>10
	t.Logf("Resolve against the hostile registry: VmHWM %d KiB before, %d KiB after (+%d KiB; at most %d KiB allowed)", base, peak, peak-base, limit)
	if peak > limit {
		t.Errorf("peak RSS %d KiB, over the baseline %d KiB plus the %d MiB cap plus 16 MiB", peak, base, defaultCap>>20)
	}
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// hostileIndexResolve is the child's part of TestResolveHostileIndexMemory.
func hostileIndexResolve(t *testing.T) {
	f := newFakeRegistry(t)
	md := f.image(t, 600<<20)
	claims := ocispec.Descriptor{Digest: digest.FromString("claims 1 GiB"), Size: 1 << 30}
	lies := ocispec.Descriptor{Digest: digest.FromString("Content-Length of 1 GiB"), Size: defaultCap - 1<<20}
	floods := ocispec.Descriptor{Digest: digest.FromString("a body that never ends"), Size: defaultCap - 1<<20}
	cases := []struct {
		blob     ocispec.Descriptor
		serve    http.HandlerFunc
		want     string
		ask      int
		artifact ocispec.Descriptor
	}{
		{blob: claims, serve: serveGarbage(1<<30, 1<<30), want: "max_index_mb", ask: 0},
		{blob: lies, serve: serveGarbage(1<<30, 1<<30), want: "Content-Length 1073741824", ask: 1},
		{blob: floods, serve: serveGarbage(1<<30, -1), want: fmt.Sprintf("more than the descriptor's %d bytes", floods.Size), ask: 1},
	}
	for i := range cases {
		c := &cases[i]
		c.artifact = f.indexArtifact(t, md, c.blob, created.Add(time.Duration(len(cases)-i)*time.Second), c.serve)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	base := resetHWM(t)
	var l logs
	_, err := Resolve(ctx, Options{Client: f.client, Logf: l.Logf}, f.ref)
	fmt.Printf("vmhwm: baseline %d KiB, peak %d KiB\n", base, vmHWM(t))
	t.Logf("Resolve: %v; it logged:\n%s", err, l.String())

	if err == nil || !strings.Contains(err.Error(), fakeLayer.String()) {
		t.Errorf("Resolve: %v, want the failure to stream the layer the fake registry does not serve", err)
	}
	for _, c := range cases {
		if !l.Has(c.artifact.Digest.String(), "index "+c.blob.Digest.String(), "refused", c.want) {
			t.Errorf("no refusal of %s naming %q:\n%s", c.blob.Digest, c.want, l.String())
		}
		if n := f.blobRequests(c.blob.Digest); n != c.ask {
			t.Errorf("index blob %s asked for %d times, want %d", c.blob.Digest, n, c.ask)
		}
	}
}

// procStatusKiB reads one "Name: N kB" line of /proc/self/status.
func procStatusKiB(t *testing.T, name string) int64 {
	t.Helper()
	fh, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("%s in /proc/self/status: %v", name, err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/self/status", name)
	return 0
}

func vmHWM(t *testing.T) int64 { return procStatusKiB(t, "VmHWM") }

// resetHWM sets the peak RSS to the current RSS (clear_refs 5) where the
// kernel allows, so the peak measured after is the code's, not the
// setup's, and returns the baseline.
func resetHWM(t *testing.T) int64 {
	t.Helper()
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Logf("cannot reset the peak RSS (%v); measuring from the peak so far", err)
	}
	return vmHWM(t)
}

// TestIndexOverCapNotFetched: an index blob declared larger than the
// absolute bound, or than its layer's bound, is refused before any
// request for it, naming the bound.
func TestIndexOverCapNotFetched(t *testing.T) {
	for _, c := range []struct {
		name      string
		layerSize int64
		blobSize  int64
		want      string
	}{
		// A 100 MiB layer allows an index of 204 MiB: the absolute
		// bound is the one that refuses.
		{"over the absolute bound", 100 << 20, defaultCap + 1, "max_index_mb"},
		{"over the layer's bound", 10 << 20, maxIndexSize(10<<20) + 1, "for a layer of 10485760 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFakeRegistry(t)
			md := f.image(t, c.layerSize)
			blob := ocispec.Descriptor{Digest: digest.FromString(c.name), Size: c.blobSize}
			ad := f.indexArtifact(t, md, blob, created, serveGarbage(c.blobSize, c.blobSize))
			var l logs
			if _, err := Resolve(context.Background(), Options{Client: f.client, Logf: l.Logf}, f.ref); err == nil {
				t.Fatal("Resolve succeeded without the layer or a usable index")
			}
			if n := f.blobRequests(blob.Digest); n != 0 {
				t.Errorf("the index blob of %d bytes was asked for %d times, want none", c.blobSize, n)
			}
			if !l.Has(ad.Digest.String(), "index "+blob.Digest.String(), "refused", "over the", c.want) {
				t.Errorf("no refusal naming %q:\n%s", c.want, l.String())
			}
		})
	}
}

// TestIndexContentLengthOverCap: an answer whose Content-Length (1 GiB)
// is over the bound is refused before its body is read. The body is the
// blob the descriptor names, so only the header can refuse it; read, it
// would be refused as no index ("bad magic") instead.
func TestIndexContentLengthOverCap(t *testing.T) {
	f := newFakeRegistry(t)
	md := f.image(t, 100<<20)
	data := lazyimagetest.Random(5, 1<<20)
	blob := ocispec.Descriptor{Digest: digest.FromBytes(data), Size: int64(len(data))}
	ad := f.indexArtifact(t, md, blob, created, func(w http.ResponseWriter, r *http.Request) {
		status := http.StatusOK
		if r.Header.Get("Range") != "" {
			status = http.StatusPartialContent
			w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-%d/%d", len(data)-1, len(data)))
		}
		w.Header().Set("Content-Length", strconv.Itoa(1<<30))
		w.WriteHeader(status)
		w.Write(data)
	})
	var l logs
	if _, err := Resolve(context.Background(), Options{Client: f.client, Logf: l.Logf}, f.ref); err == nil {
		t.Fatal("Resolve succeeded without the layer or a usable index")
	}
	if !l.Has(ad.Digest.String(), "index "+blob.Digest.String(), "refused", "Content-Length 1073741824") || l.Has("bad magic") {
		t.Errorf("want the blob refused for its Content-Length, its body never decoded:\n%s", l.String())
	}
	if n := f.blobRequests(blob.Digest); n != 1 {
		t.Errorf("the index blob was asked for %d times, want once (a refusal is not retried)", n)
	}
}
