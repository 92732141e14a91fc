package imagestore

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// Child processes of the cross-process tests run this binary again with
// childEnv naming what to do; see runChild.
const childEnv = "IMAGESTORE_TEST_CHILD"

func TestMain(m *testing.M) {
	if what := os.Getenv(childEnv); what != "" {
		os.Exit(runChild(what))
	}
	os.Exit(m.Run())
}

// runChild is one child process: args in the environment (IMAGESTORE_DIR,
// IMAGESTORE_ROOTFS), progress on stdout, one line per step.
//   - "acquire": acquire the rootfs's entry, print "built=<bool>", exit.
//   - "acquire-pause": the same, but after the build has written the
//     staging directory print "paused" and wait for the file
//     IMAGESTORE_GO (forever if it never appears: the test kills us).
//   - "remove-pause": remove the entry, pausing after it was renamed away.
//   - "acquire-many": print "ready", wait for IMAGESTORE_START, then
//     acquire the entry from IMAGESTORE_N goroutines at once, print
//     "built=<how many built> errors=<first error or none>", hold every
//     entry until IMAGESTORE_GO appears, close them, exit.
func runChild(what string) int {
	ctx := context.Background()
	dir, rootfs := os.Getenv("IMAGESTORE_DIR"), os.Getenv("IMAGESTORE_ROOTFS")
	idx, err := hostfs.FromDir(ctx, rootfs, index.Options{})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	s := New(dir)
	waitFor := func(name string) {
		for {
			if _, err := os.Stat(name); err == nil {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	wait := func() {
		fmt.Println("paused")
		waitFor(os.Getenv("IMAGESTORE_GO"))
	}
	switch what {
	case "acquire-many":
		n, err := strconv.Atoi(os.Getenv("IMAGESTORE_N"))
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println("ready")
		waitFor(os.Getenv("IMAGESTORE_START"))
		// Bounded: a deadlock fails the test instead of hanging it.
		actx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		entries, errs := acquireAll(actx, s, idx, n)
		built := 0
		firstErr := "none"
		for i, e := range entries {
			if errs[i] != nil && firstErr == "none" {
				firstErr = errs[i].Error()
			}
			if e != nil && e.Built {
				built++
			}
		}
		fmt.Printf("built=%d errors=%s\n", built, firstErr)
		waitFor(os.Getenv("IMAGESTORE_GO"))
		for _, e := range entries {
			if e != nil {
				e.Close()
			}
		}
	case "acquire-pause":
		s.afterWrite = func(string) { wait() }
		fallthrough
	case "acquire":
		fmt.Println("acquiring")
		e, err := s.Acquire(ctx, idx, ext4.Options{})
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Printf("built=%t\n", e.Built)
		e.Close()
	case "remove-pause":
		key, _, _ := Key(idx, ext4.Options{})
		c := &nodeCache{dir: dir, afterRename: wait}
		if err := c.Remove(ctx, key); err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println("removed")
	default:
		fmt.Println("unknown child", what)
		return 2
	}
	return 0
}

// child starts this test binary as a child process doing what.
type child struct {
	cmd   *exec.Cmd
	lines chan string
}

func startChild(t *testing.T, what, dir, rootfs, goFile string, env ...string) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+what, "IMAGESTORE_DIR="+dir, "IMAGESTORE_ROOTFS="+rootfs, "IMAGESTORE_GO="+goFile)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return c
}

// expect reads the child's next line and fails unless it is want.
func (c *child) expect(t *testing.T, want string) {
	t.Helper()
	line, ok := <-c.lines
	if !ok || line != want {
		t.Fatalf("child said %q (open %t), want %q", line, ok, want)
	}
}

// finish waits for the child's exit and returns its remaining lines.
func (c *child) finish(t *testing.T) []string {
	t.Helper()
	var lines []string
	for l := range c.lines {
		lines = append(lines, l)
	}
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("child: %v (said %q)", err, lines)
	}
	return lines
}

// rootfs makes a small tree: directories, files with data, a symlink.
func rootfs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for i := 0; i < 20; i++ {
		sub := filepath.Join(dir, fmt.Sprintf("d%02d", i%4))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		body := bytes.Repeat([]byte{byte('a' + i)}, 1000*i+1)
		if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%02d", i)), body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("d00/f00", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	return dir
}

func indexOf(t *testing.T, dir string) *index.Index {
	t.Helper()
	idx, err := hostfs.FromDir(context.Background(), dir, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

// storeNames lists the store directory.
func storeNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// acquireAll acquires idx's entry from n goroutines at once and returns
// what each got, every entry still held.
func acquireAll(ctx context.Context, s *Store, idx *index.Index, n int) ([]*Entry, []error) {
	var wg sync.WaitGroup
	start := make(chan struct{})
	entries := make([]*Entry, n)
	errs := make([]error, n)
	for i := range entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			entries[i], errs[i] = s.Acquire(ctx, idx, ext4.Options{})
		}()
	}
	close(start)
	wg.Wait()
	return entries, errs
}

// Goroutines acquiring one key at once get one entry, built by exactly
// one, while every one of them holds it: a pod serving the image never
// keeps another pod of it from starting.
func TestAcquireBuildsOnceAcrossGoroutines(t *testing.T) {
	for _, n := range []int{2, 8} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			idx := indexOf(t, rootfs(t))
			s := New(t.TempDir())
			// Bounded: a deadlock fails the test instead of hanging it.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			entries, errs := acquireAll(ctx, s, idx, n)
			for _, e := range entries {
				if e != nil {
					defer e.Close()
				}
			}
			built := 0
			for i, err := range errs {
				if err != nil {
					t.Fatalf("acquire %d of %d: %v", i, n, err)
				}
				if entries[i].Built {
					built++
				}
				if entries[i].Dir != entries[0].Dir || entries[i].Key != entries[0].Key {
					t.Fatalf("two entries: %s, %s", entries[0].Dir, entries[i].Dir)
				}
				if entries[i].Image.Manifest.UUID != entries[0].Image.Manifest.UUID {
					t.Fatal("entries disagree")
				}
			}
			if built != 1 {
				t.Fatalf("built by %d of %d acquirers, want 1", built, n)
			}
			key := entries[0].Key
			if got, want := strings.Join(storeNames(t, s.dir), " "), key+" "+key+".lock"; got != want {
				t.Fatalf("store holds %q, want %q", got, want)
			}
		})
	}
}

// Two processes of eight goroutines each acquire one key at the same
// instant and hold it: one build among the sixteen, none waits forever.
func TestAcquireBuildsOnceAcrossGoroutinesAndProcesses(t *testing.T) {
	src, dir := rootfs(t), t.TempDir()
	files := t.TempDir()
	startFile, goFile := filepath.Join(files, "start"), filepath.Join(files, "go")
	var kids []*child
	for range 2 {
		c := startChild(t, "acquire-many", dir, src, goFile, "IMAGESTORE_N=8", "IMAGESTORE_START="+startFile)
		c.expect(t, "ready")
		kids = append(kids, c)
	}
	if err := os.WriteFile(startFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	built := 0
	for i, c := range kids {
		line, ok := <-c.lines
		var b int
		var errText string
		if !ok {
			t.Fatalf("process %d ended before it acquired", i)
		}
		if _, err := fmt.Sscanf(line, "built=%d errors=%s", &b, &errText); err != nil || errText != "none" {
			t.Fatalf("process %d said %q", i, line)
		}
		built += b
	}
	// Both processes now hold the entry; a third acquirer still gets it.
	e, err := New(dir).Acquire(context.Background(), indexOf(t, src), ext4.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range kids {
		c.finish(t)
	}
	if built != 1 || e.Built {
		t.Fatalf("built %d times by the processes (and %t here), want once", built, e.Built)
	}
}

// Two processes acquiring one key: the second waits for the first's build
// and finds its entry.
func TestAcquireBuildsOnceAcrossProcesses(t *testing.T) {
	src, dir := rootfs(t), t.TempDir()
	goFile := filepath.Join(t.TempDir(), "go")
	a := startChild(t, "acquire-pause", dir, src, goFile)
	a.expect(t, "acquiring")
	a.expect(t, "paused") // a holds the key's lock exclusively, its build written but not published
	b := startChild(t, "acquire", dir, src, goFile)
	b.expect(t, "acquiring")
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	la, lb := a.finish(t), b.finish(t)
	if fmt.Sprint(la) != "[built=true]" || fmt.Sprint(lb) != "[built=false]" {
		t.Fatalf("first process said %q, second %q: want one build", la, lb)
	}
	// And a third acquirer, in this process, finds it too.
	e, err := New(dir).Acquire(context.Background(), indexOf(t, src), ext4.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.Built {
		t.Fatal("built again")
	}
	if n := len(storeNames(t, dir)); n != 2 {
		t.Fatalf("store holds %q, want one entry and its lock", storeNames(t, dir))
	}
}

// Every build of a key writes the same bytes, so which pod built an entry
// does not matter.
func TestBuildsAreIdentical(t *testing.T) {
	idx := indexOf(t, rootfs(t))
	var first *Entry
	for i := 0; i < 2; i++ {
		e, err := New(t.TempDir()).Acquire(context.Background(), idx, ext4.Options{WritableSize: 8 << 20})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if !e.Built {
			t.Fatal("a fresh store did not build")
		}
		if first == nil {
			first = e
			continue
		}
		for _, f := range []string{ext4.MetaFile, ext4.MapFile, ext4.ManifestFile} {
			a, err1 := os.ReadFile(filepath.Join(first.Dir, f))
			b, err2 := os.ReadFile(filepath.Join(e.Dir, f))
			if err := errors.Join(err1, err2); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a, b) {
				t.Errorf("%s differs between two builds of one key", f)
			}
		}
	}
}

// Options that change the image's bytes change the key; budgets, the
// temporary directory and spelled-out defaults do not.
func TestKeyCoversByteOptions(t *testing.T) {
	idx := indexOf(t, rootfs(t))
	key := func(o ext4.Options) string {
		k, _, err := Key(idx, o)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	base := key(ext4.Options{})
	if !ValidKey(base) {
		t.Fatalf("key %q", base)
	}
	same := []ext4.Options{
		{BlockSize: ext4.DefaultBlockSize},
		{WritableSize: ext4.DefaultWritableSize},
		{MaxMetadataBytes: 1 << 20, MaxBuildMemory: 1 << 20, TempDir: "/elsewhere"},
	}
	for _, o := range same {
		if k := key(o); k != base {
			t.Errorf("%+v: key %s, want the default's %s", o, k, base)
		}
	}
	if key(ext4.Options{NoJournal: true, JournalSize: 8 << 20}) != key(ext4.Options{NoJournal: true}) {
		t.Error("the journal size changed the key of an image without a journal")
	}
	seen := map[string]string{base: "default"}
	for name, o := range map[string]ext4.Options{
		"block size":    {BlockSize: 2048},
		"writable size": {WritableSize: 64 << 20},
		"no writable":   {WritableSize: -1},
		"no journal":    {NoJournal: true},
		"journal size":  {JournalSize: 8 << 20},
		"free inodes":   {FreeInodes: 4096},
		"time":          {Time: time.Unix(1700000000, 0)},
		"uuid":          {UUID: [16]byte{1}},
		"hash seed":     {HashSeed: [16]byte{1}},
		"volume name":   {VolumeName: "root"},
	} {
		k := key(o)
		if prev, ok := seen[k]; ok {
			t.Errorf("%s: same key as %s", name, prev)
		}
		seen[k] = name
	}
	other := indexOf(t, rootfs(t)) // same names, other times
	if k, _, _ := Key(other, ext4.Options{}); k == base {
		t.Error("two different trees share a key")
	}
}

// A source no entry reads, such as a fresh container's empty upper
// directory, does not make a key of its own: two containers of one image
// share the entry.
func TestKeyIgnoresUnreferencedSources(t *testing.T) {
	ctx := context.Background()
	lower := rootfs(t)
	uppers := []string{t.TempDir(), t.TempDir()}
	// The merged root takes the upper directory's attributes; give both
	// containers' the same, as only the sources should differ here.
	stamp := time.Unix(1700000000, 0)
	for _, u := range uppers {
		if err := os.Chtimes(u, stamp, stamp); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(u, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var keys []string
	for _, u := range uppers {
		idx, err := overlayfs.FromLayers(ctx, []string{lower, u}, index.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if len(idx.Sources) != 2 {
			t.Fatalf("%d sources, want the lower and the upper", len(idx.Sources))
		}
		k, norm, err := Key(idx, ext4.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if len(norm.Sources) != 1 || norm.Sources[0].ID != lower {
			t.Fatalf("normalized sources %+v, want only %s", norm.Sources, lower)
		}
		if idx.Sources[1].ID != u {
			t.Fatal("Normalize changed its input")
		}
		keys = append(keys, k)
	}
	if keys[0] != keys[1] {
		t.Fatalf("two containers of one image: keys %s and %s", keys[0], keys[1])
	}
	// A file in the upper directory makes it a source: a key of its own.
	if err := os.WriteFile(filepath.Join(uppers[1], "new"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(uppers[1], stamp, stamp); err != nil {
		t.Fatal(err)
	}
	idx, err := overlayfs.FromLayers(ctx, []string{lower, uppers[1]}, index.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if k, _, _ := Key(idx, ext4.Options{}); k == keys[0] {
		t.Fatal("an upper directory with a file shares the image's key")
	}
}

// A builder killed after writing its staging directory leaves nothing
// served: the next Acquire builds the entry cleanly and sweeps the
// leftover.
func TestKilledBuildIsNeverServed(t *testing.T) {
	src, dir := rootfs(t), t.TempDir()
	c := startChild(t, "acquire-pause", dir, src, filepath.Join(t.TempDir(), "never"))
	c.expect(t, "acquiring")
	c.expect(t, "paused")
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	c.cmd.Wait()
	var staging []string
	for _, n := range storeNames(t, dir) {
		if strings.HasPrefix(n, stagingPre) {
			staging = append(staging, n)
		} else if ValidKey(n) {
			t.Fatalf("killed build left an entry %s", n)
		}
	}
	if len(staging) != 1 {
		t.Fatalf("store holds %q, want the dead builder's staging directory", storeNames(t, dir))
	}
	if got, err := NodeCache(dir).Entries(context.Background()); err != nil || len(got) != 0 {
		t.Fatalf("entries after a killed build: %+v, %v", got, err)
	}
	e, err := New(dir).Acquire(context.Background(), indexOf(t, src), ext4.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if !e.Built {
		t.Fatal("a dead builder's staging directory was served")
	}
	for _, n := range storeNames(t, dir) {
		if strings.HasPrefix(n, stagingPre) {
			t.Fatalf("staging directory %s left after a clean build", n)
		}
	}
}

// Entries lists an entry with its use; Remove refuses one a pod holds and
// deletes a free one with its lock file.
func TestNodeCacheRemove(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	idx := indexOf(t, rootfs(t))
	before := time.Now().Add(-time.Second)
	e, err := New(dir).Acquire(ctx, idx, ext4.Options{WritableSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	c := NodeCache(dir)
	if c.Name() != "metadata" {
		t.Fatalf("name %q", c.Name())
	}
	list, err := c.Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Key != e.Key || !list[0].InUse || list[0].Bytes < e.Image.MetaSize() || list[0].LastUsed.Before(before) {
		t.Fatalf("entries %+v, want %s in use, at least %d bytes, used after %v", list, e.Key, e.Image.MetaSize(), before)
	}
	if err := c.Remove(ctx, e.Key); !errors.Is(err, nodecache.ErrInUse) {
		t.Fatalf("remove of a held entry: %v, want ErrInUse", err)
	}
	if !exists(e.Dir) {
		t.Fatal("a held entry was removed")
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if list, _ = c.Entries(ctx); len(list) != 1 || list[0].InUse {
		t.Fatalf("entries after close: %+v, want one free", list)
	}
	if err := c.Remove(ctx, e.Key); err != nil {
		t.Fatal(err)
	}
	if names := storeNames(t, dir); len(names) != 0 {
		t.Fatalf("store holds %q after remove", names)
	}
	if err := c.Remove(ctx, e.Key); err != nil {
		t.Errorf("remove of a missing entry: %v", err)
	}
	if err := c.Remove(ctx, "../etc"); err == nil {
		t.Error("remove of a bad key succeeded")
	}
}

// A Remove killed after renaming the entry away leaves trash that is
// never served: the key is rebuilt, and listing sweeps the trash.
func TestKilledRemoveLeavesNothingTorn(t *testing.T) {
	ctx := context.Background()
	src, dir := rootfs(t), t.TempDir()
	e, err := New(dir).Acquire(ctx, indexOf(t, src), ext4.Options{})
	if err != nil {
		t.Fatal(err)
	}
	key := e.Key
	e.Close()
	c := startChild(t, "remove-pause", dir, src, filepath.Join(t.TempDir(), "never"))
	c.expect(t, "paused")
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	c.cmd.Wait()
	if exists(filepath.Join(dir, key)) {
		t.Fatal("the entry survived its rename")
	}
	list, err := NodeCache(dir).Entries(ctx)
	if err != nil || len(list) != 0 {
		t.Fatalf("entries after a killed remove: %+v, %v", list, err)
	}
	for _, n := range storeNames(t, dir) {
		if strings.HasPrefix(n, trashPre) {
			t.Fatalf("listing left trash %s", n)
		}
	}
	e, err = New(dir).Acquire(ctx, indexOf(t, src), ext4.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if !e.Built || e.Key != key {
		t.Fatalf("after a killed remove: built %t, key %s", e.Built, e.Key)
	}
}

// An Acquire waiting for another's build gives up with its context.
func TestAcquireWaitEndsWithContext(t *testing.T) {
	src, dir := rootfs(t), t.TempDir()
	idx := indexOf(t, src)
	key, _, _ := Key(idx, ext4.Options{})
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := lockFile(context.Background(), filepath.Join(dir, key+buildSuffix), unix.LOCK_EX)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := New(dir).Acquire(ctx, idx, ext4.Options{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("acquire against a held build lock: %v, want the context's deadline", err)
	}
}

// A build lock left by a dead builder is swept by listing, and one a live
// builder holds is not.
func TestNodeCacheSweepsDeadBuildLock(t *testing.T) {
	dir := t.TempDir()
	key := strings.Repeat("ab", 32)
	dead := filepath.Join(dir, key+buildSuffix)
	if err := os.WriteFile(dead, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	liveKey := strings.Repeat("cd", 32)
	live, err := lockFile(context.Background(), filepath.Join(dir, liveKey+buildSuffix), unix.LOCK_EX)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	if _, err := NodeCache(dir).Entries(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(storeNames(t, dir), " "), liveKey+buildSuffix; got != want {
		t.Fatalf("store holds %q after listing, want %q", got, want)
	}
}
