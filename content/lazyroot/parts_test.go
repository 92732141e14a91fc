package lazyroot

import (
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

// TestImageOptionsIndexBound: the registry table's max_index_mb reaches
// the lazyimage options every process of the node resolves images with.
func TestImageOptionsIndexBound(t *testing.T) {
	c := config.Default()
	if got := ImageOptions(ConfigOptions(c, nil)).MaxIndexBytes; got != 64<<20 {
		t.Errorf("default configuration: MaxIndexBytes %d, want 64 MiB", got)
	}
	c.KataFSX.Registry.MaxIndexMB = 3
	if got := ImageOptions(ConfigOptions(c, nil)).MaxIndexBytes; got != 3<<20 {
		t.Errorf("max_index_mb = 3: MaxIndexBytes %d, want 3 MiB", got)
	}
}
