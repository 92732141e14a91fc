package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/bench/chart"
)

// sectionName owns the suite's part of the Markdown file.
const sectionName = "bench-suite"

// chartFiles maps each group to its PNG's base name.
var chartFiles = map[string]string{
	GroupTree:  "suite-tree.png",
	GroupApps:  "suite-apps.png",
	GroupBytes: "suite-throughput.png",
	GroupIOPS:  "suite-iops.png",
}

const ratioChart = "suite-ratio.png"

func writeReport(rep *Report, o Options, stdout io.Writer) error {
	if err := os.MkdirAll(filepath.Dir(o.OutJSON), 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(o.OutJSON, append(js, '\n'), 0o644); err != nil {
		return err
	}
	charts, err := writeCharts(rep, o)
	if err != nil {
		return err
	}
	md := Markdown(rep, o, charts)
	if err := ReplaceSection(o.OutMD, sectionName, md); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	return nil
}

// ReplaceSection rewrites the text between <!-- NAME:start --> and
// <!-- NAME:end --> in path, so a run updates only its own part. A file
// without the section gets it appended, and a missing file is created:
// results that took half an hour to measure are never lost to a file
// that was not prepared.
func ReplaceSection(path, name, body string) error {
	start, end := "<!-- "+name+":start -->", "<!-- "+name+":end -->"
	old, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		old, err = []byte("# kata-fsx benchmarks\n"), nil
	}
	if err != nil {
		return err
	}
	s := string(old)
	i, j := strings.Index(s, start), strings.Index(s, end)
	if i < 0 || j < i {
		s = strings.TrimRight(s, "\n") + "\n\n" + start + "\n" + body + end + "\n"
	} else {
		s = s[:i+len(start)] + "\n" + body + s[j:]
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(s), 0o644)
}

// value is the median of a workload on a row, ok false when there is none.
func value(r *RowResult, w Workload) (Stats, bool) {
	if w.Name == "coldstart" {
		return Summarize(r.ColdStart)
	}
	if r.Output == nil {
		return Stats{}, false
	}
	return Summarize(r.Output.Samples[w.Name])
}

// measured are the rows that produced numbers.
func measured(rep *Report) []*RowResult {
	var out []*RowResult
	for _, r := range rep.Rows {
		if r.Skipped == "" && r.Output != nil {
			out = append(out, r)
		}
	}
	return out
}

func find(rep *Report, spec string) *RowResult {
	for _, r := range rep.Rows {
		if r.Spec == spec && r.Skipped == "" && r.Output != nil {
			return r
		}
	}
	return nil
}

func fmtValue(v float64, unit string) string {
	switch {
	case unit == "IOPS" || unit == "ops/s":
		return fmt.Sprintf("%.0f", v)
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	case v >= 1:
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.3f", v)
}

func groups() []string { return []string{GroupTree, GroupApps, GroupBytes, GroupIOPS} }

func writeCharts(rep *Report, o Options) (map[string]string, error) {
	if err := os.MkdirAll(o.ChartDir, 0o755); err != nil {
		return nil, err
	}
	out := map[string]string{}
	rows := vmRows(rep)
	if len(rows) == 0 {
		return out, nil
	}
	for _, g := range groups() {
		c := &chart.Chart{Title: g, Unit: unitOf(g)}
		for _, w := range Workloads() {
			if w.Group == g {
				c.Categories = append(c.Categories, w.Label)
			}
		}
		for _, r := range rows {
			s := chart.Series{Name: r.Spec}
			for _, w := range Workloads() {
				if w.Group != g {
					continue
				}
				v := math.NaN()
				if st, ok := value(r, w); ok {
					v = st.Median
				}
				s.Values = append(s.Values, v)
			}
			c.Series = append(c.Series, s)
		}
		if err := renderChart(c, filepath.Join(o.ChartDir, chartFiles[g])); err != nil {
			// A group with no numbers at all (every row failed it) has no chart.
			continue
		}
		out[g] = link(o, chartFiles[g])
	}
	if base := find(rep, o.Baseline); base != nil {
		c := &chart.Chart{Title: "Speed relative to " + o.Baseline + " (above 1 = faster)", Unit: "times the baseline's speed"}
		ws := Workloads()
		for _, w := range ws {
			c.Categories = append(c.Categories, w.Label)
		}
		for _, r := range rows {
			if r == base {
				continue
			}
			s := chart.Series{Name: r.Spec}
			for _, w := range ws {
				v := math.NaN()
				a, ok1 := value(r, w)
				b, ok2 := value(base, w)
				if ok1 && ok2 {
					v = Speedup(w, a.Median, b.Median)
				}
				s.Values = append(s.Values, v)
			}
			c.Series = append(c.Series, s)
		}
		if err := renderChart(c, filepath.Join(o.ChartDir, ratioChart)); err == nil {
			out["ratio"] = link(o, ratioChart)
		}
	}
	return out, nil
}

// link is the chart's path as the Markdown file refers to it.
func link(o Options, name string) string {
	p := filepath.Join(o.ChartDir, name)
	if rel, err := filepath.Rel(filepath.Dir(o.OutMD), p); err == nil {
		p = rel
	}
	return filepath.ToSlash(p)
}

// vmRows are the measured rows that ran in a VM: the host row is left out
// of the charts, where its scale would flatten every other bar.
func vmRows(rep *Report) []*RowResult {
	var out []*RowResult
	for _, r := range measured(rep) {
		if r.Kind != KindHost {
			out = append(out, r)
		}
	}
	return out
}

func unitOf(g string) string {
	switch g {
	case GroupBytes:
		return "MB/s (higher is better)"
	case GroupIOPS:
		return "IOPS (higher is better)"
	}
	return "seconds (lower is better)"
}

func renderChart(c *chart.Chart, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := c.Render(f); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	return f.Close()
}

// Markdown renders the report section.
func Markdown(rep *Report, o Options, charts map[string]string) string {
	var b strings.Builder
	h := rep.Host
	fmt.Fprintf(&b, "Run %s, `%s`, wall clock %.1f min.\n\n", rep.Date, rep.Command, rep.Seconds/60)
	fmt.Fprintf(&b, "Host: %s, %s CPUs, load average %s at the start and %s at the end; accelerator **%s**", h["cpu"], h["cpus"], h["loadavg_start"], h["loadavg_end"], h["accel"])
	if h["accel"] == "tcg" {
		b.WriteString(" (the guests are emulated: every VM row runs 10–50x slower than on KVM, and the **host row is a reference only, not comparable** with them)")
	}
	reps := fmt.Sprintf("%d repetitions each", o.Reps)
	if o.Budget > 0 {
		reps = fmt.Sprintf("up to %d repetitions each, within the time budget below", o.Reps)
	}
	fmt.Fprintf(&b, "; %s; host kernel %s; virtiofsd %s; raw virtio-blk aio %s. Guests: %d vCPU, %d MiB. "+
		"Workloads: %s (median, min–max in brackets; a single sample has no range), fio file %d MiB and %d s per job, dbench %d s, sqlite %d rows; cold start from %d boots per row.\n\n",
		h["qemu"], h["kernel"], h["virtiofsd"], h["block_device_aio"], o.VCPUs, o.MemoryMiB, reps, o.FioMB, o.FioSecs, o.DbenchSecs, o.SqliteRows, o.StartReps)
	budgetNote(&b, rep, o)
	b.WriteString("Rows:\n\n")
	for _, r := range rep.Rows {
		fmt.Fprintf(&b, "- `%s`: %s", r.Spec, describe(r))
		switch {
		case r.Skipped != "":
			fmt.Fprintf(&b, " — **skipped**: %s", r.Skipped)
		case r.Error != "":
			fmt.Fprintf(&b, " — **failed**: %s", oneLine(r.Error, 500))
		}
		if r.Output != nil && r.RepsDone < o.Reps {
			fmt.Fprintf(&b, " — ran %d of %d repetitions", r.RepsDone, o.Reps)
			if r.BudgetStop != "" {
				b.WriteString(" (time budget)")
			}
		}
		if r.Output != nil && r.Output.Info["fio_mode"] != "" {
			fmt.Fprintf(&b, " (fio: %s)", r.Output.Info["fio_mode"])
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
	rows := measured(rep)
	for _, g := range groups() {
		fmt.Fprintf(&b, "#### %s\n\n| workload |", g)
		for _, r := range rows {
			fmt.Fprintf(&b, " %s |", header(r, h, o))
		}
		b.WriteString("\n|---|" + strings.Repeat("---:|", len(rows)) + "\n")
		for _, w := range Workloads() {
			if w.Group != g {
				continue
			}
			fmt.Fprintf(&b, "| %s |", w.Label)
			for _, r := range rows {
				b.WriteString(" " + cell(r, w) + " |")
			}
			b.WriteString("\n")
		}
		if f, ok := charts[g]; ok {
			fmt.Fprintf(&b, "\n![%s](%s)\n", g, f)
		}
		b.WriteString("\n")
	}
	ratioTable(&b, rep, o, charts)
	targets(&b, rep, o)
	resources(&b, rep)
	var failed []string
	for _, r := range rows {
		for _, w := range Workloads() {
			if f := r.Output.Failures[w.Name]; len(f) > 0 {
				failed = append(failed, fmt.Sprintf("- `%s` %s: %s", r.Spec, w.Name, oneLine(strings.Join(f, "; "), 300)))
			}
		}
	}
	if len(failed) > 0 {
		b.WriteString("Failed workloads (the rest of the row ran):\n\n" + strings.Join(failed, "\n") + "\n\n")
	}
	fmt.Fprintf(&b, "Raw numbers, every sample and the host description: `%s`.\n", filepath.ToSlash(o.OutJSON))
	return b.String()
}

func header(r *RowResult, h map[string]string, o Options) string {
	if r.Kind == KindHost && h["accel"] == "tcg" {
		return "host (reference, not comparable under TCG)" + repsNote(r, o.Reps)
	}
	return r.Spec + repsNote(r, o.Reps)
}

// repsNote marks a measured row that ran fewer than reps repetitions, so a
// reader sees its medians stand on fewer samples; "" for a full row.
func repsNote(r *RowResult, reps int) string {
	switch {
	case r.Output == nil || r.RepsDone >= reps:
		return ""
	case r.BudgetStop != "":
		return fmt.Sprintf(" (n=%d, budget)", r.RepsDone)
	case r.RepsDone == 0:
		return " (repetition 1 unfinished)"
	}
	return fmt.Sprintf(" (n=%d)", r.RepsDone)
}

// fmtDuration writes whole minutes as such and anything else in seconds,
// as the rest of the report does.
func fmtDuration(d time.Duration) string {
	if d >= time.Minute && d%time.Minute == 0 {
		return fmt.Sprintf("%d min", d/time.Minute)
	}
	return fmt.Sprintf("%.0f s", d.Seconds())
}

// budgetNote says what the time budget was and which rows it cut short.
func budgetNote(b *strings.Builder, rep *Report, o Options) {
	if o.Budget <= 0 {
		fmt.Fprintf(b, "No time budget (`--budget 0`): every row was to run all %d repetitions.\n\n", o.Reps)
		return
	}
	fmt.Fprintf(b, "Time budget: %s for the matrix (`--budget`), shared out as each row starts: what is left of it divided by the rows still to run, "+
		"less, for a VM row, its %d boots (%s each, or the slowest boot the row has had). "+
		"Within its share a row always runs repetition 1 of every workload, then starts another repetition only if the time used so far plus its slowest repetition still fits. ",
		fmtDuration(o.Budget), o.StartReps, fmtDuration(defaultBootCost))
	var stopped []string
	for _, r := range rep.Rows {
		if r.Output != nil && r.BudgetStop != "" {
			stopped = append(stopped, fmt.Sprintf("`%s` (n=%d)", r.Spec, r.RepsDone))
		}
	}
	if len(stopped) == 0 {
		b.WriteString("No row stopped early because of it.\n\n")
		return
	}
	fmt.Fprintf(b, "Rows that stopped before %d repetitions because of it (marked n=… in the tables): %s.\n\n", o.Reps, strings.Join(stopped, ", "))
}

func cell(r *RowResult, w Workload) string {
	if r.Kind == KindHost && w.Name == "coldstart" {
		return "—"
	}
	st, ok := value(r, w)
	if !ok {
		if r.Output != nil && len(r.Output.Failures[w.Name]) > 0 {
			return "failed"
		}
		return "—"
	}
	return spread(st, func(v float64) string { return fmtValue(v, w.Unit) })
}

// spread is the median with the min–max range, or the lone value of a
// single sample, which has no range to show.
func spread(st Stats, f func(float64) string) string {
	if st.N == 1 {
		return f(st.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", f(st.Median), f(st.Min), f(st.Max))
}

func describe(r *RowResult) string {
	switch r.Kind {
	case KindHost:
		return "no VM; the script chrooted into an overlay of the image on the host's disk"
	case KindVirtio9P:
		return "QEMU's 9p server (virtio-9p-pci, cache=mmap) on a copy of the image"
	case KindVirtioFS:
		return "virtiofsd on a copy of the image"
	case KindImagefsBlk:
		return "the image indexed and its ext4 metadata synthesized by kata-fsx, served over vhost-user-blk in-process, writes to a sparse overlay"
	case KindVirtioBlk:
		return "the same image exported raw, behind QEMU's own virtio-blk-pci with cache=none (the ceiling)"
	}
	return r.Kind
}

func ratioTable(b *strings.Builder, rep *Report, o Options, charts map[string]string) {
	base := find(rep, o.Baseline)
	if base == nil {
		fmt.Fprintf(b, "No ratio table: the baseline row `%s` has no results.\n\n", o.Baseline)
		return
	}
	rows := vmRows(rep)
	fmt.Fprintf(b, "#### Speed relative to `%s` (above 1 = faster; time_base / time_row, or throughput_row / throughput_base)\n\n| workload |", o.Baseline)
	for _, r := range rows {
		fmt.Fprintf(b, " %s |", r.Spec+repsNote(r, o.Reps))
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", len(rows)) + "\n")
	for _, w := range Workloads() {
		fmt.Fprintf(b, "| %s |", w.Label)
		for _, r := range rows {
			a, ok1 := value(r, w)
			bs, ok2 := value(base, w)
			if ok1 && ok2 {
				fmt.Fprintf(b, " %.2f |", Speedup(w, a.Median, bs.Median))
			} else {
				b.WriteString(" — |")
			}
		}
		b.WriteString("\n")
	}
	if f, ok := charts["ratio"]; ok {
		fmt.Fprintf(b, "\n![ratios](%s)\n", f)
	}
	b.WriteString("\n")
}

// targets checks imagefs-blk against the targets: at least 8x the
// best virtio-fs row on chown -R and install, 2x on stat, and 0.9x of the
// raw virtio-blk ceiling on every workload.
func targets(b *strings.Builder, rep *Report, o Options) {
	var img, raw *RowResult
	var vfs []*RowResult
	for _, r := range measured(rep) {
		switch r.Kind {
		case KindImagefsBlk:
			if img == nil {
				img = r
			}
		case KindVirtioBlk:
			if raw == nil {
				raw = r
			}
		case KindVirtioFS:
			vfs = append(vfs, r)
		}
	}
	if img == nil {
		b.WriteString("No imagefs-blk results: targets not evaluated.\n\n")
		return
	}
	b.WriteString("#### Targets for imagefs-blk\n\n| target | measured | met |\n|---|---|:---:|\n")
	met, total := 0, 0
	verdict := func(ok bool) string {
		total++
		if ok {
			met++
			return "yes"
		}
		return "**no**"
	}
	byName := map[string]Workload{}
	for _, w := range Workloads() {
		byName[w.Name] = w
	}
	for _, t := range []struct {
		name string
		min  float64
	}{{"chown", 8}, {"install", 8}, {"stat", 2}} {
		w := byName[t.name]
		a, ok := value(img, w)
		var best *RowResult
		var bestV float64
		for _, r := range vfs {
			if s, ok := value(r, w); ok && (best == nil || Speedup(w, s.Median, bestV) > 1) {
				best, bestV = r, s.Median
			}
		}
		if !ok || best == nil {
			fmt.Fprintf(b, "| %s ≥ %.0fx the best virtio-fs row | no data | — |\n", w.Label, t.min)
			continue
		}
		q := Speedup(w, a.Median, bestV)
		fmt.Fprintf(b, "| %s ≥ %.0fx the best virtio-fs row | %.1fx (%s s vs %s s on `%s`) | %s |\n", w.Label, t.min, q,
			fmtValue(a.Median, w.Unit), fmtValue(bestV, w.Unit), best.Spec, verdict(q >= t.min))
	}
	if raw == nil {
		b.WriteString("| ≥ 0.9x raw virtio-blk on every workload | no virtio-blk results | — |\n")
	} else {
		for _, w := range Workloads() {
			a, ok1 := value(img, w)
			r, ok2 := value(raw, w)
			if !ok1 || !ok2 {
				continue
			}
			q := Speedup(w, a.Median, r.Median)
			fmt.Fprintf(b, "| %s ≥ 0.9x raw virtio-blk | %.2fx | %s |\n", w.Label, q, verdict(q >= 0.9))
		}
	}
	fmt.Fprintf(b, "\nMet %d of %d.", met, total)
	var short []string
	for _, r := range append([]*RowResult{img, raw}, vfs...) {
		if r != nil && repsNote(r, o.Reps) != "" {
			short = append(short, "`"+r.Spec+"`"+repsNote(r, o.Reps))
		}
	}
	if len(short) > 0 {
		fmt.Fprintf(b, " Compared from fewer than %d repetitions: %s.", o.Reps, strings.Join(short, ", "))
	}
	b.WriteString("\n\n")
}

func resources(b *strings.Builder, rep *Report) {
	b.WriteString("#### Cold start, bytes read before the process starts, memory\n\n")
	b.WriteString("| row | cold start, s | serving process | bytes it read, sandbox up → first output (rchar / read_bytes) | its private memory at the end (RssAnon) | its peak RSS | QEMU peak RSS | guest page cache after repetition 1's read workloads |\n|---|---:|---|---:|---:|---:|---:|---:|\n")
	for _, r := range measured(rep) {
		if r.Kind == KindHost {
			continue
		}
		cs := "—"
		if st, ok := Summarize(r.ColdStart); ok {
			cs = spread(st, func(v float64) string { return fmt.Sprintf("%.2f", v) })
		}
		rss, anon := "—", "—"
		if r.ServingHWMKiB > 0 && r.Serving != "qemu" {
			rss, anon = mib(r.ServingHWMKiB<<10), mib(r.ServingAnonKiB<<10)
		} else if r.Serving == "qemu" {
			rss, anon = "inside QEMU", "inside QEMU"
		}
		pc := "—"
		if v := r.Output.Info["page_cache_kib"]; v != "" {
			var kib uint64
			if _, err := fmt.Sscan(v, &kib); err == nil {
				pc = mib(kib << 10)
			}
		}
		fmt.Fprintf(b, "| `%s` | %s | %s | %s / %s | %s | %s | %s | %s |\n", r.Spec, cs, r.Serving, bytesStr(r.StartRChar), bytesStr(r.StartReadBytes), anon, rss, mib(r.QEMUHWMKiB<<10), pc)
	}
	b.WriteString("\nCold start runs from invoking `kata-fsx run` to the first output of the container's process (the workload script, or `/bin/echo` in the extra boots), so the process has been loaded and runs: it includes the VM boot and, for imagefs-blk, indexing the image and synthesizing its metadata (the first boot of a row has an empty index cache, later ones reuse it). " +
		"The serving process is the one that reads the rootfs from the host for the guest: QEMU for 9p and virtio-blk, virtiofsd for virtio-fs, the kata-fsx process itself for imagefs-blk (its peak RSS includes the whole `kata-fsx run`, indexing and synthesis included). For virtiofsd the counters cover the process and its children (the C virtiofsd serves from a forked child; peak RSS is the sum of their peaks); for kata-fsx only its own process (its children are QEMU and virtiofsd). Peak RSS, for a vhost-user backend, includes the guest memory it touched (shared with QEMU); the private memory column leaves that out. " +
		"QEMU's peak RSS includes the guest memory it touched.\n\n")
}

func mib(n uint64) string {
	if n == 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

func bytesStr(n uint64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func oneLine(s string, n int) string {
	return truncate(strings.Join(strings.Fields(s), " "), n)
}
