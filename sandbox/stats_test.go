package sandbox

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestSampleCoversDescendants checks that a sample sums the process tree,
// as the C virtiofsd serves from a forked child.
func TestSampleCoversDescendants(t *testing.T) {
	// The child reads 4 MiB, then both idle until killed.
	cmd := exec.Command("/bin/sh", "-c", "sh -c 'head -c 4194304 /dev/zero > /dev/null; exec sleep 60' & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	var ps ProcessSample
	testenv.Eventually(t, 10*time.Second, func() (bool, error) {
		ps = ProcessSample{ProcessRef: ProcessRef{Role: "test", PID: cmd.Process.Pid, WithChildren: true}}
		if err := ps.read(); err != nil {
			t.Fatal(err)
		}
		return ps.Processes >= 2 && ps.RChar >= 4<<20, fmt.Errorf("sample never covered the child's reads: %+v", ps)
	})
	if ps.RSSKiB == 0 || ps.HWMKiB < ps.RSSKiB || ps.AnonKiB == 0 || ps.AnonKiB > ps.RSSKiB {
		t.Fatalf("memory counters: %+v", ps)
	}
	alone := ProcessSample{ProcessRef: ProcessRef{Role: "test", PID: cmd.Process.Pid}}
	if err := alone.read(); err != nil || alone.Processes != 1 || alone.RChar >= ps.RChar {
		t.Fatalf("a sample without children counted them: %+v (with children %+v) %v", alone, ps, err)
	}
	gone := ProcessSample{ProcessRef: ProcessRef{PID: 1 << 30}}
	if err := gone.read(); err == nil || !strings.Contains(err.Error(), "/proc/") {
		t.Fatalf("sample of a missing process: %v", err)
	}
}
