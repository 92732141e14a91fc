// Package bench is `kata-fsx bench`: it runs the same workloads on every
// filesystem backend side by side, each in a pod VM booted through
// `kata-fsx run` (the shim's sandbox code) on the same bench image, plus
// once on the host for reference, and writes the results as JSON, a
// Markdown report and PNG charts.
//
// It is about 3,000 lines, over the project's usual package size, because
// the matrix runner, the host-cost measurement and the report share one
// result model (results.go, row.go); split apart, each would export that
// model only to the others. Workloads and charts are already their own
// packages.
package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// Options are the settings of one bench run.
type Options struct {
	ConfigPath string
	Image      string // the bench image's root directory
	Backends   []Row
	Baseline   string // the row ratios are computed against
	Reps       int    // repetitions of the workloads, at most when Budget is set
	// Budget is the time the whole matrix may take, shared out between the
	// rows as they start; a row stops repeating before it would overrun its
	// share (0 = no budget: every row runs Reps repetitions).
	Budget     time.Duration
	StartReps  int // boots per VM row for the cold-start samples
	FioMB      int
	FioSecs    int
	DbenchSecs int
	SqliteRows int
	Only       string // comma-separated workloads; empty = all
	VCPUs      int
	MemoryMiB  int
	RowTimeout time.Duration
	// StallTimeout stops a workload boot whose script prints nothing for that long.
	StallTimeout time.Duration
	OutJSON      string
	OutMD        string // Markdown file whose bench section is replaced
	ChartDir     string
	KataFSX      string // the kata-fsx binary the rows run
	TmpDir       string
	Command      string // the command line, for the report
	// HostCost runs the host-cost counting pass instead of the timed
	// matrix, writing HostCostJSON and its section of OutMD.
	HostCost     bool
	HostCostJSON string
}

type driver struct {
	o     Options
	base  *config.Config
	caps  HostCaps
	host  map[string]string
	accel string
	aio   string
	tmp   string
	log   io.Writer
}

func (d *driver) logf(format string, args ...any) {
	fmt.Fprintf(d.log, "bench: "+format+"\n", args...)
}

// progress turns the script's result lines into progress messages.
func (d *driver) progress(row string) io.Writer { return &progressWriter{d: d, row: row} }

type progressWriter struct {
	d   *driver
	row string
	buf []byte
}

func (p *progressWriter) Write(b []byte) (int, error) {
	p.buf = append(p.buf, b...)
	for {
		i := strings.IndexByte(string(p.buf), '\n')
		if i < 0 {
			break
		}
		f := strings.Fields(string(p.buf[:i]))
		p.buf = p.buf[i+1:]
		switch {
		case len(f) == 5 && f[0] == "@@RESULT":
			p.d.logf("%s: %s rep %s: %s %s", p.row, f[1], f[2], f[3], f[4])
		case len(f) >= 3 && f[0] == "@@FAIL":
			p.d.logf("%s: %s rep %s FAILED: %s", p.row, f[1], f[2], strings.Join(f[3:], " "))
		case len(f) == 3 && f[0] == "@@INFO" && f[1] == "reps_done":
			p.d.logf("%s: repetition %s done", p.row, f[2])
		case len(f) >= 3 && f[0] == "@@INFO" && f[1] == "budget_stop":
			p.d.logf("%s: time budget: stopped %s", p.row, strings.Join(f[2:], " "))
		}
	}
	if len(p.buf) > maxLine {
		p.buf = p.buf[:0] // not a protocol line; the parser sees the full output
	}
	return len(b), nil
}

// Main runs `kata-fsx bench` and returns the exit status.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer, defaultConfig string) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o Options
	backends := fs.String("backends", strings.Join(DefaultBackends(), ";"), "rows, separated by ';' (or ','): host, virtio-9p, virtio-fs[:cache=never|auto|always,threads=N,dax=MiB], imagefs-blk, virtio-blk; VM rows also take agent=auto|vsock|hybrid-vsock|virtio-serial")
	fs.StringVar(&o.ConfigPath, "config", "", "base configuration (default: the usual lookup)")
	fs.StringVar(&o.Image, "image", "", "bench image root directory (test/fixtures/bench-image.sh builds one; make bench passes it)")
	fs.StringVar(&o.Baseline, "baseline", "virtio-fs:cache=auto", "row the ratio chart and table compare against")
	fs.IntVar(&o.Reps, "reps", 3, "repetitions of every workload (at most, with --budget)")
	fs.DurationVar(&o.Budget, "budget", 28*time.Minute, "time the whole matrix may take, shared out between rows as they start; a row runs repetition 1 in full, then stops before a repetition that would overrun its share; 0 = none, every row runs --reps")
	fs.IntVar(&o.StartReps, "start-reps", 2, "boots per VM row for cold-start samples (the workload boot is the first)")
	fs.IntVar(&o.FioMB, "fio-size", 32, "MiB of the fio file")
	fs.IntVar(&o.FioSecs, "fio-runtime", 1, "seconds per fio job")
	fs.IntVar(&o.DbenchSecs, "dbench-time", 3, "seconds of dbench")
	fs.IntVar(&o.SqliteRows, "sqlite-rows", 10000, "rows the sqlite workload inserts")
	fs.StringVar(&o.Only, "only", "", "comma-separated workloads to run (default all)")
	fs.IntVar(&o.VCPUs, "vcpus", 1, "guest vCPUs")
	fs.IntVar(&o.MemoryMiB, "memory", 1024, "guest memory in MiB")
	fs.DurationVar(&o.RowTimeout, "row-timeout", 15*time.Minute, "time limit of one row; a row over it is reported as failed")
	fs.DurationVar(&o.StallTimeout, "stall-timeout", 3*time.Minute, "stop a row whose workload script prints nothing for this long (a hung guest); 0 = never")
	fs.StringVar(&o.OutJSON, "json", "docs/bench/suite.json", "raw results")
	fs.StringVar(&o.OutMD, "md", "docs/benchmarks.md", "Markdown file whose suite section is replaced (created if missing)")
	fs.StringVar(&o.ChartDir, "charts", "docs/bench", "directory of the PNG charts")
	fs.StringVar(&o.TmpDir, "tmp", "", "scratch directory on a disk filesystem (default $TMPDIR)")
	fs.BoolVar(&o.HostCost, "hostcost", false, "instead of the timed matrix, count each row's host cost per workload (requests served, system calls of the serving process, with strace) into --hostcost-json and the host-cost section of --md; default rows "+HostCostDefaultBackends())
	fs.StringVar(&o.HostCostJSON, "hostcost-json", "docs/bench/hostcost.json", "raw results of --hostcost")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if o.HostCost {
		given := false
		fs.Visit(func(f *flag.Flag) { given = given || f.Name == "backends" })
		if !given {
			*backends = HostCostDefaultBackends()
		}
	}
	var err error
	if o.Backends, err = ParseRows(*backends); err != nil {
		fmt.Fprintf(stderr, "kata-fsx bench: %v\n", err)
		return 2
	}
	if o.Image == "" {
		fmt.Fprintln(stderr, "kata-fsx bench: --image is required (build one with test/fixtures/bench-image.sh, or run make bench)")
		return 2
	}
	if o.Reps < 1 || o.StartReps < 1 || o.FioMB < 1 || o.FioSecs < 1 || o.DbenchSecs < 1 || o.SqliteRows < 1 || o.VCPUs < 1 || o.MemoryMiB < 256 {
		fmt.Fprintln(stderr, "kata-fsx bench: --reps, --start-reps, --fio-size, --fio-runtime, --dbench-time, --sqlite-rows and --vcpus must be positive, --memory at least 256")
		return 2
	}
	if o.Budget < 0 {
		fmt.Fprintln(stderr, "kata-fsx bench: --budget must not be negative (0 = no budget)")
		return 2
	}
	if o.KataFSX, err = os.Executable(); err != nil {
		fmt.Fprintf(stderr, "kata-fsx bench: %v\n", err)
		return 1
	}
	o.Command = "kata-fsx bench " + strings.Join(args, " ")
	if err := Run(ctx, o, defaultConfig, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "kata-fsx bench: %v\n", err)
		return 1
	}
	return 0
}

// Report is the JSON document of a run.
type Report struct {
	Date     string            `json:"date"`
	Command  string            `json:"command"`
	Host     map[string]string `json:"host"`
	Settings map[string]any    `json:"settings"`
	Rows     []*RowResult      `json:"rows"`
	Seconds  float64           `json:"wall_seconds"`
}

// Run measures every row of o and writes the report files.
func Run(ctx context.Context, o Options, defaultConfig string, stdout, stderr io.Writer) (err error) {
	started := time.Now()
	d := &driver{o: o, log: stderr}
	if fi, err := os.Stat(filepath.Join(o.Image, "bin")); err != nil || !fi.IsDir() {
		return fmt.Errorf("--image %s: not a root filesystem (no bin/)", o.Image)
	}
	if d.o.Image, err = filepath.Abs(o.Image); err != nil {
		return err
	}
	if d.base, err = config.Load(o.ConfigPath, defaultConfig); err != nil {
		return err
	}
	if d.tmp, err = os.MkdirTemp(o.TmpDir, "kata-fsx-bench-"); err != nil {
		return err
	}
	defer func() {
		if rmErr := os.RemoveAll(d.tmp); rmErr != nil {
			err = errors.Join(err, rmErr)
		}
	}()
	if err := d.probeHost(ctx); err != nil {
		return err
	}
	if o.HostCost {
		return d.hostCost(ctx, started, stdout)
	}
	d.logf("host: %s, %s CPUs, accelerator %s; QEMU %s; virtiofsd %s", d.host["cpu"], d.host["cpus"], d.accel, d.host["qemu"], d.host["virtiofsd"])
	if o.Budget > 0 {
		d.logf("time budget %s for %d rows, shared out as each starts", o.Budget, runnable(o.Backends, d.caps))
	}
	var rows []*RowResult
	for i, r := range o.Backends {
		if ctx.Err() != nil {
			rows = append(rows, &RowResult{Spec: r.Spec, Kind: r.Kind, Error: "not run: interrupted"})
			continue
		}
		share := budgetShare(o.Budget, time.Since(started), runnable(o.Backends[i:], d.caps))
		rows = append(rows, d.runRow(ctx, i, r, share))
	}
	rep := &Report{
		Date: started.UTC().Format(time.RFC3339), Command: o.Command, Host: d.host, Rows: rows,
		Settings: map[string]any{
			"reps": o.Reps, "budget_s": o.Budget.Seconds(), "start_reps": o.StartReps, "fio_file_mib": o.FioMB, "fio_runtime_s": o.FioSecs,
			"dbench_s": o.DbenchSecs, "sqlite_rows": o.SqliteRows, "only": o.Only, "vcpus": o.VCPUs, "memory_mib": o.MemoryMiB,
			"baseline": o.Baseline, "image": o.Image, "block_device_aio": d.aio,
		},
		Seconds: time.Since(started).Seconds(),
	}
	rep.Host["loadavg_end"] = LoadAvg()
	if err := writeReport(rep, o, stdout); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// The report is written either way; the exit status tells a script
	// that some numbers are missing.
	var failed []string
	for _, r := range rows {
		if r.Error != "" {
			failed = append(failed, r.Spec)
			continue
		}
		if r.Output != nil {
			for _, w := range Workloads() {
				if len(r.Output.Failures[w.Name]) > 0 {
					failed = append(failed, r.Spec+" "+w.Name)
				}
			}
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("report written to %s, but these failed (errors in the report): %s", o.OutMD, strings.Join(failed, ", "))
	}
	return nil
}

func (d *driver) probeHost(ctx context.Context) error {
	// One probe for every row, the shim's own (host.Probe), so no row pays
	// the KVM boot probe and the rows run on what a pod here would get.
	h := host.Probe(ctx, d.base)
	if h.QEMUErr != nil {
		return h.QEMUErr
	}
	d.caps = HostCaps{Root: os.Geteuid() == 0, DAX: h.QEMU.DAX, QEMUVersion: h.QEMU.VersionLine}
	d.host = map[string]string{
		"cpus": fmt.Sprint(h.System.CPUs), "qemu": h.QEMU.VersionLine, "go": runtime.Version(),
		"cpu": "unknown", "loadavg_start": LoadAvg(), "virtiofsd": "none configured",
		"kernel": h.System.Kernel,
	}
	if h.System.CPUModel != "" {
		d.host["cpu"] = h.System.CPUModel
	}
	switch {
	case h.Daemon != nil:
		d.caps.Virtiofsd = h.Daemon.Path
		d.host["virtiofsd"] = fmt.Sprintf("%s (%s flavour, %s)", h.Daemon.Path, h.Daemon.Flavour, h.Daemon.Version)
	case h.DaemonErr != nil:
		d.host["virtiofsd"] = h.DaemonErr.Error()
	}
	d.accel, d.caps.Accel = string(h.Accel), string(h.Accel)
	d.host["accel"], d.host["accel_reason"] = string(h.Accel), h.AccelReason
	d.host["agent_transport"] = h.Transport + " (" + h.TransportReason + ")"
	d.aio, d.host["block_device_aio"] = d.probeAIO(ctx)
	return nil
}

// probeAIO picks io_uring for the raw virtio-blk row when QEMU's block
// layer can use it here, threads otherwise; the second result is the
// choice with its reason, for the report.
func (d *driver) probeAIO(ctx context.Context) (string, string) {
	f := filepath.Join(d.tmp, "aio-probe.raw")
	if err := os.WriteFile(f, make([]byte, 1<<16), 0o600); err != nil {
		return "threads", "threads (" + err.Error() + ")"
	}
	defer os.Remove(f)
	aio, why := hypervisor.ProbeIOUring(ctx, f)
	return aio, aio + " (" + why + ")"
}

// LoadAvg is the 1-minute load average, to judge how noisy a run was.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "unknown"
}
