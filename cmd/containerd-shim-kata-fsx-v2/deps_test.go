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
		"github.com/kata-fsx/kata-fsx/blk/vhostblk",
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

// TestOnlySandboxSpeaksAgent keeps the guest agent's protocol behind the
// sandbox: in the shim and CLI binaries, only the sandbox and the agent
// client import agent/protocols; the shim and CLI drive pods through the
// sandbox's own types, as Kata's shim holds a VCSandbox.
func TestOnlySandboxSpeaksAgent(t *testing.T) {
	const mod = "github.com/kata-fsx/kata-fsx/"
	out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, ".", "../kata-fsx").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	importers := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, imports := f[0], f[1:]
		for _, imp := range imports {
			if imp != mod+"agent/protocols" && imp != mod+"agent" {
				continue
			}
			rel := strings.TrimPrefix(pkg, mod)
			if rel == "sandbox" || strings.HasPrefix(rel, "sandbox/") || rel == "agent" || strings.HasPrefix(rel, "agent/") {
				importers++
				continue
			}
			t.Errorf("%s imports %s: only the sandbox speaks to the guest agent", pkg, imp)
		}
	}
	// The sandbox must be among them, or the list proves nothing.
	if importers == 0 {
		t.Error("no package imports the agent: is this the shim?")
	}
}
