package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestShimLinksOnlyWhatItRuns keeps the operator CLI, the benchmarks and
// their chart, font and progress-bar libraries out of the shim binary,
// which containerd starts once per pod.
func TestShimLinksOnlyWhatItRuns(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	forbidden := []string{
		"github.com/kata-fsx/kata-fsx/cli",
		"github.com/kata-fsx/kata-fsx/bench",
		"github.com/kata-fsx/kata-fsx/test/",
		"github.com/schollz/progressbar",
		"golang.org/x/image",
		"k8s.io/cri-api",
	}
	// The packages the shim needs must be there, or the list proves nothing.
	required := []string{
		"github.com/kata-fsx/kata-fsx/shim",
		"github.com/kata-fsx/kata-fsx/sandbox",
		"github.com/kata-fsx/kata-fsx/blk/vhostuser",
	}
	have := map[string]bool{}
	for _, d := range deps {
		have[d] = true
		for _, f := range forbidden {
			if d == f || strings.HasPrefix(d, strings.TrimSuffix(f, "/")+"/") {
				t.Errorf("the shim binary links %s", d)
			}
		}
	}
	for _, r := range required {
		if !have[r] {
			t.Errorf("the shim binary does not link %s: is this the shim?", r)
		}
	}
}
