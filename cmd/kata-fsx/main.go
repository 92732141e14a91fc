// Command kata-fsx is the operator CLI of the kata-fsx runtime.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/kata-fsx/kata-fsx/cli"
	"github.com/kata-fsx/kata-fsx/shim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	var code int
	// run and exec drive pods through the shim's own sandbox code, which
	// only the binaries may import; every other command lives in cli.
	switch {
	case len(os.Args) > 1 && os.Args[1] == "run":
		code = shim.RunCommand(ctx, os.Args[2:], os.Stdout, os.Stderr, cli.DevConfig())
	case len(os.Args) > 1 && os.Args[1] == "exec":
		code = shim.ExecCommand(ctx, os.Args[2:], os.Stdout, os.Stderr, cli.DevConfig())
	default:
		code = cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	}
	stop()
	os.Exit(code)
}
