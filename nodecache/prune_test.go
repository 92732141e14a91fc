package nodecache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/helperproc"
)

// helperEnv makes the test binary a helper process (TestHelperProcess):
// "hold PATH" holds PATH's shared lock until killed; "prune DIR BUDGET"
// prunes a locked Dir cache of DIR to BUDGET bytes, pausing after its
// first removal.
const helperEnv = "NODECACHE_TEST_HELPER"

// TestHelperProcess is not a test: it is the helper process the tests
// start, and it returns at once when helperEnv is unset.
func TestHelperProcess(t *testing.T) {
	args := strings.Fields(os.Getenv(helperEnv))
	if len(args) == 0 {
		return
	}
	switch args[0] {
	case "hold":
		f, err := openShared(args[1])
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		defer f.Close()
		fmt.Println("held")
		select {}
	case "prune":
		budget, _ := strconv.ParseInt(args[2], 10, 64)
		c := &pauseAfterRemove{Cache: &Dir{CacheName: "test", Path: args[1], Suffix: ".e", Locked: true}, step: "prune"}
		r, err := Prune(context.Background(), c, budget, PruneOptions{})
		fmt.Println(r.Summary(), err)
		os.Exit(0)
	}
}

// pauseAfterRemove is Cache, whose first removal pauses the helper
// process (helperproc.Pause) once it is done: its test kills the helper
// in the middle of a prune.
type pauseAfterRemove struct {
	Cache
	step string
}

func (p *pauseAfterRemove) Remove(ctx context.Context, key string) error {
	err := p.Cache.Remove(ctx, key)
	if err == nil {
		helperproc.Pause(p.step)
	}
	return err
}

// writeEntries writes n entries of a Dir cache (suffix ".e"), entry i of
// i+1 blocks of bytes 'a'+i, last used i hours after a fixed day, and
// returns their paths.
func writeEntries(t *testing.T, dir string, n int) []string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	day := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var ps []string
	for i := range n {
		p := filepath.Join(dir, fmt.Sprintf("k%d.e", i))
		if err := os.WriteFile(p, bytes.Repeat([]byte{byte('a' + i)}, (i+1)*4096), 0o600); err != nil {
			t.Fatal(err)
		}
		at := day.Add(time.Duration(i) * time.Hour)
		if err := os.Chtimes(p, at, at); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

func keys(es []Entry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Key)
	}
	return out
}

func checkEntry(t *testing.T, dir string, i int) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("k%d.e", i)))
	if err != nil {
		t.Fatalf("entry k%d: %v", i, err)
	}
	if !bytes.Equal(b, bytes.Repeat([]byte{byte('a' + i)}, (i+1)*4096)) {
		t.Fatalf("entry k%d: %d bytes that are not what was written", i, len(b))
	}
}

// TestPruneLRU: a prune removes the least recently used entries first
// and stops once the cache fits; a dry run removes nothing.
func TestPruneLRU(t *testing.T) {
	dir := t.TempDir()
	writeEntries(t, dir, 5)
	c := &Dir{CacheName: "test", Path: dir, Suffix: ".e"}
	ctx := context.Background()
	es, err := c.Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, e := range es {
		if e.Bytes < 4096 {
			t.Fatalf("entry %s takes %d bytes, want its blocks", e.Key, e.Bytes)
		}
		total += e.Bytes
	}
	budget := total - es[0].Bytes - es[1].Bytes // k0 and k1 are the oldest
	dry, err := Prune(ctx, c, budget, PruneOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := keys(dry.Removed); strings.Join(got, ",") != "k0,k1" {
		t.Fatalf("dry run would remove %v, want k0,k1", got)
	}
	for i := range 5 {
		checkEntry(t, dir, i)
	}
	var logged []string
	r, err := Prune(ctx, c, budget, PruneOptions{Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }})
	if err != nil {
		t.Fatal(err)
	}
	if got := keys(r.Removed); strings.Join(got, ",") != "k0,k1" || r.After != budget || r.OverBudget() {
		t.Fatalf("removed %v, %d bytes after for a budget of %d, want k0,k1 and the budget met", got, r.After, budget)
	}
	if len(logged) != 2 || !strings.Contains(logged[0], "removed k0") {
		t.Fatalf("log %q, want a line per removal", logged)
	}
	for i := 2; i < 5; i++ {
		checkEntry(t, dir, i)
	}
	if es, _ := c.Entries(ctx); strings.Join(keys(es), ",") != "k2,k3,k4" {
		t.Fatalf("left %v, want k2,k3,k4", keys(es))
	}
	// Within the budget already: nothing to do. Unlimited: nothing either.
	if r, _ := Prune(ctx, c, budget, PruneOptions{}); len(r.Removed) != 0 {
		t.Fatalf("a cache within its budget lost %v", keys(r.Removed))
	}
	if r, _ := Prune(ctx, c, Unlimited, PruneOptions{}); len(r.Removed) != 0 {
		t.Fatalf("an unlimited cache lost %v", keys(r.Removed))
	}
}

// TestPruneMinAge: entries used within MinAge stay, and the result says
// the cache is over its budget because of them.
func TestPruneMinAge(t *testing.T) {
	dir := t.TempDir()
	ps := writeEntries(t, dir, 3)
	Touch(ps[0]) // the oldest is used now
	c := &Dir{CacheName: "test", Path: dir, Suffix: ".e"}
	r, err := Prune(context.Background(), c, 0, PruneOptions{MinAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(keys(r.Removed), ",") != "k1,k2" || strings.Join(keys(r.KeptRecent), ",") != "k0" || !r.OverBudget() {
		t.Fatalf("removed %v kept %v over %v, want k1,k2 removed and k0 kept", keys(r.Removed), keys(r.KeptRecent), r.OverBudget())
	}
	checkEntry(t, dir, 0)
}

// TestPruneSkipsHeld: an entry another process holds (its shared lock)
// is listed in use and kept by a prune, which says the cache stays over
// budget; once the process is gone (killed: the kernel drops its lock)
// the entry goes.
func TestPruneSkipsHeld(t *testing.T) {
	dir := t.TempDir()
	ps := writeEntries(t, dir, 4)
	holder := helperproc.Start(t, "TestHelperProcess", "held", helperEnv+"=hold "+ps[1])
	c := &Dir{CacheName: "test", Path: dir, Suffix: ".e", Locked: true}
	ctx := context.Background()
	es, err := c.Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if e.InUse != (e.Key == "k1") {
			t.Fatalf("entry %s in use %v", e.Key, e.InUse)
		}
	}
	if err := c.Remove(ctx, "k1"); !errors.Is(err, ErrInUse) {
		t.Fatalf("Remove of a held entry: %v, want ErrInUse", err)
	}
	r, err := Prune(ctx, c, 0, PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(keys(r.Removed), ",") != "k0,k2,k3" || strings.Join(keys(r.KeptInUse), ",") != "k1" || !r.OverBudget() ||
		!strings.Contains(r.Summary(), "still over budget: 1 entry in use") {
		t.Fatalf("removed %v kept %v: %s; want all but k1 removed, k1 kept and said so", keys(r.Removed), keys(r.KeptInUse), r.Summary())
	}
	checkEntry(t, dir, 1)
	// The holder was stamped as a use.
	if es, _ := c.Entries(ctx); len(es) != 1 || time.Since(es[0].LastUsed) > time.Hour {
		t.Fatalf("left %+v, want k1 used just now", es)
	}
	helperproc.Kill(t, holder)
	r, err = Prune(ctx, c, 0, PruneOptions{})
	if err != nil || strings.Join(keys(r.Removed), ",") != "k1" || r.OverBudget() {
		t.Fatalf("after the holder died: removed %v, %v", keys(r.Removed), err)
	}
	if _, err := openShared(ps[1]); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("openShared of a pruned entry: %v, want not exist", err)
	}
}

// TestPruneKilled: a prune killed (SIGKILL) after its first removal
// leaves every other entry whole, and a later prune finishes the job.
func TestPruneKilled(t *testing.T) {
	dir := t.TempDir()
	writeEntries(t, dir, 4)
	cmd := helperproc.Start(t, "TestHelperProcess", "helperproc: paused at prune", helperEnv+"=prune "+dir+" 0")
	helperproc.Kill(t, cmd)
	c := &Dir{CacheName: "test", Path: dir, Suffix: ".e", Locked: true}
	es, err := c.Entries(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(keys(es), ",") != "k1,k2,k3" {
		t.Fatalf("after the kill: %v, want k0 alone removed", keys(es))
	}
	for i := 1; i < 4; i++ {
		checkEntry(t, dir, i)
	}
	des, _ := os.ReadDir(dir)
	if len(des) != 3 {
		t.Fatalf("%d files in the cache, want the 3 entries and nothing else", len(des))
	}
	if r, err := Prune(context.Background(), c, 0, PruneOptions{}); err != nil || len(r.Removed) != 3 {
		t.Fatalf("second prune: %v %v", keys(r.Removed), err)
	}
}

// TestDirTempsAndKeys: a stale temporary file is an entry a prune
// removes, a fresh one is in use (a write in progress), and Remove
// refuses keys that would leave the directory.
func TestDirTempsAndKeys(t *testing.T) {
	dir := t.TempDir()
	writeEntries(t, dir, 1)
	stale, fresh := filepath.Join(dir, TempPrefix+"1"), filepath.Join(dir, TempPrefix+"2")
	for _, p := range []string{stale, fresh} {
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-2 * StaleTemp)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	c := &Dir{CacheName: "test", Path: dir, Suffix: ".e"}
	r, err := Prune(context.Background(), c, 0, PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(keys(r.Removed), ",") != "k0,"+TempPrefix+"1" || strings.Join(keys(r.KeptInUse), ",") != TempPrefix+"2" {
		t.Fatalf("removed %v kept %v", keys(r.Removed), keys(r.KeptInUse))
	}
	for _, k := range []string{"../x", "..", "", "a/b"} {
		if err := c.Remove(context.Background(), k); err == nil {
			t.Errorf("Remove(%q) succeeded", k)
		}
	}
	if es, err := (&Dir{CacheName: "none", Path: filepath.Join(dir, "missing")}).Entries(context.Background()); err != nil || len(es) != 0 {
		t.Fatalf("missing directory: %v %v, want an empty cache", es, err)
	}
}

// TestUnion: a union lists its parts' entries under their prefixes and
// removes through them.
func TestUnion(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	writeEntries(t, a, 2)
	writeEntries(t, b, 1)
	u := &Union{CacheName: "u", Parts: []Part{{"a", &Dir{Path: a, Suffix: ".e"}}, {"b", &Dir{Path: b, Suffix: ".e"}}}}
	es, err := u.Entries(context.Background())
	if err != nil || strings.Join(keys(es), ",") != "a/k0,a/k1,b/k0" {
		t.Fatalf("entries %v %v", keys(es), err)
	}
	if err := u.Remove(context.Background(), "b/k0"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(b, "k0.e")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("b/k0 not removed: %v", err)
	}
	if err := u.Remove(context.Background(), "c/k0"); err == nil {
		t.Fatal("Remove of an unknown part succeeded")
	}
}

// openShared opens the cache file p for reading with LockShared.
func openShared(p string) (*os.File, error) {
	for try := 0; ; try++ {
		f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		err = LockShared(f, p)
		if err == nil {
			return f, nil
		}
		f.Close()
		if !errors.Is(err, errReplaced) || try == 3 {
			return nil, err
		}
	}
}
