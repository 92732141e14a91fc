package lazyroot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// testImage pushes a two-layer image (a small layer, and one of large
// random files) and returns its registry: spec and the files' bytes.
func testImage(t *testing.T, reg *registrytest.Registry) (string, map[string][]byte) {
	t.Helper()
	files := map[string][]byte{}
	small := filepath.Join(t.TempDir(), "small")
	big := filepath.Join(t.TempDir(), "big")
	rng := rand.New(rand.NewPCG(3, 4))
	for _, d := range []string{small, big} {
		if err := os.MkdirAll(filepath.Join(d, "d"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(root, name string, n int) {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		if err := os.WriteFile(filepath.Join(root, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
		files[name] = b
	}
	write(small, "d/hello", 1000)
	// Files of two spans (lazyindex.DefaultSpan): reading one fetches
	// about three spans' compressed bytes.
	for i := 0; i < 4; i++ {
		write(big, fmt.Sprintf("d/big%d", i), 8<<20)
	}
	oci := t.TempDir()
	registrytest.WriteOCI(t, oci, "v1", registrytest.TarDir(t, small), registrytest.TarDir(t, big))
	reg.Push(t, oci, "v1", "lazyroot/img:v1")
	return Prefix + reg.Addr + "/lazyroot/img:v1", files
}

func testOptions(t *testing.T, reg *registrytest.Registry, state string, logs *logBuffer) Options {
	r := config.DefaultRegistry()
	r.ConfigPath = reg.HostsDir(t, "")
	r.TraceSeconds = 3600 // the trace ends with Close here
	return Options{Registry: r, IndexDir: filepath.Join(state, "indexes"), StoreDir: filepath.Join(state, "content"), Logf: logs.logf}
}

type logBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuffer) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(&l.b, format+"\n", args...)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// readFile reads path of the root's tree through its Opener.
func readFile(t *testing.T, r *Root, path string) []byte {
	t.Helper()
	for i := range r.Tree.Entries {
		e := &r.Tree.Entries[i]
		if e.Path != path {
			continue
		}
		ra, err := r.Opener().Open(r.Tree.Sources[e.Data.Source], e.Data.Path)
		if err != nil {
			t.Fatal(err)
		}
		if c, ok := ra.(io.Closer); ok {
			defer c.Close()
		}
		b := make([]byte, e.Size)
		if _, err := ra.ReadAt(b, e.Data.Offset); err != nil {
			t.Fatalf("read %s: %v", path, err)
		}
		return b
	}
	t.Fatalf("%s not in the tree", path)
	return nil
}

// fetchTrace returns the image's prefetch trace artifact in the registry,
// or the error wrapping registry.ErrNotFound that says there is none.
func fetchTrace(ctx context.Context, r *Root) ([]byte, error) {
	return lazyimage.FetchTrace(ctx, r.img, r.Image)
}

// waitLog waits, at most a minute, for a log line containing s.
func waitLog(t *testing.T, l *logBuffer, s string) {
	t.Helper()
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		return strings.Contains(l.String(), s), fmt.Errorf("no log line with %q:\n%s", s, l.String())
	})
}

// TestOpenReadTracePrefetch: with push_trace a node records its pod's
// reads and pushes them; a node with the default configuration replays
// that trace, and one with a smaller max_trace_mb replays only its bound.
func TestOpenReadTracePrefetch(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	spec, files := testImage(t, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// Node 1: no index artifact (built by streaming), no trace (recorded
	// and pushed, as push_trace allows).
	var logs1 logBuffer
	o1 := testOptions(t, reg, t.TempDir(), &logs1)
	o1.Registry.PushTrace = true
	r, err := Open(ctx, spec, o1)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs1.String(), "no prefetch trace") || !strings.Contains(logs1.String(), "recording one to push") {
		t.Errorf("no word of recording a trace:\n%s", logs1.String())
	}
	r.Started()
	if got := readFile(t, r, "d/big1"); !bytes.Equal(got, files["d/big1"]) {
		t.Fatal("d/big1 read through the store differs from the image's")
	}
	fetched := r.Stats().FetchedBytes
	if fetched <= 0 || fetched > r.CompressedSize()/2 {
		t.Errorf("reading one of four big files fetched %d of %d bytes", fetched, r.CompressedSize())
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs1.String(), "prefetch trace of") || !strings.Contains(logs1.String(), "pushed") {
		t.Fatalf("the trace was not pushed at Close:\n%s", logs1.String())
	}
	if b, err := fetchTrace(ctx, r); err != nil || len(b) == 0 {
		t.Fatalf("no trace artifact in the registry after a push_trace run: %v", err)
	}

	// Node 2 (a fresh state dir, the default configuration) replays it:
	// big1 is fetched before any read.
	var logs2 logBuffer
	r2, err := Open(ctx, spec, testOptions(t, reg, t.TempDir(), &logs2))
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		got := r2.Stats().FetchedBytes
		return got >= fetched, fmt.Errorf("prefetch fetched %d bytes, want the %d node 1 read:\n%s", got, fetched, logs2.String())
	})
	before := r2.Stats().FetchedBytes
	if got := readFile(t, r2, "d/big1"); !bytes.Equal(got, files["d/big1"]) {
		t.Fatal("d/big1 differs on node 2")
	}
	if after := r2.Stats().FetchedBytes; after != before {
		t.Errorf("reading the prefetched file fetched %d more bytes", after-before)
	}
	if !strings.Contains(logs2.String(), "prefetch: replaying") {
		t.Errorf("no word of the replay:\n%s", logs2.String())
	}
	if got := readFile(t, r2, "d/hello"); !bytes.Equal(got, files["d/hello"]) {
		t.Fatal("d/hello differs")
	}

	// Node 3 replays at most max_trace_mb of it, saying so.
	var logs3 logBuffer
	o3 := testOptions(t, reg, t.TempDir(), &logs3)
	o3.Registry.MaxTraceMB = 1
	r3, err := Open(ctx, spec, o3)
	if err != nil {
		t.Fatal(err)
	}
	defer r3.Close()
	waitLog(t, &logs3, fmt.Sprintf("prefetch of %s done", r3.Image.Ref))
	if got := r3.Stats().FetchedBytes; got <= 0 || got > 1<<20 {
		t.Fatalf("a replay bounded to 1 MiB fetched %d bytes of the %d node 1 read:\n%s", got, fetched, logs3.String())
	}
	if n := strings.Count(logs3.String(), "trimmed"); n != 1 {
		t.Fatalf("%d log lines about trimming the trace, want 1:\n%s", n, logs3.String())
	}
}

// TestDefaultPushesNoTrace: a node with the default configuration records
// and pushes no trace of what its pod read, however long the pod reads.
func TestDefaultPushesNoTrace(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	spec, files := testImage(t, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var logs logBuffer
	state := t.TempDir()
	o := Options{Registry: config.DefaultRegistry(), IndexDir: filepath.Join(state, "indexes"), StoreDir: filepath.Join(state, "content"), Logf: logs.logf}
	o.Registry.ConfigPath = reg.HostsDir(t, "")
	o.Registry.TraceSeconds = 3600 // the window would end with Close, as for a short-lived container
	r, err := Open(ctx, spec, o)
	if err != nil {
		t.Fatal(err)
	}
	r.Started()
	if got := readFile(t, r, "d/big2"); !bytes.Equal(got, files["d/big2"]) {
		t.Fatal("d/big2 read through the store differs from the image's")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if b, err := fetchTrace(ctx, r); !errors.Is(err, registry.ErrNotFound) {
		t.Fatalf("a default run left a trace artifact (%d bytes, %v):\n%s", len(b), err, logs.String())
	}
	if !strings.Contains(logs.String(), "none recorded (push_trace is off)") {
		t.Errorf("no word of why no trace was recorded:\n%s", logs.String())
	}
}

func TestOpenRefusals(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct{ spec, want string }{
		{"oci:/x", "want registry:"},
		{"registry:", "want registry:"},
		{"registry:UPPER/Case", "source registry:UPPER/Case"},
	} {
		_, err := Open(ctx, c.spec, Options{Registry: config.DefaultRegistry(), IndexDir: t.TempDir(), StoreDir: t.TempDir()})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Open(%q): %v, want an error with %q", c.spec, err, c.want)
		}
	}
	if _, err := Open(ctx, "registry:127.0.0.1:1/a/b:c", Options{Registry: config.DefaultRegistry()}); err == nil || !strings.Contains(err.Error(), "state directory") {
		t.Errorf("no state dir: %v", err)
	}
}

// TestBackgroundFill: with background_fill_mbps the rest of the image
// arrives after Started, without any read.
func TestBackgroundFill(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	spec, files := testImage(t, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var logs logBuffer
	o := testOptions(t, reg, t.TempDir(), &logs)
	o.Registry.Prefetch = false
	o.Registry.BackgroundFillMbps = 1000
	r, err := Open(ctx, spec, o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got := r.Stats().FetchedBytes; got != 0 {
		t.Fatalf("%d bytes fetched before Started", got)
	}
	r.Started()
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		got := r.Stats().FetchedBytes
		return got >= r.CompressedSize(), fmt.Errorf("fill fetched %d of %d bytes:\n%s", got, r.CompressedSize(), logs.String())
	})
	if got := r.Stats().FetchedBytes; got != r.CompressedSize() {
		t.Fatalf("fill fetched %d of %d bytes:\n%s", got, r.CompressedSize(), logs.String())
	}
	reg.Stop() // everything is local now
	if got := readFile(t, r, "d/big3"); !bytes.Equal(got, files["d/big3"]) {
		t.Fatal("d/big3 differs after the fill")
	}
}
