package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestParseGuestOutput(t *testing.T) {
	out := strings.Join([]string{
		"@@PHASE create a 1 1500000",
		"@@PHASE create b 1 2000000",
		"@@FIO randread b 1",
		"note: fio says something first",
		`{"jobs": [{"error": 0, "read": {"iops": 4100.5, "bw_bytes": 16795648}}]}`,
		"@@END 0",
		"@@DONE",
	}, "\n")
	got, err := parseGuestOutput(out)
	if err != nil {
		t.Fatal(err)
	}
	want := []sample{{"create", "a", 1, 1.5}, {"create", "b", 1, 2}, {"randread", "b", 1, 4100.5}}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("sample %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestParseGuestOutputErrors(t *testing.T) {
	for name, out := range map[string]string{
		"old phase format": "@@PHASE create 1 1500000\n@@DONE",
		"negative time":    "@@PHASE create a 1 -5\n@@DONE",
		"fio failed":       "@@FIO randread a 1\n{}\n@@END 1\n@@DONE",
		"unfinished":       "@@PHASE create a 1 10",
	} {
		if _, err := parseGuestOutput(out); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// TestScriptRotatesDisks runs the guest script's loop with the workloads
// left out and checks the disk order of each repetition: every disk takes
// every position once over as many repetitions as there are disks.
func TestScriptRotatesDisks(t *testing.T) {
	bash := testenv.Tool(t, "bash", "bash")
	// Only the order function, sourced from the real script.
	start := strings.Index(guestScript, "order() {")
	if start < 0 {
		t.Fatal("guest script has no order function")
	}
	line := guestScript[start : start+strings.Index(guestScript[start:], "\n")]
	script := filepath.Join(t.TempDir(), "order.sh")
	body := "DISKS=(a b c d); n=4\n" + line + "\nfor r in 1 2 3 4; do order $r; echo \"${ORDER[*]}\"; done\n"
	if err := os.WriteFile(script, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bash, script).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	want := "a b c d\nb c d a\nc d a b\nd a b c\n"
	if string(out) != want {
		t.Errorf("order per repetition:\n%s\nwant:\n%s", out, want)
	}
}

func TestGuestScriptParses(t *testing.T) {
	bash := testenv.Tool(t, "bash", "bash")
	cmd := exec.Command(bash, "-n")
	cmd.Stdin = strings.NewReader(guestScript)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("bash -n: %v: %s", err, out)
	}
}

// TestMarkdownLeftOutDisk: a disk left out with -backends reads "not run"
// in the table, a disk that produced nothing reads "failed".
func TestMarkdownLeftOutDisk(t *testing.T) {
	o := options{only: "seqread", reps: 1, files: 10, dirs: 1, fioMiB: 1, imageMiB: 1}
	res := []*backendResult{
		{Label: "(a) imagefs-blk", Samples: map[string][]float64{"seqread": {100}}},
		{Label: "(b) virtio-blk", Samples: map[string][]float64{"seqread": {100}}},
		{Label: "(c) qsd", Samples: map[string][]float64{}, Error: errNotBooted.Error()},
		{Label: "(d) writeback", Samples: map[string][]float64{}},
	}
	md := markdown(map[string]any{}, res, o, "", map[string]string{}, 1)
	var row string
	for _, l := range strings.Split(md, "\n") {
		if strings.HasPrefix(l, "| fio 128k seqread") {
			row = l
		}
	}
	if !strings.Contains(row, "| not run |") || !strings.Contains(row, "| failed |") {
		t.Errorf("seqread row %q: want c 'not run' and d 'failed'", row)
	}
}
