package sandbox

import (
	"io"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// LazyRootfs is a container image whose file data arrives on demand (a
// registry: image behind the node's lazy content store).
type LazyRootfs interface {
	// Opener reads the image's file data for the disk.
	Opener() index.Opener
	// Started tells the store the container's process runs: the start of
	// its prefetch trace window and of the background fill.
	Started()
	io.Closer
}
