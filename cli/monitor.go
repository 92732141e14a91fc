package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// Bounds of one pod's scrape: a shim that hangs or floods cannot stall
// or exhaust the monitor.
const (
	monitorScrapeTimeout = 5 * time.Second
	monitorScrapeLimit   = 16 << 20
	monitorParallel      = 8
)

// runMonitor is `kata-fsx monitor`, kata-monitor's counterpart: it serves
// on a TCP port the metrics of every pod whose socket is under the state
// directory, each sample labelled with its sandbox_id.
func runMonitor(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("monitor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (kata_fsx.state_dir; default: the usual lookup, see kata-fsx env --help)")
	listen := fs.String("listen", "127.0.0.1:8090", "TCP address to serve GET /metrics on (kata-monitor's default)")
	stateDir := fs.String("state-dir", "", "directory of the pods' sandbox directories (default: kata_fsx.state_dir)")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: kata-fsx monitor [--config FILE] [--listen ADDR] [--state-dir DIR]\n\n"+
			"Serve the metrics of every running kata-fsx pod on one port, each sample labelled\n"+
			"with its sandbox_id (docs/metrics.md).\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "kata-fsx monitor: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kata-fsx monitor: %v\n", err)
		return 1
	}
	dir := *stateDir
	if dir == "" {
		cfg, err := config.Load(*cfgPath, config.DevPath())
		if err != nil {
			return fail(err)
		}
		dir = node.LayoutOf(cfg).Sandboxes()
	}
	m := &monitor{stateDir: dir, logf: func(format string, args ...any) { fmt.Fprintf(stderr, "kata-fsx monitor: "+format+"\n", args...) }}
	srv, err := metrics.ServeTCP(*listen, metrics.Handler(func(s *metrics.Set) { m.collect(ctx, s) }))
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(stdout, "kata-fsx monitor: serving http://%s%s for pods under %s\n", srv.Addr(), metrics.Path, dir)
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fail(err)
	}
	return 0
}

// monitor scrapes the pods' metrics sockets on each of its own scrapes.
type monitor struct {
	stateDir string
	logf     func(format string, args ...any)
	// Kata's kata_monitor_* counters, over the monitor's life.
	scrapes, failures atomic.Uint64
}

// podScrape is one pod's exposition, or why it could not be read.
type podScrape struct {
	id   string
	fams []metrics.Family
	err  error
}

// pods lists the sandbox ids that have a metrics socket, sorted.
func (m *monitor) pods() []string {
	socks, _ := filepath.Glob(filepath.Join(m.stateDir, "*", sandbox.MetricsSocketName))
	var ids []string
	for _, s := range socks {
		if fi, err := os.Lstat(s); err == nil && fi.Mode()&os.ModeSocket != 0 {
			ids = append(ids, filepath.Base(filepath.Dir(s)))
		}
	}
	sort.Strings(ids)
	return ids
}

// collect scrapes every pod, a few at a time, and merges their families
// with a sandbox_id label on every sample; a pod that fails is counted
// and left out, as is a family whose type clashes with another pod's.
func (m *monitor) collect(ctx context.Context, set *metrics.Set) {
	ids := m.pods()
	results := make([]podScrape, len(ids))
	sem := make(chan struct{}, monitorParallel)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			sctx, cancel := context.WithTimeout(ctx, monitorScrapeTimeout)
			defer cancel()
			fams, err := metrics.ScrapeUnix(sctx, sandbox.MetricsSocket(filepath.Join(m.stateDir, id)), monitorScrapeLimit)
			results[i] = podScrape{id: id, fams: fams, err: err}
		}()
	}
	wg.Wait()
	running := 0
	for _, r := range results {
		m.scrapes.Add(1)
		if r.err != nil {
			// A pod stopping between the listing and the scrape, or a
			// dead shim's socket: not served this time.
			m.failures.Add(1)
			m.logf("sandbox %s: %v", r.id, r.err)
			continue
		}
		running++
		for _, f := range r.fams {
			for i := range f.Samples {
				f.Samples[i].Labels = withSandboxID(f.Samples[i].Labels, r.id)
			}
			if err := set.Merge(f); err != nil {
				m.logf("sandbox %s: %v", r.id, err)
			}
		}
	}
	set.Gauge("kata_monitor_running_shim_count", "Running shim count (pods whose metrics socket answered).").Add(float64(running))
	set.Counter("kata_monitor_scrape_count", "Pod scrapes the monitor made.").Add(float64(m.scrapes.Load()))
	set.Counter("kata_monitor_scrape_failed_count", "Pod scrapes that failed.").Add(float64(m.failures.Load()))
}

// withSandboxID puts sandbox_id first, replacing one the pod set itself.
func withSandboxID(labels []metrics.Label, id string) []metrics.Label {
	out := make([]metrics.Label, 0, len(labels)+1)
	out = append(out, metrics.L("sandbox_id", id))
	for _, l := range labels {
		if l.Name != "sandbox_id" {
			out = append(out, l)
		}
	}
	return out
}
