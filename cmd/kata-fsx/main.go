// Command kata-fsx is the operator CLI of the kata-fsx runtime.
package main

import (
	"os"

	"github.com/kata-fsx/kata-fsx/cli"
)

func main() {
	os.Exit(cli.Run(os.Args[1:], os.Stdout, os.Stderr))
}
