// Command containerd-shim-kata-fsx-v2 is the containerd shim v2 of kata-fsx
// (runtime type io.containerd.kata-fsx.v2).
package main

import (
	"os"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/shim"
)

func main() {
	os.Exit(shim.ShimMain(os.Args[1:], os.Stdout, os.Stderr, config.DevPath()))
}
