// Package cli implements the kata-fsx operator commands (env, check,
// image, run, exec, bench); cmd/kata-fsx is only its entry point. run and
// exec drive pods through package sandbox, as the shim does.
//
// It is about 2,800 lines, over the project's usual package size, as ten
// commands of 90 to 600 lines side by side, each a front end over a lower
// package (sandbox, node, content/lazyroot, host, metrics, snapshotter);
// none is large, and one dispatcher with one flag convention is what
// keeps them a single program.
package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/kata-fsx/kata-fsx/bench"
	"github.com/kata-fsx/kata-fsx/config"
)

// Version is kata-fsx's release, set at link time by the Makefile.
var Version = "0.0.0-dev"

const usage = `usage: kata-fsx COMMAND [options]

Commands:
  env      print the effective configuration and host facts (like kata-runtime env)
  check    check this host can run kata-fsx pods; non-zero exit on any failure
  image    build, inspect, export and serve imagefs-blk images; index registry images (see kata-fsx image help)
  run      boot a one-off pod VM and run a command in it (see kata-fsx run -h)
  exec     run a command in a pod left running by run --keep
  bench    compare the filesystem backends side by side (see kata-fsx bench -h)
  snapshotter  serve containerd's proxy snapshotter with remote (lazy) layers (see docs/snapshotter.md)
  monitor  serve every running pod's metrics on one port (like kata-monitor; docs/metrics.md)
  cache    list the node caches and prune them to their budgets (see kata-fsx cache help)
  version  print the version

Run 'kata-fsx COMMAND -h' for a command's options.
`

// Run is the kata-fsx entry point: it runs Main with a context that
// SIGINT or SIGTERM cancels, so every command stops and cleans up (removes
// its partial output, tears its sandbox down) instead of dying mid-way or
// ignoring the signal. A second signal kills the process at once, for a
// command whose cleanup itself is stuck; run is the exception, as its
// pod would be left behind: it always finishes its teardown (SIGKILL
// remains, and run's watchdog cleans up after it).
func Run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// stop restores the default action: the next signal terminates.
	context.AfterFunc(ctx, stop)
	return Main(ctx, args, stdout, stderr)
}

// Main runs the kata-fsx command line and returns the process exit status.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "env":
		return runEnv(ctx, args[1:], stdout, stderr)
	case "check":
		return runCheck(ctx, args[1:], stdout, stderr)
	case "image":
		return runImage(ctx, args[1:], stdout, stderr)
	case "run":
		return runRun(ctx, args[1:], stdout, stderr, config.DevPath())
	case watchdogCommand:
		return runWatchdog(args[1:], stderr)
	case "exec":
		return runExec(ctx, args[1:], stdout, stderr, config.DevPath())
	case "snapshotter":
		return runSnapshotter(ctx, args[1:], stdout, stderr)
	case "monitor":
		return runMonitor(ctx, args[1:], stdout, stderr)
	case "cache":
		return runCache(ctx, args[1:], stdout, stderr)
	case "bench":
		return bench.Main(ctx, args[1:], stdout, stderr, config.DevPath())
	case "version", "--version":
		fmt.Fprintf(stdout, "kata-fsx %s\n", Version)
		return 0
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "kata-fsx: unknown command %q\n\n%s", args[0], usage)
	return 2
}
