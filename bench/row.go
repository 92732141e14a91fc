package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/bench/workload"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// RowResult is everything measured for one row.
type RowResult struct {
	Spec    string  `json:"backend"`
	Kind    string  `json:"kind"`
	Skipped string  `json:"skipped,omitempty"`
	Error   string  `json:"error,omitempty"`
	Output  *Output `json:"output,omitempty"`
	// RepsDone is how many whole repetitions of the workloads the row ran;
	// BudgetStop the script's reason when the time budget stopped it
	// before --reps.
	RepsDone   int    `json:"reps_done"`
	BudgetStop string `json:"budget_stop,omitempty"`
	// ShareSecs is the row's part of the matrix budget, BudgetSecs what of
	// it the workload script got (BENCH_BUDGET_SECS); 0 without a budget.
	ShareSecs  float64 `json:"budget_share_s,omitempty"`
	BudgetSecs int     `json:"budget_s,omitempty"`
	// ColdStart are the run-to-process-started times of every boot.
	ColdStart []float64 `json:"coldstart_seconds,omitempty"`
	// Serving is the host process that reads the rootfs for the guest
	// (qemu, virtiofsd or kata-fsx), with its counters.
	Serving        string `json:"serving_process,omitempty"`
	StartRChar     uint64 `json:"bytes_read_before_start_rchar"`
	StartReadBytes uint64 `json:"bytes_read_before_start_read_bytes"`
	ServingHWMKiB  uint64 `json:"serving_peak_rss_kib"`
	ServingAnonKiB uint64 `json:"serving_anon_rss_kib"`
	QEMUHWMKiB     uint64 `json:"qemu_peak_rss_kib"`
	// Stats is the raw --stats-file of the workload boot.
	Stats   json.RawMessage `json:"run_stats,omitempty"`
	Seconds float64         `json:"wall_seconds"`
}

// coldStart is the time from `run` to the process's first output, the
// first moment it provably runs; the agent's start report when it printed nothing.
func coldStart(st *sandbox.RunStats) float64 {
	if st.FirstOutputSeconds > 0 {
		return st.FirstOutputSeconds
	}
	return st.StartSeconds
}

func serving(ps []sandbox.ProcessSample) (sandbox.ProcessSample, bool) {
	for _, p := range ps {
		if p.ServesRootfs {
			return p, true
		}
	}
	return sandbox.ProcessSample{}, false
}

func role(ps []sandbox.ProcessSample, name string) (sandbox.ProcessSample, bool) {
	for _, p := range ps {
		if p.Role == name {
			return p, true
		}
	}
	return sandbox.ProcessSample{}, false
}

// scriptEnv is the workload script's configuration for a run of reps
// repetitions within budget seconds (0 = no budget).
func (d *driver) scriptEnv(reps, budget int) []string {
	return []string{
		"BENCH_WORK=/bench/work",
		fmt.Sprintf("BENCH_REPS=%d", reps),
		fmt.Sprintf("BENCH_BUDGET_SECS=%d", budget),
		fmt.Sprintf("BENCH_FIO_MB=%d", d.o.FioMB),
		fmt.Sprintf("BENCH_FIO_SECS=%d", d.o.FioSecs),
		fmt.Sprintf("BENCH_DBENCH_SECS=%d", d.o.DbenchSecs),
		fmt.Sprintf("BENCH_SQLITE_ROWS=%d", d.o.SqliteRows),
		"LC_ALL=C",
	}
}

// runRow measures one row within share of the matrix budget; failures end
// up in the result, never abort the matrix.
func (d *driver) runRow(ctx context.Context, n int, r Row, share time.Duration) *RowResult {
	res := &RowResult{Spec: r.Spec, Kind: r.Kind}
	if why := r.SkipReason(d.caps); why != "" {
		res.Skipped = why
		d.logf("%s: skipped: %s", r.Spec, why)
		return res
	}
	started := time.Now()
	clock := rowClock{share: share, started: started}
	if d.o.Budget > 0 {
		res.ShareSecs = share.Seconds()
		d.logf("%s: budget share %s", r.Spec, share.Round(time.Second))
	}
	defer func() {
		res.Seconds = time.Since(started).Seconds()
		if res.Output != nil {
			res.BudgetStop = res.Output.Info["budget_stop"]
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, d.o.RowTimeout)
	defer cancel()
	dir := filepath.Join(d.tmp, fmt.Sprintf("row%d", n))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		res.Error = err.Error()
		return res
	}
	defer func() {
		if err := os.RemoveAll(dir); err != nil {
			res.Error = strings.TrimSpace(res.Error + "; cleanup: " + err.Error())
		}
	}()
	var err error
	if r.Kind == KindHost {
		err = d.runHost(ctx, dir, clock, res)
	} else {
		err = d.runVM(ctx, dir, n, r, clock, res)
	}
	if err != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			err = fmt.Errorf("%w (row timeout %s)", err, d.o.RowTimeout)
		}
		res.Error = err.Error()
		d.logf("%s: failed: %s", r.Spec, truncate(res.Error, 600))
	}
	if res.Output != nil {
		for w, f := range res.Output.Failures {
			d.logf("%s: workload %s failed: %s", r.Spec, w, truncate(strings.Join(f, "; "), 300))
		}
	}
	d.logf("%s: done in %.0f s", r.Spec, time.Since(started).Seconds())
	return res
}

func (d *driver) runHost(ctx context.Context, dir string, clock rowClock, res *RowResult) error {
	d.logf("%s: running the workloads on the host (chroot on an overlay of the image)", res.Spec)
	logf, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	var out bytes.Buffer
	res.BudgetSecs = d.scriptBudget(clock, 0, 0)
	runErr := workload.RunOnHost(ctx, d.o.Image, append(d.scriptEnv(d.o.Reps, res.BudgetSecs), "BENCH_ONLY="+d.o.Only), io.MultiWriter(&out, d.progress(res.Spec)), logf)
	err = d.finishOutput(res, out.String(), runErr, filepath.Join(dir, "stderr.log"))
	if res.Output != nil {
		res.RepsDone = res.Output.repsDone()
	}
	return err
}

func (d *driver) finishOutput(res *RowResult, out string, runErr error, stderrLog string) error {
	o, perr := ParseOutput(out)
	if perr != nil {
		return errors.Join(runErr, perr)
	}
	res.Output = o
	if runErr != nil {
		return fmt.Errorf("%w%s", runErr, tailOf(stderrLog, 1500))
	}
	if !o.Done {
		return fmt.Errorf("workload script did not finish (no @@DONE)%s", tailOf(stderrLog, 1500))
	}
	return nil
}

// runVM boots the row's pod through `kata-fsx run` (the shim's sandbox
// code), runs the workload script as its container process, then boots
// it again with /bin/echo for the remaining cold-start samples. The
// script's budget leaves room for those boots: --start-reps of them from
// the workload boot on, each costing the slowest cold start seen in the
// row so far, or defaultBootCost before there is one.
func (d *driver) runVM(ctx context.Context, dir string, n int, r Row, clock rowClock, res *RowResult) error {
	cfg, err := d.rowConfig(dir, r)
	if err != nil {
		return err
	}
	backend := r.Kind
	// The guest writes into its rootfs: every row gets a pristine one.
	rootfs, err := d.rowRootfs(ctx, dir, r)
	if err != nil {
		return err
	}
	only, reps := d.o.Only, d.o.Reps
	retried := false
	var slowest time.Duration // of the row's boots so far
	for boot := 0; boot < max(1, d.o.StartReps); boot++ {
		cmd := []string{"/bin/echo", "started"}
		what := "cold start"
		if boot == 0 {
			perBoot := defaultBootCost
			if slowest > 0 {
				perBoot = slowest
			}
			budget := d.scriptBudget(clock, max(1, d.o.StartReps), perBoot)
			if !retried {
				res.BudgetSecs = budget
			}
			env := append(d.scriptEnv(reps, budget), "BENCH_ONLY="+only)
			cmd = append(append([]string{"/usr/bin/env"}, env...), "/bin/bash", "-c", workload.Script, "workloads.sh")
			what = "workloads"
			if d.o.Budget > 0 {
				what = fmt.Sprintf("workloads, up to %d repetitions within %d s", reps, budget)
			}
		}
		d.logf("%s: boot %d (%s)", r.Spec, boot+1, what)
		statsPath := filepath.Join(dir, fmt.Sprintf("stats%d.json", boot))
		stderrLog := filepath.Join(dir, fmt.Sprintf("run%d.log", boot))
		args := []string{"run", "--config", cfg, "--backend", backend, "--rootfs", rootfs, "--stats-file", statsPath,
			"--id", fmt.Sprintf("bench-%d-%d", n, boot), "--"}
		var out bytes.Buffer
		bootCtx, stalled := d.watchdog(ctx, boot == 0)
		runErr := d.kataFSX(bootCtx, append(args, cmd...), io.MultiWriter(&out, d.progress(r.Spec), stalled), stderrLog)
		why := stalled.reason()
		if why != "" {
			runErr = fmt.Errorf("%s: %w", why, runErr)
		}
		stalled.stop()
		st, raw, serr := readStats(statsPath)
		if serr == nil {
			slowest = max(slowest, time.Duration(coldStart(st)*float64(time.Second)))
		}
		if boot == 0 {
			if serr == nil && !retried {
				res.Stats = raw
				d.recordStats(res, st)
			}
			prev := res.Output
			res.Output = nil
			err := d.finishOutput(res, out.String(), runErr, stderrLog)
			if res.Output != nil {
				// A retry's repetitions continue the hung boot's.
				res.RepsDone += res.Output.repsDone()
			}
			res.Output = merge(prev, res.Output)
			if why != "" && !retried && res.Output != nil && ctx.Err() == nil {
				// One more boot for what the hung one did not finish.
				if rest, left := d.unfinished(res.Output, only, why, reps); len(rest) > 0 {
					d.logf("%s: %s; retrying %s for %d repetitions in a new boot", r.Spec, why, strings.Join(rest, ","), left)
					res.Output.Info["retried"] = fmt.Sprintf("%s; a second boot ran %s for up to %d repetitions", why, strings.Join(rest, ","), left)
					if strings.HasPrefix(rootfs, "/") {
						if err := os.RemoveAll(filepath.Join(rootfs, "bench", "work")); err != nil {
							return err
						}
					}
					only, reps, retried = strings.Join(rest, ","), left, true
					boot--
					continue
				}
			}
			if err != nil {
				return err
			}
		} else if runErr != nil {
			return fmt.Errorf("cold-start boot %d: %w%s", boot+1, runErr, tailOf(stderrLog, 1500))
		}
		if serr != nil {
			return serr
		}
		res.ColdStart = append(res.ColdStart, coldStart(st))
	}
	return nil
}

func (d *driver) recordStats(res *RowResult, st *sandbox.RunStats) {
	at := st.AtFirstOutput
	if len(at) == 0 {
		at = st.AtStart
	}
	if s, ok := serving(at); ok {
		res.Serving = s.Role
		if r, ok := serving(st.AtReady); ok {
			res.StartRChar = s.RChar - min(s.RChar, r.RChar)
			res.StartReadBytes = s.ReadBytes - min(s.ReadBytes, r.ReadBytes)
		}
	}
	if s, ok := serving(st.AtEnd); ok {
		res.ServingHWMKiB, res.ServingAnonKiB = s.HWMKiB, s.AnonKiB
	}
	if q, ok := role(st.AtEnd, "qemu"); ok {
		res.QEMUHWMKiB = q.HWMKiB
	}
}

func readStats(path string) (*sandbox.RunStats, json.RawMessage, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("run stats: %w", err)
	}
	var st sandbox.RunStats
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, nil, fmt.Errorf("run stats %s: %w", path, err)
	}
	return &st, json.RawMessage(b), nil
}

// kataFSX runs this binary's own command line (the same code path users
// and the shim take), with stderr kept in a log file.
func (d *driver) kataFSX(ctx context.Context, args []string, stdout io.Writer, stderrLog string) error {
	logf, err := os.Create(stderrLog)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.CommandContext(ctx, d.o.KataFSX, args...)
	cmd.Stdout, cmd.Stderr = stdout, logf
	// run tears its pod down on SIGTERM; give it the time to.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("kata-fsx %s: %w", strings.Join(args[:min(len(args), 8)], " "), err)
	}
	return nil
}

// exportRaw builds the bench image with kata-fsx and writes it out as a
// raw ext4 file: what a runtime without imagefs-blk would keep per pod.
func (d *driver) exportRaw(ctx context.Context, dir, raw string) error {
	img := filepath.Join(dir, "image")
	cache := filepath.Join(dir, "image-cache")
	d.logf("virtio-blk: building and exporting the raw image")
	for _, args := range [][]string{
		{"image", "build", "--cache", cache, "dir:" + d.o.Image, "-o", img},
		{"image", "export", "--cache", cache, "--raw", raw, img},
	} {
		if err := d.kataFSX(ctx, args, io.Discard, filepath.Join(dir, "image.log")); err != nil {
			return fmt.Errorf("raw image: %w%s", err, tailOf(filepath.Join(dir, "image.log"), 800))
		}
	}
	return os.RemoveAll(img)
}

// rowConfig writes the row's configuration: the base file and its
// drop-ins, plus one drop-in with the row's settings and private state
// directories.
func (d *driver) rowConfig(dir string, r Row) (string, error) {
	cdir := filepath.Join(dir, "config")
	drop := filepath.Join(cdir, "config.d")
	if err := os.MkdirAll(drop, 0o755); err != nil {
		return "", err
	}
	b, err := os.ReadFile(d.base.Path)
	if err != nil {
		return "", err
	}
	path := filepath.Join(cdir, "configuration.toml")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return "", err
	}
	for _, p := range d.base.DropIns {
		b, err := os.ReadFile(p)
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(drop, filepath.Base(p)), b, 0o644); err != nil {
			return "", err
		}
	}
	var t strings.Builder
	fmt.Fprintf(&t, "# kata-fsx bench row %q\n[hypervisor.qemu]\ndefault_vcpus = %d\ndefault_memory = %d\n", r.Spec, d.o.VCPUs, d.o.MemoryMiB)
	fmt.Fprintf(&t, "block_device_cache_direct = true\nblock_device_aio = %q\n", d.aio)
	if r.Kind == KindVirtioFS {
		fmt.Fprintf(&t, "virtio_fs_cache = %q\nvirtio_fs_cache_size = %d\n", r.Cache, r.DAXMiB)
		threads := r.Threads
		if threads == 0 {
			threads = 1 // Kata's default extra args
		}
		fmt.Fprintf(&t, "virtio_fs_extra_args = [\"--thread-pool-size=%d\"]\n", threads)
	}
	fmt.Fprintf(&t, "[kata_fsx]\naccelerator = %q\nstate_dir = %q\n", d.accel, filepath.Join(dir, "run"))
	if r.Agent != "" {
		fmt.Fprintf(&t, "agent_transport = %q\n", r.Agent)
	}
	fmt.Fprintf(&t, "[kata_fsx.imagefs_blk]\nstate_dir = %q\n", filepath.Join(dir, "blk"))
	// zz sorts after the base's drop-ins, so the row's settings win.
	if err := os.WriteFile(filepath.Join(drop, "zz-bench.toml"), []byte(t.String()), 0o644); err != nil {
		return "", err
	}
	return path, nil
}

func tailOf(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return "\n" + string(b)
}

// stallWatch cancels a boot whose script has printed no protocol line for
// the stall limit: a guest stuck on a lost request would otherwise hold the
// row until its timeout.
type stallWatch struct {
	// mu guards the fields below, a leaf lock: the timer's callback
	// cancels the boot after releasing it.
	mu     sync.Mutex
	timer  *time.Timer
	limit  time.Duration
	last   string
	why    string
	cancel context.CancelFunc
}

func (d *driver) watchdog(ctx context.Context, on bool) (context.Context, *stallWatch) {
	ctx, cancel := context.WithCancel(ctx)
	w := &stallWatch{limit: d.o.StallTimeout, cancel: cancel, last: "before the script's first line"}
	if on && w.limit > 0 {
		w.timer = time.AfterFunc(w.limit, func() {
			w.mu.Lock()
			w.why = fmt.Sprintf("no progress for %s (last: %s): the guest looks hung; boot stopped", w.limit, w.last)
			w.mu.Unlock()
			cancel()
		})
	}
	return ctx, w
}

func (w *stallWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.timer != nil && w.why == "" {
		w.timer.Reset(w.limit)
	}
	if i := bytes.LastIndex(p, []byte("@@")); i >= 0 {
		line, _, _ := bytes.Cut(p[i:], []byte("\n"))
		w.last = truncate(string(line), 120)
	}
	return len(p), nil
}

func (w *stallWatch) reason() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.why
}

func (w *stallWatch) stop() {
	if w.timer != nil {
		w.timer.Stop()
	}
	w.cancel()
}

// scriptOrder is the order the workload script runs its workloads in, in
// every repetition.
var scriptOrder = []string{"fio-seqread", "fio-seqwrite", "fio-randread", "fio-randwrite", "dbench",
	"install", "chown", "stat", "find", "rg", "rm", "sqlite-insert", "sqlite-select"}

// syncedName is the name of the "+ sync" result a writing workload reports
// beside its own (the script's timed and synced_from).
func syncedName(w string) (string, bool) {
	switch w {
	case "install", "chown", "rm":
		return w + "-sync", true
	}
	return "", false
}

// selected says whether the workload list only (empty = all) has w.
func selected(only, w string) bool {
	return only == "" || strings.Contains(","+only+",", ","+w+",")
}

// unfinished says, after a boot that hung, which selected workloads a retry
// boot runs and for how many repetitions. The script runs repetition-major,
// so the boot hung in the repetition after the last one it reported done,
// in the first selected workload with no line for that repetition: that one
// is charged as failed with why, so the retry does not hang on it again.
// The others, less those that already failed (they would again), lose their
// samples of the unfinished repetition and run again from it on. A boot that
// finished its repetitions (it hung tearing down) has nothing left to run.
func (d *driver) unfinished(o *Output, only, why string, reps int) ([]string, int) {
	done := o.repsDone()
	if done >= reps || o.Info["budget_stop"] != "" {
		return nil, 0
	}
	k := done + 1
	if o.hung == "" {
		for _, w := range scriptOrder {
			if selected(only, w) && o.tried[w] < k {
				o.hung = w
				break
			}
		}
		if o.hung == "" {
			// Every workload reported repetition k, yet k was not done: it
			// hung in an untimed step nobody can be charged with.
			return nil, 0
		}
		msg := fmt.Sprintf("rep %d: %s", k, why)
		o.Failures[o.hung] = append(o.Failures[o.hung], msg)
		if synced, ok := syncedName(o.hung); ok {
			o.Failures[synced] = append(o.Failures[synced], msg)
		}
	}
	var rest []string
	for _, w := range scriptOrder {
		if !selected(only, w) || w == o.hung || len(o.Failures[w]) > 0 {
			continue
		}
		o.dropRep(w, k)
		if synced, ok := syncedName(w); ok {
			o.dropRep(synced, k)
		}
		rest = append(rest, w)
	}
	return rest, reps - done
}

// merge adds b's results to a's (a second boot of the same row).
func merge(a, b *Output) *Output {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	for k, v := range b.Samples {
		a.Samples[k] = append(a.Samples[k], v...)
	}
	for k, v := range b.Failures {
		a.Failures[k] = append(a.Failures[k], v...)
	}
	for k, v := range b.Units {
		a.Units[k] = v
	}
	for k, v := range b.Info {
		if _, ok := a.Info[k]; !ok {
			a.Info[k] = v
		}
	}
	a.Done = b.Done
	return a
}
