// Package testenv decides what a test does when something it needs from
// the host (a tool, root, a guest kernel) is missing: on a developer's
// machine it skips, under the CI switch it fails, so a CI run whose
// packages did not install cannot pass by skipping. Eventually is how a
// test waits for a state: polled with a deadline, never a fixed sleep.
package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// EnvRequireAll is the CI switch: set to 1 (as .ci/run does), a missing
// prerequisite fails the test instead of skipping it.
const EnvRequireAll = "KATA_FSX_REQUIRE_ALL"

// Strict reports whether the CI switch is on.
func Strict() bool { return os.Getenv(EnvRequireAll) == "1" }

// Missing ends the test for a missing prerequisite: a skip, or a failure
// under the CI switch. The message should name the fix (the package).
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if Strict() {
		t.Fatalf("missing prerequisite ("+EnvRequireAll+"=1): "+format, args...)
	}
	t.Skipf(format, args...)
}

// Tool returns the path of name in PATH, or ends the test through Missing,
// naming the Debian package that provides it.
func Tool(t testing.TB, name, debPackage string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, "%s not installed (apt-get install %s): %v", name, debPackage, err)
	}
	return p
}

// Root ends the test through Missing unless it runs as root; why says
// what needs it.
func Root(t testing.TB, why string) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "%s needs root", why)
	}
}
