// Command kata-fsx is the operator CLI of the kata-fsx runtime.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/kata-fsx/kata-fsx/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
