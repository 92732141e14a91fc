package bench

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
)

func TestParseRows(t *testing.T) {
	rows, err := ParseRows("host;virtio-fs:cache=always,threads=2,virtio-9p,imagefs-blk:agent=vsock,virtio-fs")
	if err != nil {
		t.Fatal(err)
	}
	var specs []string
	for _, r := range rows {
		specs = append(specs, r.Spec)
	}
	want := "host|virtio-fs:cache=always,threads=2|virtio-9p|imagefs-blk:agent=vsock|virtio-fs"
	if got := strings.Join(specs, "|"); got != want {
		t.Fatalf("rows %s, want %s", got, want)
	}
	if r := rows[1]; r.Cache != "always" || r.Threads != 2 {
		t.Fatalf("options not parsed: %+v", r)
	}
	if rows[3].Agent != "vsock" || rows[4].Agent != "" || rows[4].Cache != "auto" {
		t.Fatalf("agent or default cache: %+v %+v", rows[3], rows[4])
	}
	for _, bad := range []struct{ in, words string }{
		{"nfs", "unknown backend"},
		{"virtio-fs:cache=sometimes", "cache=sometimes"},
		{"virtio-fs:threads=0", "threads=0"},
		{"virtio-fs:dax=x", "dax=x"},
		{"imagefs-blk:cache=auto", "does not apply"},
		{"host:agent=vsock", "does not apply"},
		{"virtio-9p;virtio-9p", "listed twice"},
		{"virtio-fs:cache", "key=value"},
		{"", "empty"},
	} {
		if _, err := ParseRows(bad.in); err == nil || !strings.Contains(err.Error(), bad.words) {
			t.Errorf("ParseRows(%q) = %v, want an error with %q", bad.in, err, bad.words)
		}
	}
	for _, s := range DefaultBackends() {
		if _, err := ParseRow(s); err != nil {
			t.Errorf("default row %q: %v", s, err)
		}
	}
}

func TestSkipReasons(t *testing.T) {
	h := HostCaps{Root: true, Virtiofsd: "/usr/lib/qemu/virtiofsd", QEMUVersion: "QEMU emulator version 7.2.22"}
	dax, _ := ParseRow("virtio-fs:cache=auto,dax=1024")
	if why := dax.SkipReason(h); !strings.Contains(why, "not supported by this QEMU") {
		t.Fatalf("DAX without cache-size: %q", why)
	}
	h.DAX = true
	if why := dax.SkipReason(h); why != "" {
		t.Fatalf("DAX with cache-size skipped: %q", why)
	}
	vs, _ := ParseRow("imagefs-blk:agent=vsock")
	if why := vs.SkipReason(h); why != "" {
		t.Fatalf("a vsock row is skipped: %q (vsock falls back to hybrid vsock as in Kata)", why)
	}
	vfs, _ := ParseRow("virtio-fs")
	if why := vfs.SkipReason(HostCaps{Root: true}); !strings.Contains(why, "virtiofsd") {
		t.Fatalf("virtio-fs without a daemon: %q", why)
	}
	if why := vfs.SkipReason(HostCaps{}); !strings.Contains(why, "root") {
		t.Fatalf("non-root: %q", why)
	}
}

func TestParseOutput(t *testing.T) {
	out := `noise
@@START 1700000000000000
@@INFO fio_mode libaio direct=1
@@RESULT chown 1 1.500000 s
@@RESULT chown 2 0.500000 s
@@RESULT chown 3 1.000000 s
@@RESULT fio-randread 1 1234 IOPS
@@FAIL dbench 1 exit status 1: dbench: command not found
@@DONE
`
	o, err := ParseOutput(out)
	if err != nil {
		t.Fatal(err)
	}
	if !o.Started || !o.Done || o.Info["fio_mode"] != "libaio direct=1" || len(o.Failures["dbench"]) != 1 {
		t.Fatalf("parsed %+v", o)
	}
	st, ok := Summarize(o.Samples["chown"])
	if !ok || st.Median != 1 || st.Min != 0.5 || st.Max != 1.5 || st.N != 3 {
		t.Fatalf("chown stats %+v", st)
	}
	for _, bad := range []string{
		"@@RESULT chown 1 x s",
		"@@RESULT chown 1 -1 s",
		"@@RESULT chown 1 NaN s",
		"@@RESULT chown 1 1 furlongs",
		"@@RESULT chown one 1 s",
		"@@RESULT chown 1 1",
		"@@RESULT chown 1 1 s\n@@RESULT chown 2 1 IOPS",
		"@@FAIL chown",
		"@@INFO",
	} {
		if _, err := ParseOutput(bad); err == nil {
			t.Errorf("ParseOutput(%q) accepted", bad)
		}
	}
}

func TestSpeedup(t *testing.T) {
	secs := Workload{Unit: "s"}
	iops := Workload{Unit: "IOPS"}
	if got := Speedup(secs, 1, 8); got != 8 {
		t.Fatalf("1 s vs 8 s = %v, want 8", got)
	}
	if got := Speedup(iops, 50, 100); got != 0.5 {
		t.Fatalf("50 vs 100 IOPS = %v", got)
	}
	if !math.IsNaN(Speedup(secs, 0, 1)) {
		t.Fatal("zero time gave a ratio")
	}
	if st, ok := Summarize([]float64{4, 1, 3, 2}); !ok || st.Median != 2.5 {
		t.Fatalf("even median %+v", st)
	}
	if _, ok := Summarize(nil); ok {
		t.Fatal("no samples summarised")
	}
}

// TestTargets checks the verdicts on a report with known numbers.
func TestTargets(t *testing.T) {
	row := func(spec, kind string, v map[string][]float64) *RowResult {
		return &RowResult{Spec: spec, Kind: kind, RepsDone: 1, Output: &Output{Samples: v, Info: map[string]string{}, Failures: map[string][]string{}}}
	}
	rep := &Report{Host: map[string]string{"accel": "tcg"}, Rows: []*RowResult{
		row("host", KindHost, map[string][]float64{"chown": {0.01}}),
		row("virtio-fs:cache=never", KindVirtioFS, map[string][]float64{"chown": {20}, "install": {30}, "stat": {4}}),
		row("virtio-fs:cache=auto", KindVirtioFS, map[string][]float64{"chown": {10}, "install": {40}, "stat": {3}}),
		row("imagefs-blk", KindImagefsBlk, map[string][]float64{"chown": {1}, "install": {5}, "stat": {1}, "fio-seqread": {90}}),
		row("virtio-blk", KindVirtioBlk, map[string][]float64{"chown": {1.2}, "fio-seqread": {100}}),
		{Spec: "virtio-fs:cache=auto,dax=1024", Kind: KindVirtioFS, Skipped: "DAX not supported by this QEMU"},
	}}
	md := Markdown(rep, Options{Baseline: "virtio-fs:cache=auto", Reps: 1, OutJSON: "x.json"}, map[string]string{})
	for _, want := range []string{
		"| chown -R node_modules ≥ 8x the best virtio-fs row | 10.0x (1.00 s vs 10.0 s on `virtio-fs:cache=auto`) | yes |",
		"| install: extract node_modules tarball ≥ 8x the best virtio-fs row | 6.0x (5.00 s vs 30.0 s on `virtio-fs:cache=never`) | **no** |",
		"| stat every entry of node_modules ≥ 2x the best virtio-fs row | 3.0x",
		"| fio 128k sequential read ≥ 0.9x raw virtio-blk | 0.90x | yes |",
		"| chown -R node_modules ≥ 0.9x raw virtio-blk | 1.20x | yes |",
		"Met 4 of 5.",
		"**skipped**: DAX not supported by this QEMU",
		"| workload | host (reference, not comparable under TCG) | virtio-fs:cache=never |",
		"No time budget",
	} {
		reportHas(t, md, want)
	}
	if strings.Contains(md, "n=") || strings.Contains(md, "Compared from fewer") {
		t.Errorf("rows that ran every repetition are marked short:\n%s", md)
	}
}

func FuzzParseOutput(f *testing.F) {
	f.Add("@@START 1\n@@RESULT a 1 2.5 s\n@@FAIL b 1 oops\n@@INFO k v w\n@@DONE\n")
	f.Add("@@RESULT a 1 1e308 MB/s\n@@RESULT a 2 0 MB/s")
	f.Add("@@\n@@RESULT\n")
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseOutput(s)
		if err != nil {
			return
		}
		for w, v := range o.Samples {
			for _, x := range v {
				if math.IsNaN(x) || math.IsInf(x, 0) || x < 0 {
					t.Fatalf("%s: accepted %v", w, x)
				}
			}
			if _, ok := Summarize(v); !ok {
				t.Fatalf("%s: samples without a summary", w)
			}
		}
	})
}

func TestStallWatch(t *testing.T) {
	d := &driver{o: Options{StallTimeout: 100 * time.Millisecond}}
	ctx, w := d.watchdog(context.Background(), true)
	w.Write([]byte("@@RESULT chown 1 1.0 s\n"))
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a silent boot was never stopped")
	}
	if why := w.reason(); !strings.Contains(why, "no progress") || !strings.Contains(why, "@@RESULT chown 1") {
		t.Fatalf("reason %q", why)
	}
	w.stop()

	// Off for the cold-start boots: no timer is armed, so nothing can fire
	// however long the boot is silent, and output does not arm one.
	ctx, w = d.watchdog(context.Background(), false)
	w.Write([]byte("@@RESULT chown 1 1.0 s\n"))
	if w.timer != nil {
		t.Fatal("disabled watchdog armed a timer")
	}
	if ctx.Err() != nil || w.reason() != "" {
		t.Fatalf("disabled watchdog fired: %v %q", ctx.Err(), w.reason())
	}
	w.stop()
	if ctx.Err() == nil {
		t.Fatal("stop did not release the boot's context")
	}
}

func TestUnfinishedAndMerge(t *testing.T) {
	d := &driver{o: Options{Reps: 2}}
	only := "dbench,chown,stat,find,rg"
	// Repetition 1 done, repetition 2 hung in stat.
	first, err := ParseOutput(`@@FAIL dbench 1 no dbench
@@RESULT chown 1 1 s
@@RESULT chown-sync 1 1.5 s
@@RESULT stat 1 2 s
@@RESULT find 1 1 s
@@RESULT rg 1 1 s
@@INFO reps_done 1
@@FAIL dbench 2 no dbench
@@RESULT chown 2 9 s
@@RESULT chown-sync 2 9.5 s
@@INFO fio_mode psync
`)
	if err != nil {
		t.Fatal(err)
	}
	rest, left := d.unfinished(first, only, "no progress for 3m", 2)
	// stat was running when the guest hung: charged with it, not retried;
	// dbench failed already; the rest run repetition 2 again.
	if strings.Join(rest, ",") != "chown,find,rg" || left != 1 {
		t.Fatalf("unfinished = %v for %d repetitions, want chown,find,rg for 1", rest, left)
	}
	if f := first.Failures["stat"]; len(f) != 1 || !strings.Contains(f[0], "rep 2: no progress") {
		t.Fatalf("hung workload not charged with rep 2: %v", first.Failures)
	}
	// chown's sample of the unfinished repetition is gone, the earlier one kept.
	if v := first.Samples["chown"]; len(v) != 1 || v[0] != 1 {
		t.Fatalf("chown samples %v, want only repetition 1's", v)
	}
	if v := first.Samples["chown-sync"]; len(v) != 1 || v[0] != 1.5 {
		t.Fatalf("chown-sync samples %v, want only repetition 1's", v)
	}
	if rest, _ := d.unfinished(first, only, "again", 2); strings.Join(rest, ",") != "chown,find,rg" || len(first.Failures["stat"]) != 1 || len(first.Failures["chown"]) != 0 {
		t.Fatalf("second call changed the verdict: %v, failures %v", rest, first.Failures)
	}
	second, _ := ParseOutput("@@RESULT chown 1 3 s\n@@RESULT chown-sync 1 3.5 s\n@@RESULT find 1 1 s\n@@RESULT rg 1 1 s\n@@INFO reps_done 1\n@@INFO fio_mode libaio\n@@DONE\n")
	m := merge(first, second)
	if len(m.Samples["stat"]) != 1 || len(m.Samples["chown"]) != 2 || len(m.Samples["find"]) != 2 || len(m.Samples["rg"]) != 2 || !m.Done {
		t.Fatalf("merged %+v", m)
	}
	if m.Info["fio_mode"] != "psync" || len(m.Failures["dbench"]) != 2 {
		t.Fatalf("merged info/failures %+v", m)
	}
	if merge(nil, second) != second || merge(first, nil) != first {
		t.Fatal("merge with nil")
	}
}

func TestUnfinishedWhere(t *testing.T) {
	d := &driver{o: Options{Reps: 3}}
	for _, c := range []struct {
		name, out, only string
		rest            string
		left            int
		charged         string
	}{
		// Nothing reported: the first selected workload is the hung one.
		{"silent", "@@START 1\n", "find,rg,rm", "rg,rm", 3, "find"},
		// Repetition 1 complete, 2 not started: the first one of 2 hung.
		{"between", "@@RESULT find 1 1 s\n@@RESULT rg 1 1 s\n@@INFO reps_done 1\n", "find,rg", "rg", 2, "find"},
		// A workload that failed in repetition 1 can still be the hung one of 2.
		{"failed before", "@@FAIL install 1 tar\n@@FAIL install-sync 1 tar\n@@RESULT rm 1 1 s\n@@INFO reps_done 1\n", "install,rm", "rm", 2, "install"},
		// Every repetition done: it hung tearing down; nothing to retry.
		{"all done", "@@RESULT find 1 1 s\n@@INFO reps_done 1\n@@RESULT find 2 1 s\n@@INFO reps_done 2\n@@RESULT find 3 1 s\n@@INFO reps_done 3\n", "find", "", 0, ""},
		// The budget ended the loop: same.
		{"budget", "@@RESULT find 1 1 s\n@@INFO reps_done 1\n@@INFO budget_stop after repetition 1\n", "find", "", 0, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			o, err := ParseOutput(c.out)
			if err != nil {
				t.Fatal(err)
			}
			rest, left := d.unfinished(o, c.only, "hung", 3)
			if strings.Join(rest, ",") != c.rest || (c.rest != "" && left != c.left) {
				t.Errorf("unfinished = %v for %d, want %q for %d", rest, left, c.rest, c.left)
			}
			for w, f := range o.Failures {
				hungMsg := strings.Contains(strings.Join(f, ";"), "hung")
				base := strings.TrimSuffix(w, "-sync")
				if hungMsg != (base == c.charged) {
					t.Errorf("%s failures %v, want the hang charged to %q only", w, f, c.charged)
				}
			}
			if c.charged != "" && len(o.Failures[c.charged]) == 0 {
				t.Errorf("%s not charged: %v", c.charged, o.Failures)
			}
		})
	}
}

func TestBudgetShare(t *testing.T) {
	m := time.Minute
	for _, c := range []struct {
		total, spent time.Duration
		rows         int
		want         time.Duration
	}{
		{28 * m, 0, 8, 210 * time.Second},
		{28 * m, 10 * m, 3, 6 * m},     // what earlier rows left is shared again
		{28 * m, 28 * m, 2, 0},         // spent: the rows get repetition 1 only
		{28 * m, 40 * m, 2, 0},         // overrun
		{28 * m, 0, 0, 0},              // nothing left to run
		{0, 0, 8, 0},                   // no budget
		{time.Hour, 20 * m, 1, 40 * m}, // the last row gets all that is left
	} {
		if got := budgetShare(c.total, c.spent, c.rows); got != c.want {
			t.Errorf("budgetShare(%s, %s, %d) = %s, want %s", c.total, c.spent, c.rows, got, c.want)
		}
	}
	s := time.Second
	for _, c := range []struct {
		share, spent time.Duration
		boots        int
		perBoot      time.Duration
		want         int
	}{
		{210 * s, 0, 2, 15 * s, 180},
		{210 * s, 20 * s, 2, 6 * s, 178},
		{210*s + 900*time.Millisecond, 0, 0, 0, 210}, // whole seconds, rounded down
		{20 * s, 0, 2, 15 * s, 1},                    // boots alone overrun the share
		{0, 0, 0, 0, 1},                              // matrix budget spent
		{0, 5 * s, 3, 15 * s, 1},
	} {
		if got := budgetSecs(c.share, c.spent, c.boots, c.perBoot); got != c.want {
			t.Errorf("budgetSecs(%s, %s, %d, %s) = %d, want %d", c.share, c.spent, c.boots, c.perBoot, got, c.want)
		}
	}
	clock := rowClock{share: 100 * s, started: time.Now()}
	if got := (&driver{o: Options{}}).scriptBudget(clock, 2, 15*s); got != 0 {
		t.Errorf("scriptBudget without --budget = %d, want 0 (none)", got)
	}
	if got := (&driver{o: Options{Budget: time.Hour}}).scriptBudget(clock, 2, 15*s); got < 69 || got > 70 {
		t.Errorf("scriptBudget of a 100 s share with 2 boots of 15 s = %d, want 70", got)
	}
	// Rows this host skips take no share.
	rows, err := ParseRows(strings.Join(DefaultBackends(), ";"))
	if err != nil {
		t.Fatal(err)
	}
	caps := HostCaps{Root: true, Virtiofsd: "/usr/libexec/virtiofsd"}
	if got := runnable(rows, caps); got != len(rows)-1 {
		t.Errorf("runnable without DAX = %d of %d, want the DAX row left out", got, len(rows))
	}
	caps.DAX = true
	if got := runnable(rows, caps); got != len(rows) {
		t.Errorf("runnable with DAX = %d of %d", got, len(rows))
	}
}

// TestBudgetFitsSlowHost plays the default matrix through the budget rules
// with the per-repetition costs measured on the 2-CPU TCG host where it took
// 65 min without a budget, and the script's stop rule (repetition 1 always,
// another only if elapsed + slowest fits): it must fit in 30 minutes and
// give every row at least one repetition.
func TestBudgetFitsSlowHost(t *testing.T) {
	s := time.Second
	perRep := []time.Duration{7 * s, 270 * s, 270 * s, 130 * s, 105 * s, 130 * s, 40 * s, 40 * s}
	const overhead = 40 * time.Second // image copy and 2 boots
	budget, reps := 28*time.Minute, 3
	var spent time.Duration
	for i, rep := range perRep {
		share := budgetShare(budget, spent, len(perRep)-i)
		boots := 2
		if i == 0 {
			boots = 0 // the host row
		}
		secs := time.Duration(budgetSecs(share, 0, boots, defaultBootCost)) * s
		n, used := 0, time.Duration(0)
		for n < reps && (n == 0 || used+rep <= secs) {
			n, used = n+1, used+rep
		}
		spent += used + overhead
		t.Logf("row %d: share %s, script budget %s, %d repetitions", i, share.Round(s), secs, n)
	}
	t.Logf("matrix: %s", spent.Round(s))
	if spent > 30*time.Minute {
		t.Errorf("the default matrix takes %s with the budget, want under 30 min", spent.Round(s))
	}
}

func TestReportMarksShortRows(t *testing.T) {
	row := func(spec, kind string, done int, stop string, v map[string][]float64, cs ...float64) *RowResult {
		return &RowResult{Spec: spec, Kind: kind, RepsDone: done, BudgetStop: stop, ColdStart: cs,
			Output: &Output{Samples: v, Info: map[string]string{}, Failures: map[string][]string{}}}
	}
	stop := "after repetition 1 of 3: 300 s elapsed + 270 s for the longest repetition > BENCH_BUDGET_SECS=180"
	rep := &Report{Host: map[string]string{"accel": "kvm"}, Rows: []*RowResult{
		row("host", KindHost, 3, "", map[string][]float64{"chown": {0.5, 0.4, 0.6}}),
		row("virtio-9p", KindVirtio9P, 1, stop, map[string][]float64{"chown": {22}, "install": {121}}, 5),
		row("virtio-fs:cache=auto", KindVirtioFS, 3, "", map[string][]float64{"chown": {10, 11, 12}, "install": {50, 52, 51}, "stat": {9, 10, 11}}, 5, 6),
		row("imagefs-blk", KindImagefsBlk, 1, stop, map[string][]float64{"chown": {1}, "install": {5}, "stat": {3}}, 4, 5),
		// Short for another reason than the budget (a failed row).
		row("virtio-blk", KindVirtioBlk, 2, "", map[string][]float64{"chown": {1.1, 1.3}, "install": {6, 7}}, 6, 7),
	}}
	o := Options{Baseline: "virtio-fs:cache=auto", Reps: 3, StartReps: 2, Budget: 28 * time.Minute, OutJSON: "x.json"}
	md := Markdown(rep, o, map[string]string{})
	for _, want := range []string{
		"up to 3 repetitions each, within the time budget below",
		"Time budget: 28 min for the matrix (`--budget`), shared out as each row starts: what is left of it divided by the rows still to run, less, for a VM row, its 2 boots (15 s each,",
		"Rows that stopped before 3 repetitions because of it (marked n=… in the tables): `virtio-9p` (n=1), `imagefs-blk` (n=1).",
		"| workload | host | virtio-9p (n=1, budget) | virtio-fs:cache=auto | imagefs-blk (n=1, budget) | virtio-blk (n=2) |",
		"- `virtio-9p`: QEMU's 9p server (virtio-9p-pci, cache=mmap) on a copy of the image — ran 1 of 3 repetitions (time budget)",
		"- `virtio-blk`: the same image exported raw, behind QEMU's own virtio-blk-pci with cache=none (the ceiling) — ran 2 of 3 repetitions\n",
		// One sample is a value, not a range of one.
		"| chown -R node_modules | 0.500 (0.400–0.600) | 22.0 | 11.0 (10.0–12.0) | 1.00 | 1.20 (1.10–1.30) |",
		"| `virtio-9p` | 5.00 |",
		"| `virtio-fs:cache=auto` | 5.50 (5.00–6.00) |",
		// The ratio table and the targets work on n=1 medians, and say so.
		"| virtio-9p (n=1, budget) | virtio-fs:cache=auto | imagefs-blk (n=1, budget) | virtio-blk (n=2) |",
		"| chown -R node_modules ≥ 8x the best virtio-fs row | 11.0x (1.00 s vs 11.0 s on `virtio-fs:cache=auto`) | yes |",
		"| stat every entry of node_modules ≥ 2x the best virtio-fs row | 3.3x",
		"| chown -R node_modules ≥ 0.9x raw virtio-blk | 1.20x | yes |",
		"Met 6 of 6. Compared from fewer than 3 repetitions: `imagefs-blk` (n=1, budget), `virtio-blk` (n=2).",
	} {
		reportHas(t, md, want)
	}
	for _, bad := range []string{"22.0 (22.0–22.0)", "5.00 (5.00–5.00)", "host (n=", "virtio-fs:cache=auto (n="} {
		if strings.Contains(md, bad) {
			t.Errorf("report has %q:\n%s", bad, md)
		}
	}

	// No row stopped: the budget line says so.
	for _, r := range rep.Rows {
		r.RepsDone, r.BudgetStop = 3, ""
	}
	if md := Markdown(rep, o, map[string]string{}); !strings.Contains(md, "No row stopped early because of it.") || strings.Contains(md, "(n=") {
		t.Errorf("report of full rows:\n%s", md)
	}
	js, err := json.Marshal(rep.Rows[1])
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"reps_done":3`) {
		t.Errorf("row JSON lacks reps_done: %s", js)
	}
}

func TestMainRejectsNegativeBudget(t *testing.T) {
	var stderr strings.Builder
	if rc := Main(context.Background(), []string{"--image", t.TempDir(), "--budget", "-1m"}, io.Discard, &stderr, ""); rc != 2 || !strings.Contains(stderr.String(), "--budget") {
		t.Fatalf("--budget -1m: exit %d, stderr %q; want 2 and a --budget message", rc, stderr.String())
	}
}

// reportHas fails t when the report md lacks want.
func reportHas(t *testing.T, md, want string) {
	t.Helper()
	if !strings.Contains(md, want) {
		t.Errorf("report lacks %q:\n%s", want, md)
	}
}

// TestRowConfigSetsTheAgentTransport: a row's agent= reaches the
// configuration the row's pod loads, and a row without it keeps the base's.
func TestRowConfigSetsTheAgentTransport(t *testing.T) {
	dir := t.TempDir()
	basePath := filepath.Join(dir, "base.toml")
	if err := os.WriteFile(basePath, []byte("[hypervisor.qemu]\npath = \"/usr/bin/qemu-system-x86_64\"\n[kata_fsx]\nagent_transport = \"virtio-serial\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := &driver{base: &config.Config{Path: basePath}, accel: "tcg", aio: "threads", o: Options{VCPUs: 1, MemoryMiB: 512}}
	for _, tc := range []struct{ row, want string }{{"imagefs-blk:agent=hybrid-vsock", "hybrid-vsock"}, {"imagefs-blk", "virtio-serial"}} {
		r, err := ParseRow(tc.row)
		if err != nil {
			t.Fatal(err)
		}
		path, err := d.rowConfig(filepath.Join(dir, strings.ReplaceAll(tc.row, ":", "_")), r)
		if err != nil {
			t.Fatal(err)
		}
		c, err := config.Load(path, "")
		if err != nil {
			t.Fatal(err)
		}
		if c.KataFSX.AgentTransport != tc.want {
			t.Errorf("row %s: agent_transport %q, want %q", tc.row, c.KataFSX.AgentTransport, tc.want)
		}
	}
}
