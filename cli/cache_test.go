package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
)

// neverFetch is the Fetcher of a layer the test only holds open in a
// Store (to mark it in use) and never reads; a fetch fails the read.
type neverFetch struct{}

func (neverFetch) FetchRange(context.Context, []byte, int64) error {
	return errors.New("the test never reads this layer")
}

func cacheLs(t *testing.T) map[string]CacheListing {
	t.Helper()
	code, out, stderr := run(t, "cache", "ls", "--json", "-v")
	if code != 0 {
		t.Fatalf("cache ls: exit %d: %s", code, stderr)
	}
	var ls []CacheListing
	if err := json.Unmarshal([]byte(out), &ls); err != nil {
		t.Fatalf("cache ls --json: %v: %s", err, out)
	}
	m := map[string]CacheListing{}
	for _, l := range ls {
		m[l.Name] = l
	}
	return m
}

func countPrefix(l CacheListing, prefix string) int {
	n := 0
	for _, e := range l.List {
		if strings.HasPrefix(e.Key, prefix) {
			n++
		}
	}
	return n
}

// TestCacheLsPrune: on a state directory that real commands filled (a
// registry image built and exported through the lazy store, an OCI
// layout built with its blobs and per-layer indexes), `cache ls` lists
// every cache with its entries and blocks; `cache prune` keeps entries
// used within min_age_minutes, a dry run removes nothing, and a prune to
// 0 removes everything but the lazy layer a Store holds open and the blob
// a disk holds, and says it kept them; released, they go too.
func TestCacheLsPrune(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	img := lazyimagetest.TwoLayers(t, "v1")
	reg.Push(t, img.Dir, "v1", "kata/cache:v1")
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	t.Setenv("KATA_FSX_CACHE", "")
	state := t.TempDir()
	cfg := writeConfig(t, "[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nstate_dir = \""+state+"\"\n[kata_fsx.registry]\nprefetch = false\nconfig_path = \""+
		reg.HostsDir(t, "")+"\"\n[kata_fsx.cache]\nindexes_mb = 64\nblobs_mb = 0\n")
	t.Setenv(config.EnvConfigFile, cfg)
	work := t.TempDir()
	lazyOut, ociOut := filepath.Join(work, "lazy"), filepath.Join(work, "oci")
	if code, _, stderr := run(t, "image", "build", "-q", "--writable-size", "0", "-o", lazyOut, "registry:"+reg.Addr+"/kata/cache:v1"); code != 0 {
		t.Fatalf("image build registry: exit %d: %s", code, stderr)
	}
	if code, _, stderr := run(t, "image", "export", "--raw", filepath.Join(work, "lazy.raw"), lazyOut); code != 0 {
		t.Fatalf("image export: exit %d: %s", code, stderr)
	}
	if code, _, stderr := run(t, "image", "build", "-q", "--writable-size", "0", "-o", ociOut, "oci:"+img.Dir+":v1"); code != 0 {
		t.Fatalf("image build oci: exit %d: %s", code, stderr)
	}

	ls := cacheLs(t)
	if l := ls["content"]; l.Entries != 2 || l.Bytes < 12<<20 || l.InUse != 0 || l.BudgetBytes != int64(config.DefaultCache().ContentMB)<<20 {
		t.Fatalf("content: %+v, want 2 layers holding the compressed blobs exported (over 12 MiB)", l)
	}
	if l := ls["blobs"]; l.Entries != 2 || l.Bytes < 20<<20 || l.BudgetBytes != -1 {
		t.Fatalf("blobs: %+v, want the 2 layers uncompressed and no budget", l)
	}
	if l := ls["indexes"]; countPrefix(l, "layer/") != 2 || countPrefix(l, "lazy/") != 2 || l.BudgetBytes != 64<<20 {
		t.Fatalf("indexes: %+v, want 2 per-layer and 2 lazy indexes", l)
	}
	code, out, _ := run(t, "cache", "ls")
	if code != 0 || !strings.Contains(out, "content") || !strings.Contains(out, "none") {
		t.Fatalf("cache ls: %d %s", code, out)
	}

	// Entries were all used just now: the configured minimum age keeps them.
	code, out, stderr := run(t, "cache", "prune", "--budget-mb", "0")
	if code != 0 || strings.Contains(out, "  removed ") || !strings.Contains(out, "used within the minimum age") {
		t.Fatalf("prune within min_age_minutes: exit %d: %s%s", code, out, stderr)
	}
	code, out, stderr = run(t, "cache", "prune", "--budget-mb", "0", "--min-age-minutes", "0", "--dry-run", "--json")
	var dry []PruneReport
	if code != 0 || json.Unmarshal([]byte(out), &dry) != nil || len(dry) != 4 || dry[3].Name != "content" || len(dry[3].Removed) != 2 || !dry[3].DryRun {
		t.Fatalf("dry run: exit %d: %s%s", code, out, stderr)
	}
	if after := cacheLs(t); after["content"].Entries != 2 || after["blobs"].Entries != 2 || after["indexes"].Entries != ls["indexes"].Entries {
		t.Fatalf("a dry run removed entries: %+v", after)
	}

	// A Store with one lazy layer open, and a disk's hold on one blob.
	var lazyKey, blobKey string
	for _, e := range ls["content"].List {
		lazyKey = e.Key
	}
	for _, e := range ls["blobs"].List {
		blobKey = e.Key
	}
	ixb, err := os.ReadFile(filepath.Join(state, "indexes", "index", "sha256", lazyKey))
	if err != nil {
		t.Fatal(err)
	}
	ix, err := lazyindex.Decode(bytes.NewReader(ixb))
	if err != nil {
		t.Fatal(err)
	}
	s, err := store.Open(store.Options{Dir: filepath.Join(state, "content")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.AddLayer(ix, neverFetch{}); err != nil {
		t.Fatal(err)
	}
	release, err := hostfs.HoldBlobs(filepath.Join(state, "cache"), []index.Source{{Kind: index.SourceBlob, ID: "sha256:" + blobKey}})
	if err != nil {
		t.Fatal(err)
	}
	defer release()

	code, out, stderr = run(t, "cache", "prune", "--budget-mb", "0", "--min-age-minutes", "0")
	if code != 0 {
		t.Fatalf("prune: exit %d: %s%s", code, out, stderr)
	}
	t.Logf("kata-fsx cache prune --budget-mb 0 --min-age-minutes 0:\n%s", out)
	for _, want := range []string{"kept " + lazyKey, "kept " + blobKey, "still over budget: 1 entry in use", "  removed lazy/", "  removed layer/"} {
		if !strings.Contains(out, want) {
			t.Fatalf("prune output lacks %q:\n%s", want, out)
		}
	}
	after := cacheLs(t)
	if l := after["content"]; l.Entries != 1 || l.List[0].Key != lazyKey || !l.List[0].InUse {
		t.Fatalf("content after the prune: %+v, want the open layer alone", l)
	}
	if l := after["blobs"]; l.Entries != 1 || l.List[0].Key != blobKey || !l.List[0].InUse {
		t.Fatalf("blobs after the prune: %+v, want the held blob alone", l)
	}
	if l := after["indexes"]; l.Entries != 0 {
		t.Fatalf("indexes after the prune: %+v", l)
	}

	s.Close()
	release()
	code, out, stderr = run(t, "cache", "prune", "--cache", "content", "--budget-mb", "0", "--min-age-minutes", "0")
	if code != 0 || !strings.Contains(out, "removed "+lazyKey) || strings.Contains(out, "blobs") {
		t.Fatalf("prune --cache content: exit %d: %s%s", code, out, stderr)
	}
	if code, _, stderr := run(t, "cache", "prune", "--cache", "nosuch"); code != 2 || !strings.Contains(stderr, "no such cache") {
		t.Fatalf("prune --cache nosuch: exit %d: %s", code, stderr)
	}
	bad := writeConfig(t, "[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nstate_dir = \""+state+"\"\n[kata_fsx.cache]\nprune = \"never\"\n")
	if code, _, stderr := run(t, "cache", "ls", "--config", bad); code != 1 || !strings.Contains(stderr, "kata_fsx.cache.prune") {
		t.Fatalf("cache ls with a bad table: exit %d: %s", code, stderr)
	}
}

// TestStartAutoPrune: `kata-fsx snapshotter`'s prune runs at its start
// (and logs what it removed); stop returns once it is over. With prune
// "manual" it never runs.
func TestStartAutoPrune(t *testing.T) {
	state := t.TempDir()
	c := config.Default()
	c.KataFSX.ImagefsBlk.StateDir = state
	c.KataFSX.Cache.BlobsMB = 1
	c.KataFSX.Cache.PruneIntervalMinutes = 0
	p, err := index.BlobPath(filepath.Join(state, "cache"), "sha256:"+strings.Repeat("a", 64))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, bytes.Repeat([]byte{1}, 2<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(p, old, old); err != nil {
		t.Fatal(err)
	}
	var logged []string
	logf := func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }
	c.KataFSX.Cache.Prune = config.PruneManual
	startAutoPrune(context.Background(), c, logf, func() { t.Error("a manual configuration pruned") })()
	if _, err := os.Stat(p); err != nil || len(logged) != 0 {
		t.Fatalf("manual: %v %q", err, logged)
	}
	c.KataFSX.Cache.Prune = config.PruneAuto
	round := make(chan struct{}, 1)
	stop := startAutoPrune(context.Background(), c, logf, func() { round <- struct{}{} })
	<-round // the prune at start
	stop()
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("the blob over budget: %v, want it pruned", err)
	}
	if len(logged) != 1 || !strings.Contains(logged[0], "cache blobs:") || !strings.Contains(logged[0], "removed 1 entry") {
		t.Fatalf("log %q", logged)
	}
}
