// Command kata-fsx-overlay is the mount helper of the kata-fsx snapshotter's
// mounts of type fuse3.kata-fsx-overlay: mount.fuse3 runs it when
// containerd (or its runc shim) mounts a snapshot with remote layers, and
// it materializes those layers from the node's lazy store and mounts a
// plain overlay (package content/layerdir).
package main

import (
	"os"

	"github.com/kata-fsx/kata-fsx/content/layerdir"
)

func main() {
	os.Exit(layerdir.HelperMain(os.Args))
}
