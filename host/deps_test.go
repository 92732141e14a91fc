package host

import (
	"os/exec"
	"strings"
	"testing"
)

// TestImportsNoConsumer keeps the probe below everyone who reads it: the
// shim, sandbox, the CLI and the benchmarks import host, never the reverse.
func TestImportsNoConsumer(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, d := range strings.Fields(string(out)) {
		for _, f := range []string{"sandbox", "shim", "cli", "bench"} {
			p := "github.com/kata-fsx/kata-fsx/" + f
			if d == p || strings.HasPrefix(d, p+"/") {
				t.Errorf("host imports %s", d)
			}
		}
	}
}
