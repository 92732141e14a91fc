package workload

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// allWorkloads and units are what the script promises, in its order.
var allWorkloads = []string{
	"fio-seqread", "fio-seqwrite", "fio-randread", "fio-randwrite", "dbench",
	"install", "install-sync", "chown", "chown-sync", "stat", "find", "rg", "rm", "rm-sync",
	"sqlite-insert", "sqlite-select",
}

var units = map[string]string{
	"fio-seqread": "MB/s", "fio-seqwrite": "MB/s", "fio-randread": "IOPS", "fio-randwrite": "IOPS",
	"dbench": "MB/s",
}

// smallEnv keeps a full run to seconds on the host.
var smallEnv = []string{
	"BENCH_REPS=1", "BENCH_FIO_MB=16", "BENCH_FIO_SECS=1", "BENCH_DBENCH_SECS=2",
	"BENCH_DBENCH_CLIENTS=2", "BENCH_SQLITE_ROWS=3000",
}

type line struct {
	kind   string // START, INFO, RESULT, FAIL, DONE
	fields []string
}

type run struct {
	lines   []line
	results map[string][]float64 // workload -> values
	units   map[string]string
	fails   map[string][]string // workload -> messages
	info    map[string]string
}

// parse checks the protocol's shape: every stdout line is an @@ line,
// @@START first, @@DONE last.
func parse(t *testing.T, out string) run {
	t.Helper()
	r := run{results: map[string][]float64{}, units: map[string]string{}, fails: map[string][]string{}, info: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		text := sc.Text()
		if !strings.HasPrefix(text, "@@") {
			t.Fatalf("stdout line outside the protocol: %q\nstdout:\n%s", text, out)
		}
		f := strings.Fields(text)
		l := line{kind: strings.TrimPrefix(f[0], "@@"), fields: f[1:]}
		r.lines = append(r.lines, l)
		switch l.kind {
		case "START":
			if len(l.fields) != 1 {
				t.Fatalf("bad START line %q", text)
			}
			if us, err := strconv.ParseInt(l.fields[0], 10, 64); err != nil || us < 1_000_000_000_000_000 {
				t.Fatalf("START %q is not epoch microseconds", l.fields[0])
			}
		case "INFO":
			if len(l.fields) < 2 {
				t.Fatalf("bad INFO line %q", text)
			}
			r.info[l.fields[0]] = strings.Join(l.fields[1:], " ")
		case "RESULT":
			if len(l.fields) != 4 {
				t.Fatalf("bad RESULT line %q", text)
			}
			if _, err := strconv.Atoi(l.fields[1]); err != nil {
				t.Fatalf("RESULT rep in %q: %v", text, err)
			}
			v, err := strconv.ParseFloat(l.fields[2], 64)
			if err != nil {
				t.Fatalf("RESULT value in %q: %v", text, err)
			}
			r.results[l.fields[0]] = append(r.results[l.fields[0]], v)
			r.units[l.fields[0]] = l.fields[3]
		case "FAIL":
			if len(l.fields) < 3 {
				t.Fatalf("bad FAIL line %q", text)
			}
			r.fails[l.fields[0]] = append(r.fails[l.fields[0]], strings.Join(l.fields[2:], " "))
		case "DONE":
			if len(l.fields) != 0 {
				t.Fatalf("bad DONE line %q", text)
			}
		default:
			t.Fatalf("unknown protocol line %q", text)
		}
	}
	if len(r.lines) < 2 || r.lines[0].kind != "START" || r.lines[len(r.lines)-1].kind != "DONE" {
		t.Fatalf("protocol must run from @@START to @@DONE:\n%s", out)
	}
	for _, l := range r.lines[:len(r.lines)-1] {
		if l.kind == "DONE" {
			t.Fatalf("@@DONE before the last line:\n%s", out)
		}
	}
	return r
}

var (
	imageOnce sync.Once
	imagePath string
	imageErr  error
	imageLog  []byte
)

// benchImage builds (or finds cached) the bench image with the fixture
// script, as CI does once.
func benchImage(t *testing.T) string {
	t.Helper()
	testenv.Root(t, "RunOnHost (overlayfs mount, chroot)")
	imageOnce.Do(func() {
		cmd := exec.Command("../../test/fixtures/bench-image.sh")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		imagePath, imageErr, imageLog = strings.TrimSpace(string(out)), err, stderr.Bytes()
	})
	if imageErr != nil {
		for _, tool := range []string{"debootstrap", "npm"} {
			if _, err := exec.LookPath(tool); err != nil {
				testenv.Missing(t, "bench image cannot be built: %s is not installed (apt-get install %s): %v", tool, tool, imageErr)
			}
		}
		t.Fatalf("test/fixtures/bench-image.sh: %v\n%s", imageErr, imageLog)
	}
	return imagePath
}

// isolatedTemp points os.TempDir at a directory of the test's own, so the
// test can see whether RunOnHost left anything there.
func isolatedTemp(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir)
	return dir
}

// assertNothingLeft checks that no mount refers to dir and dir is empty.
func assertNothingLeft(t *testing.T, dir string) {
	t.Helper()
	mi, err := callerMounts()
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(mi, []byte(dir)) {
		t.Errorf("a mount under %s is left:\n%s", dir, mi)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		t.Errorf("left behind in the temp dir: %s", filepath.Join(dir, e.Name()))
	}
}

// runHost runs RunOnHost on the bench image with env and checks that it
// left nothing behind; it returns the script's stdout and stderr.
func runHost(t *testing.T, ctx context.Context, env []string) (stdout, stderr string, err error) {
	t.Helper()
	root := benchImage(t)
	tmp := isolatedTemp(t)
	var out, errOut bytes.Buffer
	err = RunOnHost(ctx, root, env, &out, &errOut)
	assertNothingLeft(t, tmp)
	t.Logf("stdout:\n%s", out.String())
	return out.String(), errOut.String(), err
}

// runHostOK is runHost for runs that must succeed, parsed.
func runHostOK(t *testing.T, env []string) run {
	t.Helper()
	stdout, stderr, err := runHost(t, context.Background(), env)
	if err != nil {
		t.Fatalf("RunOnHost: %v\nstderr:\n%s", err, stderr)
	}
	return parse(t, stdout)
}

func TestRunOnHostAllWorkloads(t *testing.T) {
	root := benchImage(t)
	before, err := os.ReadFile(filepath.Join(root, "bench", "nm", "node_modules", "lodash", "package.json"))
	if err != nil {
		t.Fatal(err)
	}
	r := runHostOK(t, smallEnv)
	// The host runs every tool of the image: a failure here is a bug in the
	// script, not a backend limitation, so each workload must have a result.
	for _, w := range allWorkloads {
		if msgs := r.fails[w]; len(msgs) > 0 {
			t.Errorf("%s failed: %v", w, msgs)
			continue
		}
		vals := r.results[w]
		if len(vals) != 1 {
			t.Errorf("%s: %d results, want 1 (BENCH_REPS=1)", w, len(vals))
			continue
		}
		if vals[0] <= 0 {
			t.Errorf("%s: result %v is not positive", w, vals[0])
		}
		want := units[w]
		if want == "" {
			want = "s"
		}
		if r.units[w] != want {
			t.Errorf("%s: unit %q, want %q", w, r.units[w], want)
		}
	}
	// A "+ sync" result is the same repetition timed to after its sync.
	for _, w := range []string{"install", "chown", "rm"} {
		if a, b := r.results[w], r.results[w+"-sync"]; len(a) == 1 && len(b) == 1 && b[0] < a[0] {
			t.Errorf("%s-sync %v s is shorter than %s %v s", w, b[0], w, a[0])
		}
	}
	for _, k := range []string{"fio_mode", "dbench_clients", "nm_entries", "page_cache_kib", "kernel"} {
		if r.info[k] == "" {
			t.Errorf("@@INFO %s missing", k)
		}
	}
	if r.info["dbench_clients"] != "2" {
		t.Errorf("dbench_clients = %q, want 2 from BENCH_DBENCH_CLIENTS", r.info["dbench_clients"])
	}
	if n, err := strconv.Atoi(r.info["nm_entries"]); err != nil || n < 1000 {
		t.Errorf("nm_entries = %q, want the node_modules tree's entry count", r.info["nm_entries"])
	}
	// The rootfs is the overlay's read-only lower layer, chown included.
	after, err := os.ReadFile(filepath.Join(root, "bench", "nm", "node_modules", "lodash", "package.json"))
	if err != nil || !bytes.Equal(before, after) {
		t.Errorf("bench rootfs changed by the run (%v)", err)
	}
	var st syscallStat
	if err := lstatOwner(filepath.Join(root, "bench", "nm", "node_modules"), &st); err != nil || st.uid != 0 {
		t.Errorf("owner of the rootfs's node_modules is %d (%v), want 0: the run must not touch the lower layer", st.uid, err)
	}
	if _, err := os.Stat(filepath.Join(root, "bench", "work")); !os.IsNotExist(err) {
		t.Errorf("the run left /bench/work in the rootfs: %v", err)
	}
}

func TestRunOnHostOnlySelected(t *testing.T) {
	// Two repetitions: rm's untimed tree and sqlite-select's table must be
	// there again in the second.
	r := runHostOK(t, append(append([]string{"BENCH_ONLY=find,sqlite-select,rm"}, smallEnv...), "BENCH_REPS=2"))
	for _, w := range allWorkloads {
		got := len(r.results[w]) + len(r.fails[w])
		switch w {
		case "find", "sqlite-select", "rm", "rm-sync":
			// Each must stand alone: rm and sqlite-select prepare what
			// install and sqlite-insert would have left.
			if len(r.results[w]) != 2 || len(r.fails[w]) != 0 {
				t.Errorf("%s: results %v fails %v, want two results", w, r.results[w], r.fails[w])
			}
		default:
			if got != 0 {
				t.Errorf("%s ran although BENCH_ONLY excludes it", w)
			}
		}
	}
	if _, ok := r.info["fio_mode"]; ok {
		t.Error("fio_mode reported although no fio workload ran")
	}
}

func TestRunOnHostBrokenToolFailsAndGoesOn(t *testing.T) {
	env := append(append([]string{}, smallEnv...), "BENCH_ONLY=dbench,find,nosuch", "BENCH_DBENCH_CLIENTS=abc")
	r := runHostOK(t, env)
	if len(r.fails["dbench"]) != 1 || len(r.results["dbench"]) != 0 {
		t.Fatalf("dbench with clients=abc: fails %v results %v, want one @@FAIL", r.fails["dbench"], r.results["dbench"])
	}
	if msg := r.fails["dbench"][0]; !strings.Contains(msg, "exited") {
		t.Errorf("dbench @@FAIL %q does not give the exit status", msg)
	}
	if len(r.results["find"]) != 1 {
		t.Errorf("find after the failed dbench: %v, want one result", r.results["find"])
	}
	if len(r.fails["nosuch"]) != 1 || !strings.Contains(r.fails["nosuch"][0], "unknown workload") {
		t.Errorf("unknown BENCH_ONLY name: %v, want an unknown workload @@FAIL", r.fails["nosuch"])
	}
}

func TestRunOnHostBadSettingStopsCleanly(t *testing.T) {
	stdout, stderr, err := runHost(t, context.Background(), []string{"BENCH_REPS=two"})
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("RunOnHost with BENCH_REPS=two: %v, want exit status 2\nstderr:\n%s", err, stderr)
	}
	r := parse(t, stdout)
	if msgs := r.fails["config"]; len(msgs) != 1 || !strings.Contains(msgs[0], "BENCH_REPS=two") {
		t.Errorf("config @@FAIL %v, want one naming BENCH_REPS=two", msgs)
	}
	if len(r.results) != 0 {
		t.Errorf("workloads ran with a bad setting: %v", r.results)
	}
}

// resultReps lists the repetition of every @@RESULT line, in output order,
// with its workload.
func resultReps(t *testing.T, r run) (reps []int, names []string) {
	t.Helper()
	for _, l := range r.lines {
		if l.kind != "RESULT" {
			continue
		}
		n, err := strconv.Atoi(l.fields[1])
		if err != nil {
			t.Fatal(err)
		}
		reps, names = append(reps, n), append(names, l.fields[0])
	}
	return reps, names
}

func TestRunOnHostRepetitionMajor(t *testing.T) {
	// A budget far above the run's length must not stop it.
	r := runHostOK(t, append(append([]string{}, smallEnv...), "BENCH_REPS=2", "BENCH_BUDGET_SECS=3600"))
	for _, w := range allWorkloads {
		if len(r.fails[w]) > 0 || len(r.results[w]) != 2 {
			t.Errorf("%s: results %v fails %v, want two results", w, r.results[w], r.fails[w])
		}
	}
	reps, names := resultReps(t, r)
	// Repetition 1 of every workload, in script order, then repetition 2 in
	// the same order.
	want := append(append([]string{}, allWorkloads...), allWorkloads...)
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("results in the order\n%v\nwant\n%v", names, want)
	}
	for i, n := range reps {
		if want := 1 + i/len(allWorkloads); n != want {
			t.Errorf("result %d (%s) is rep %d, want rep %d: %v", i, names[i], n, want, reps)
			break
		}
	}
	if r.info["reps_done"] != "2" {
		t.Errorf("reps_done = %q, want 2", r.info["reps_done"])
	}
	if f := strings.Fields(r.info["rep_seconds"]); len(f) != 2 {
		t.Errorf("rep_seconds = %q, want the two repetitions' durations", r.info["rep_seconds"])
	}
	if v, ok := r.info["budget_stop"]; ok {
		t.Errorf("budget_stop %q with a budget of an hour", v)
	}
}

func TestRunOnHostBudgetStopsAfterFirstRep(t *testing.T) {
	// dbench alone runs 2 s: far over a 1 s budget, which must still let
	// repetition 1 run in full and then stop.
	env := append(append([]string{}, smallEnv...), "BENCH_REPS=3", "BENCH_ONLY=dbench,find,sqlite-select", "BENCH_BUDGET_SECS=1")
	r := runHostOK(t, env)
	for _, w := range []string{"dbench", "find", "sqlite-select"} {
		if len(r.results[w]) != 1 || len(r.fails[w]) != 0 {
			t.Errorf("%s: results %v fails %v, want exactly repetition 1", w, r.results[w], r.fails[w])
		}
	}
	if r.info["reps_done"] != "1" {
		t.Errorf("reps_done = %q, want 1", r.info["reps_done"])
	}
	if msg := r.info["budget_stop"]; !strings.Contains(msg, "after repetition 1 of 3") || !strings.Contains(msg, "BENCH_BUDGET_SECS=1") {
		t.Errorf("budget_stop = %q, want it to say it stopped after repetition 1 of 3 for BENCH_BUDGET_SECS=1", msg)
	}
}

func TestRunOnHostNoBudgetRunsAllReps(t *testing.T) {
	for _, budget := range []string{"BENCH_BUDGET_SECS=0", "BENCH_BUDGET_SECS="} {
		t.Run(budget, func(t *testing.T) {
			env := append(append([]string{}, smallEnv...), "BENCH_REPS=3", "BENCH_ONLY=dbench,find", budget)
			r := runHostOK(t, env)
			for _, w := range []string{"dbench", "find"} {
				if len(r.results[w]) != 3 {
					t.Errorf("%s: results %v fails %v, want all 3 repetitions", w, r.results[w], r.fails[w])
				}
			}
			if r.info["reps_done"] != "3" || r.info["budget_stop"] != "" {
				t.Errorf("reps_done %q, budget_stop %q: want 3 and none", r.info["reps_done"], r.info["budget_stop"])
			}
		})
	}
}

func TestRunOnHostBadBudget(t *testing.T) {
	for _, v := range []string{"-1", "1.5", "10s", "01"} {
		t.Run(v, func(t *testing.T) {
			stdout, stderr, err := runHost(t, context.Background(), []string{"BENCH_BUDGET_SECS=" + v})
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 2 {
				t.Fatalf("RunOnHost with BENCH_BUDGET_SECS=%s: %v, want exit status 2\nstderr:\n%s", v, err, stderr)
			}
			r := parse(t, stdout)
			if msgs := r.fails["config"]; len(msgs) != 1 || !strings.Contains(msgs[0], "BENCH_BUDGET_SECS="+v) {
				t.Errorf("config @@FAIL %v, want one naming BENCH_BUDGET_SECS=%s", msgs, v)
			}
			if len(r.results) != 0 {
				t.Errorf("workloads ran with a bad budget: %v", r.results)
			}
		})
	}
}

// startWatcher signals once the script has printed @@START, i.e. the
// overlay, the binds and the chroot are all in place.
type startWatcher struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	started chan struct{}
	once    sync.Once
}

func (w *startWatcher) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if bytes.Contains(w.buf.Bytes(), []byte("@@START ")) {
		w.once.Do(func() { close(w.started) })
	}
	return len(p), nil
}

func TestRunOnHostCancelLeavesNothing(t *testing.T) {
	root := benchImage(t)
	tmp := isolatedTemp(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &startWatcher{started: make(chan struct{})}
	// dbench runs far longer than the test waits: only the cancel ends it.
	env := []string{"BENCH_ONLY=dbench", "BENCH_DBENCH_SECS=600", "BENCH_DBENCH_CLIENTS=2"}
	errc := make(chan error, 1)
	var stderr bytes.Buffer
	go func() { errc <- RunOnHost(ctx, root, env, w, &stderr) }()
	select {
	case <-w.started:
	case err := <-errc:
		t.Fatalf("RunOnHost returned before @@START: %v\n%s", err, stderr.String())
	}
	// The mounts live in RunOnHost's private namespace, not in ours.
	mi, err := callerMounts()
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(mi, []byte(tmp)) {
		t.Errorf("RunOnHost's mounts are visible in the caller's mount namespace")
	}
	cancel()
	err = <-errc
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("RunOnHost after cancel: %v, want context.Canceled", err)
	}
	assertNothingLeft(t, tmp)
}

func TestRunOnHostRejectsNonImage(t *testing.T) {
	testenv.Root(t, "RunOnHost (overlayfs mount, chroot)")
	tmp := isolatedTemp(t)
	err := RunOnHost(context.Background(), t.TempDir(), nil, &bytes.Buffer{}, &bytes.Buffer{})
	if !errors.Is(err, ErrNotBenchImage) {
		t.Fatalf("RunOnHost on an empty dir: %v, want ErrNotBenchImage", err)
	}
	err = RunOnHost(context.Background(), "/tmp/a,b", nil, &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "overlayfs") {
		t.Fatalf("RunOnHost on a path with a comma: %v, want an overlayfs option error", err)
	}
	assertNothingLeft(t, tmp)
}

type syscallStat struct{ uid uint32 }

func lstatOwner(path string, st *syscallStat) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	sys, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return errors.New("no syscall.Stat_t")
	}
	st.uid = sys.Uid
	return nil
}

// callerMounts reads the mount table of the calling thread's namespace:
// /proc/self is the thread-group leader's view, and the leader may be the
// very thread RunOnHost unshared.
func callerMounts() ([]byte, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return os.ReadFile("/proc/thread-self/mountinfo")
}
