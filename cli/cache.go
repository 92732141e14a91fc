package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

const cacheUsage = `usage: kata-fsx cache COMMAND

  ls    [--config F] [--json] [-v]
        each node cache under imagefs_blk.state_dir: budget, bytes, entries
        (-v: every entry: key, bytes, last used, in use, note)
  prune [--config F] [--cache NAME] [--budget-mb N] [--min-age-minutes N] [--dry-run] [--json]
        remove the least recently used entries no running pod holds until
        each cache fits its [kata_fsx.cache] budget (docs/caches.md)

Caches: metadata, indexes, blobs, content.
`

func runCache(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, cacheUsage)
		return 2
	}
	switch args[0] {
	case "ls":
		return runCacheLs(ctx, args[1:], stdout, stderr)
	case "prune":
		return runCachePrune(ctx, args[1:], stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, cacheUsage)
		return 0
	}
	fmt.Fprintf(stderr, "kata-fsx cache: unknown command %q\n\n%s", args[0], cacheUsage)
	return 2
}

// loadCacheConfig loads the configuration `kata-fsx cache` reads: the
// state directory and the [kata_fsx.cache] table.
func loadCacheConfig(path string) (*config.Config, error) {
	c, err := config.Load(path, config.DevPath())
	if err != nil {
		return nil, err
	}
	if err := config.ValidateCache(c); err != nil {
		return nil, fmt.Errorf("%s: %w", c.Path, err)
	}
	if sd := c.KataFSX.ImagefsBlk.StateDir; !filepath.IsAbs(sd) {
		return nil, fmt.Errorf("%s: kata_fsx.imagefs_blk.state_dir = %q: must be an absolute path", c.Path, sd)
	}
	return c, nil
}

// CacheListing is one cache in `kata-fsx cache ls --json`.
type CacheListing struct {
	Name        string      `json:"name"`
	BudgetBytes int64       `json:"budget_bytes"` // -1: none
	Bytes       int64       `json:"bytes"`
	Entries     int         `json:"entries"`
	InUse       int         `json:"in_use"`
	List        []CacheItem `json:"list,omitempty"`
}

// CacheItem is one entry in `kata-fsx cache ls -v --json`.
type CacheItem struct {
	Key      string    `json:"key"`
	Bytes    int64     `json:"bytes"`
	LastUsed time.Time `json:"last_used"`
	InUse    bool      `json:"in_use"`
	Note     string    `json:"note,omitempty"`
}

func runCacheLs(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cache ls", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (imagefs_blk state_dir, [kata_fsx.cache]; default: the usual lookup)")
	asJSON := fs.Bool("json", false, "print JSON")
	verbose := fs.Bool("v", false, "list every entry")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "kata-fsx cache ls: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	c, err := loadCacheConfig(*cfgPath)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx cache ls: %v\n", err)
		return 1
	}
	var (
		out  []CacheListing
		errs []error
	)
	for _, b := range node.Caches(c) {
		es, err := b.Cache.Entries(ctx)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		l := CacheListing{Name: b.Cache.Name(), BudgetBytes: b.Budget, Entries: len(es)}
		for _, e := range es {
			l.Bytes += e.Bytes
			if e.InUse {
				l.InUse++
			}
			if *verbose {
				l.List = append(l.List, CacheItem{Key: e.Key, Bytes: e.Bytes, LastUsed: e.LastUsed.UTC(), InUse: e.InUse, Note: e.Note})
			}
		}
		out = append(out, l)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			errs = append(errs, err)
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "CACHE\tBUDGET\tBYTES\tENTRIES\tIN USE\n")
		for _, l := range out {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\n", l.Name, budgetString(l.BudgetBytes), nodecache.Size(l.Bytes), l.Entries, l.InUse)
		}
		tw.Flush()
		if *verbose {
			for _, l := range out {
				if len(l.List) == 0 {
					continue
				}
				fmt.Fprintf(stdout, "\n%s:\n", l.Name)
				tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintf(tw, "  KEY\tBYTES\tLAST USED\tIN USE\tNOTE\n")
				for _, e := range l.List {
					fmt.Fprintf(tw, "  %s\t%d\t%s\t%v\t%s\n", e.Key, e.Bytes, e.LastUsed.Format(time.RFC3339), e.InUse, e.Note)
				}
				tw.Flush()
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintf(stderr, "kata-fsx cache ls: %v\n", err)
		return 1
	}
	return 0
}

func budgetString(b int64) string {
	if b < 0 {
		return "none"
	}
	return nodecache.Size(b)
}

// PruneReport is one cache in `kata-fsx cache prune --json`.
type PruneReport struct {
	Name        string      `json:"name"`
	BudgetBytes int64       `json:"budget_bytes"`
	Before      int64       `json:"bytes_before"`
	After       int64       `json:"bytes_after"`
	DryRun      bool        `json:"dry_run,omitempty"`
	OverBudget  bool        `json:"over_budget"`
	Removed     []CacheItem `json:"removed"`
	KeptInUse   []CacheItem `json:"kept_in_use"`
	KeptRecent  []CacheItem `json:"kept_recent"`
	Failed      []string    `json:"failed,omitempty"`
}

func items(es []nodecache.Entry) []CacheItem {
	out := make([]CacheItem, 0, len(es))
	for _, e := range es {
		out = append(out, CacheItem{Key: e.Key, Bytes: e.Bytes, LastUsed: e.LastUsed.UTC(), InUse: e.InUse, Note: e.Note})
	}
	return out
}

func runCachePrune(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cache prune", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (imagefs_blk state_dir, [kata_fsx.cache]; default: the usual lookup)")
	only := fs.String("cache", "", "prune only this cache (metadata, indexes, blobs, content)")
	budgetMB := fs.Int64("budget-mb", -1, "prune to this many MiB instead of the configured budget (0: every entry not in use)")
	minAge := fs.Int64("min-age-minutes", -1, "keep entries used this recently (default: kata_fsx.cache.min_age_minutes)")
	dryRun := fs.Bool("dry-run", false, "print what would be removed; remove nothing")
	asJSON := fs.Bool("json", false, "print JSON")
	verbose := fs.Bool("v", false, "print a line per entry removed or kept")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "kata-fsx cache prune: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if *budgetMB < -1 || *budgetMB > 1<<40 {
		fmt.Fprintf(stderr, "kata-fsx cache prune: --budget-mb %d: must be between 0 and %d\n", *budgetMB, int64(1<<40))
		return 2
	}
	if *minAge < -1 || *minAge > 1<<20 {
		fmt.Fprintf(stderr, "kata-fsx cache prune: --min-age-minutes %d: must be between 0 and %d\n", *minAge, 1<<20)
		return 2
	}
	c, err := loadCacheConfig(*cfgPath)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx cache prune: %v\n", err)
		return 1
	}
	var sel []nodecache.Budgeted
	var names []string
	for _, b := range node.Caches(c) {
		names = append(names, b.Cache.Name())
		if *only != "" && b.Cache.Name() != *only {
			continue
		}
		if *budgetMB >= 0 {
			b.Budget = *budgetMB << 20
		}
		sel = append(sel, b)
	}
	if len(sel) == 0 {
		fmt.Fprintf(stderr, "kata-fsx cache prune: --cache %q: no such cache (have %v)\n", *only, names)
		return 2
	}
	o := nodecache.PruneOptions{MinAge: c.KataFSX.Cache.MinAge(), DryRun: *dryRun}
	if *minAge >= 0 {
		o.MinAge = time.Duration(*minAge) * time.Minute
	}
	if *verbose && !*asJSON {
		o.Logf = func(format string, args ...any) { fmt.Fprintf(stdout, format+"\n", args...) }
	}
	rs, err := nodecache.PruneAll(ctx, sel, o)
	if *asJSON {
		var out []PruneReport
		for _, r := range rs {
			pr := PruneReport{Name: r.Cache, BudgetBytes: r.Budget, Before: r.Before, After: r.After, DryRun: r.DryRun, OverBudget: r.OverBudget(),
				Removed: items(r.Removed), KeptInUse: items(r.KeptInUse), KeptRecent: items(r.KeptRecent)}
			for _, f := range r.Failed {
				pr.Failed = append(pr.Failed, fmt.Sprintf("%s: %v", f.Entry.Key, f.Err))
			}
			out = append(out, pr)
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if jerr := enc.Encode(out); jerr != nil {
			err = errors.Join(err, jerr)
		}
	} else {
		for _, r := range rs {
			fmt.Fprintln(stdout, r.Summary())
			verb := "removed"
			if r.DryRun {
				verb = "would remove"
			}
			for _, e := range r.Removed {
				fmt.Fprintf(stdout, "  %s %s (%s)\n", verb, e.Key, nodecache.Size(e.Bytes))
			}
			for _, e := range r.KeptInUse {
				fmt.Fprintf(stdout, "  kept %s (%s): in use\n", e.Key, nodecache.Size(e.Bytes))
			}
			for _, e := range r.KeptRecent {
				fmt.Fprintf(stdout, "  kept %s (%s): used within the minimum age\n", e.Key, nodecache.Size(e.Bytes))
			}
			for _, f := range r.Failed {
				fmt.Fprintf(stdout, "  failed %s: %v\n", f.Entry.Key, f.Err)
			}
		}
	}
	failed := 0
	for _, r := range rs {
		failed += len(r.Failed)
	}
	if err != nil || failed > 0 {
		if err != nil {
			fmt.Fprintf(stderr, "kata-fsx cache prune: %v\n", err)
		} else {
			fmt.Fprintf(stderr, "kata-fsx cache prune: %d entries could not be removed\n", failed)
		}
		return 1
	}
	return 0
}

// startAutoPrune prunes the node caches when `kata-fsx snapshotter`
// starts and then every prune_interval_minutes, in the background until
// ctx ends or stop is called, when [kata_fsx.cache] prune is "auto"; each
// prune is bounded and only logs its problems. stop returns once the
// pruning stopped. rounds, when not nil, is called after each prune.
func startAutoPrune(ctx context.Context, c *config.Config, logf func(string, ...any), rounds func()) (stop func()) {
	if c.KataFSX.Cache.Prune != config.PruneAuto {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			pctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
			ran, rs, err := node.AutoPrune(pctx, c, nil)
			cancel()
			if err != nil && ctx.Err() == nil {
				logf("kata-fsx snapshotter: node caches: %v", err)
			}
			if ran {
				for _, r := range rs {
					if len(r.Removed) > 0 || r.OverBudget() {
						logf("kata-fsx snapshotter: node caches: %s", r.Summary())
					}
				}
			}
			if rounds != nil {
				rounds()
			}
			iv := c.KataFSX.Cache.PruneInterval()
			if iv <= 0 {
				return
			}
			t := time.NewTimer(iv)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}
