package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
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

// TestEventually: a condition met late enough passes; one never met
// fails with its last reason.
func TestEventually(t *testing.T) {
	n := 0
	Eventually(t, 5*time.Second, func() (bool, error) { n++; return n == 3, nil })
	if n != 3 {
		t.Fatalf("condition asked %d times, want 3", n)
	}
	start := time.Now()
	err := Wait(50*time.Millisecond, func() (bool, error) { return false, fmt.Errorf("still %d", 7) })
	if err == nil || err.Error() != "still 7" {
		t.Fatalf("Wait: %v, want the condition's last error", err)
	}
	if el := time.Since(start); el < 50*time.Millisecond || el > 2*time.Second {
		t.Fatalf("Wait gave up after %v, want about 50ms", el)
	}
	if err := Wait(0, func() (bool, error) { return false, nil }); err == nil || err.Error() != "condition not met" {
		t.Fatalf("Wait with no reason: %v", err)
	}
}
