package testenv

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestMissingFailsUnderSwitch runs a child test with and without the
// switch and checks that the same missing tool skips, then fails.
func TestMissingFailsUnderSwitch(t *testing.T) {
	if os.Getenv("TESTENV_CHILD") == "1" {
		Tool(t, "kata-fsx-no-such-tool", "nothing")
		t.Fatal("Tool returned for a missing tool")
	}
	for _, tc := range []struct {
		strict   string
		wantFail bool
		wantText string
	}{
		{"", false, "--- SKIP"},
		{"1", true, "--- FAIL"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMissingFailsUnderSwitch$", "-test.v")
		cmd.Env = append(os.Environ(), "TESTENV_CHILD=1", EnvRequireAll+"="+tc.strict)
		out, err := cmd.CombinedOutput()
		if failed := err != nil; failed != tc.wantFail {
			t.Errorf("%s=%q: child failed=%v, want %v\n%s", EnvRequireAll, tc.strict, failed, tc.wantFail, out)
		}
		if !strings.Contains(string(out), tc.wantText) || !strings.Contains(string(out), "apt-get install nothing") {
			t.Errorf("%s=%q: want %q and the package named in:\n%s", EnvRequireAll, tc.strict, tc.wantText, out)
		}
	}
}
