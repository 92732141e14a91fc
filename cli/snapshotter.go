package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"sync"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/snapshotter"
)

// runSnapshotter is `kata-fsx snapshotter`: containerd's proxy snapshotter
// on a unix socket, until SIGTERM or SIGINT.
func runSnapshotter(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("snapshotter", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file ([kata_fsx.snapshotter], [kata_fsx.registry], imagefs_blk state_dir; default: the usual lookup, see kata-fsx env --help)")
	address := fs.String("address", "", "unix socket to serve on (default: kata_fsx.snapshotter.address)")
	root := fs.String("root", "", "snapshots directory (default: kata_fsx.snapshotter.root)")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: kata-fsx snapshotter [--config FILE] [--address SOCK] [--root DIR]\n\n"+
			"Serve containerd's snapshots API as a proxy snapshotter plugin (docs/snapshotter.md).\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "kata-fsx snapshotter: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kata-fsx snapshotter: %v\n", err)
		return 1
	}
	cfg, err := config.Load(*cfgPath, config.DevPath())
	if err != nil {
		// The sidecar of each remote layer names this file, so that its
		// mount helper and the shim read through the same registry
		// settings and node store: there must be one.
		return fail(err)
	}
	if cfg.Path, err = filepath.Abs(cfg.Path); err != nil {
		return fail(err)
	}
	if *address != "" {
		cfg.KataFSX.Snapshotter.Address = *address
	}
	if *root != "" {
		cfg.KataFSX.Snapshotter.Root = *root
	}
	if err := config.ValidateSnapshotter(cfg); err != nil {
		return fail(fmt.Errorf("%s: %w", cfg.Path, err))
	}
	// mu keeps log lines whole; a leaf lock, held for one write to
	// stderr, which callers may do holding their own locks.
	var mu sync.Mutex
	logf := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(stderr, format+"\n", args...)
	}
	sc := cfg.KataFSX.Snapshotter
	l, err := snapshotter.Listen(sc.Address)
	if err != nil {
		return fail(err)
	}
	sn, err := snapshotter.New(snapshotter.Options{Root: sc.Root, Config: cfg, Logf: logf})
	if err != nil {
		l.Close()
		return fail(err)
	}
	defer startAutoPrune(ctx, cfg, logf, nil)() // node caches to their [kata_fsx.cache] budgets
	logf("kata-fsx snapshotter %s: serving %s (root %s, remote layers %v, config %s)", Version, sc.Address, sc.Root, sc.Remote, cfg.Path)
	err = snapshotter.Serve(ctx, l, sn)
	if cerr := sn.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fail(err)
	}
	logf("kata-fsx snapshotter: stopped")
	return 0
}
