package bench

import (
	"maps"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/metrics"
)

// straceSummary is strace 6.1's -c table as it wrote it for a kata-fsx run
// process here (trimmed), errors column blank on most rows.
const straceSummary = `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ------------------
 33.36    0.033655         611        55           ppoll
 28.45    0.028702         105       273         3 futex
 14.68    0.014809          23       618           nanosleep
  2.09    0.002113          44        47           preadv
  0.73    0.000736           8        83         7 read
  0.04    0.000037           9         4           openat2
------ ----------- ----------- --------- --------- ------------------
100.00    0.100898          80      1080        10 total
`

func TestParseStraceSummary(t *testing.T) {
	got, err := ParseStraceSummary(straceSummary)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"ppoll": 55, "futex": 273, "nanosleep": 618, "preadv": 47, "read": 83, "openat2": 4}
	if !maps.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if c := (Counts{Syscalls: got}); c.SyscallTotal() != 1080 {
		t.Errorf("total %d, want 1080", c.SyscallTotal())
	}
	// strace's messages before the table are not rows.
	if _, err := ParseStraceSummary("strace: Process 12 detached\n" + straceSummary); err != nil {
		t.Errorf("with a leading message: %v", err)
	}
	// A process that made no calls: strace prints the header and a zero total.
	empty := "% time     seconds  usecs/call     calls    errors syscall\n------ ----------- ----------- --------- --------- ----------------\n------ ----------- ----------- --------- --------- ----------------\n100.00    0.000000           0         0           total\n"
	if m, err := ParseStraceSummary(empty); err != nil || len(m) != 0 {
		t.Errorf("empty table: %v, %v", m, err)
	}
	bad := map[string]string{
		"truncated (no total)": straceSummary[:strings.Index(straceSummary, " 14.68")],
		"total disagrees":      strings.Replace(straceSummary, "1080", "1081", 1),
		"not a table":          "strace: attach: ptrace(PTRACE_SEIZE, 1): Operation not permitted\n",
		"garbled calls":        strings.Replace(straceSummary, "618", "6x8", 1),
		"duplicate name":       strings.Replace(straceSummary, "openat2", "preadv", 1),
		"negative":             strings.Replace(straceSummary, "       4           openat2", "      -4           openat2", 1),
		"empty":                "",
	}
	for name, text := range bad {
		if m, err := ParseStraceSummary(text); err == nil {
			t.Errorf("%s: parsed as %v, want an error", name, m)
		}
	}
}

// FuzzParseStraceSummary: any text either parses into non-negative counts
// that add up to its total line, or is an error; nothing panics.
func FuzzParseStraceSummary(f *testing.F) {
	f.Add(straceSummary)
	f.Add("")
	f.Add("% time\n------\n------\n1 2 3 0 total\n")
	f.Add(strings.Replace(straceSummary, "futex", "fu tex", 1))
	f.Fuzz(func(t *testing.T, text string) {
		m, err := ParseStraceSummary(text)
		if err != nil {
			return
		}
		for k, v := range m {
			if v < 0 || !validSyscallName(k) {
				t.Fatalf("bad entry %q %d", k, v)
			}
		}
		if len(m) > maxSyscallNames {
			t.Fatalf("%d names", len(m))
		}
	})
}

// A diskstats of the guest (Linux 6.x, 20 fields): only whole disks count,
// completed requests by operation.
const diskstats = ` 254       0 vda 198 457 16106 191 7 3 80 9 0 168 204 0 0 0 0 3 4
 254       1 vda1 150 0 12000 100 5 0 40 5 0 100 100 0 0 0 0 0 0
   7       0 loop0 5 0 10 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 259       0 pmem0 10 0 80 1 0 0 0 0 0 1 1
`

func TestParseDiskstats(t *testing.T) {
	got, err := ParseDiskstats(diskstats)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"read": 208, "write": 7, "flush": 3}
	if !maps.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := ParseDiskstats(" 254 0 vda 1 2 3\n"); err == nil {
		t.Error("short line parsed")
	}
	if _, err := ParseDiskstats(strings.Replace(diskstats, "198", "x", 1)); err == nil {
		t.Error("garbled count parsed")
	}
}

func TestParseStepOutput(t *testing.T) {
	after := strings.Replace(diskstats, " 198 ", " 250 ", 1)
	out := "@@BEFORE\n" + diskstats + "@@AFTER\n" + after + "@@RC 0\n"
	b, a, rc, err := ParseStepOutput(out)
	if err != nil || rc != 0 {
		t.Fatalf("rc %d, %v", rc, err)
	}
	if d := minus(a, b); !maps.Equal(d, map[string]int64{"read": 52}) {
		t.Errorf("delta %v, want read 52", d)
	}
	if _, _, _, err := ParseStepOutput("@@AFTER\n@@BEFORE\n@@RC 0\n"); err == nil {
		t.Error("markers out of order parsed")
	}
	if _, _, rc, err := ParseStepOutput("@@BEFORE\n@@AFTER\n@@RC 1\nchown: Operation not permitted\n"); err != nil || rc != 1 {
		t.Errorf("failed step: rc %d, %v", rc, err)
	}
}

func FuzzParseStepOutput(f *testing.F) {
	f.Add("@@BEFORE\n" + diskstats + "@@AFTER\n" + diskstats + "@@RC 0\n")
	f.Add("@@BEFORE\n@@AFTER\n@@RC x")
	f.Fuzz(func(t *testing.T, out string) {
		b, a, _, err := ParseStepOutput(out)
		if err != nil {
			return
		}
		for _, m := range []map[string]int64{a, b} {
			for k, v := range m {
				if v <= 0 {
					t.Fatalf("%s %d kept", k, v)
				}
			}
		}
	})
}

func TestCountFUSERequests(t *testing.T) {
	// Lines as strace -e trace=write -s 256 shows virtiofsd -d's log.
	trace := `1234  write(2, "[2026-12-03 16:40:01.123456+0000] [ID: 00000012] unique: 4, opcode: LOOKUP (1), nodeid: 1, insize: 46, pid: 310\n", 110) = 110
1234  write(2, "[2026-12-03 16:40:01.123500+0000] [ID: 00000012]    unique: 4, success, outsize: 144\n", 84) = 84
1235  write(2, "[2026-12-03 16:40:01.124000+0000] [ID: 00000013] unique: 6, opcode: SETATTR (4), nodeid: 7, insize: 128, pid: 310\n", 112) = 112
1235  write(2, "[2026-12-03 16:40:01.124100+0000] [ID: 00000013] lo_setattr(ino=7)\n", 60) = 60
1234  write(2, "[ID: 00000012] unique: 8, opcode: LOOKUP (1), nodeid: 7, insize: 48, pid: 310\n"..., 120) = 120
`
	got := CountFUSERequests(trace)
	if want := map[string]int64{"LOOKUP": 2, "SETATTR": 1}; !maps.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// TestCountsMinus: the baseline comes off name by name; a name the
// baseline made more of goes negative instead of vanishing, so the total
// stays the difference of the totals.
func TestCountsMinus(t *testing.T) {
	w := Counts{Syscalls: map[string]int64{"preadv": 900, "futex": 40, "ppoll": 10}, Requests: map[string]int64{"read": 880}}
	b := Counts{Syscalls: map[string]int64{"futex": 30, "ppoll": 25, "close": 2}, Requests: map[string]int64{"read": 1}}
	n := w.Minus(b)
	if want := map[string]int64{"preadv": 900, "futex": 10, "ppoll": -15, "close": -2}; !maps.Equal(n.Syscalls, want) {
		t.Errorf("syscalls %v, want %v", n.Syscalls, want)
	}
	if n.SyscallTotal() != w.SyscallTotal()-b.SyscallTotal() {
		t.Errorf("net total %d, want %d", n.SyscallTotal(), w.SyscallTotal()-b.SyscallTotal())
	}
	if n.RequestTotal() != 879 {
		t.Errorf("net requests %d, want 879", n.RequestTotal())
	}
}

// TestHostCostMarkdown: the table has a row per workload (not the
// baseline) and a column per counted backend; 9p's requests read "n/c",
// a failed step "failed", and skipped rows are listed, not tabled.
func TestHostCostMarkdown(t *testing.T) {
	steps := []HostCostStep{{Name: baselineStep, Cmd: "true"}, {Name: "chown", Cmd: "chown -R"}, {Name: "stat", Cmd: "stat"}}
	raw := func(req, sc int64) Counts {
		return Counts{Requests: map[string]int64{"read": req}, Syscalls: map[string]int64{"preadv": sc}}
	}
	fs := &HostCostRow{Spec: "virtio-fs:cache=auto", Kind: KindVirtioFS, Serving: "virtiofsd", Requests: requestSource(KindVirtioFS),
		Raw: map[string]Counts{baselineStep: raw(10, 100), "chown": raw(16010, 40100)}, Failed: map[string]string{"stat": "exec failed"}}
	p9 := &HostCostRow{Spec: "virtio-9p", Kind: KindVirtio9P, Serving: "qemu", Requests: "not counted",
		Raw: map[string]Counts{baselineStep: {Syscalls: map[string]int64{"ppoll": 50}}, "chown": {Syscalls: map[string]int64{"ppoll": 50, "fchownat": 7786}}, "stat": {Syscalls: map[string]int64{"ppoll": 1050}}}}
	for _, r := range []*HostCostRow{fs, p9} {
		r.Net = map[string]Counts{}
		for k, c := range r.Raw {
			if k != baselineStep {
				r.Net[k] = c.Minus(r.Raw[baselineStep])
			}
		}
	}
	rep := &HostCostReport{Command: "kata-fsx bench --hostcost", Host: map[string]string{"cpus": "2", "accel": "tcg"}, Steps: steps,
		Rows: []*HostCostRow{fs, p9, {Spec: "host", Kind: KindHost, Skipped: "no VM"}}}
	md := HostCostMarkdown(rep, "docs/bench/hostcost.json")
	for _, want := range []string{
		"| workload | virtio-fs:cache=auto | virtio-9p |\n|---|---:|---:|\n",
		"| chown | 16,000 / 40,000 / 40,000 | n/c / 7,786 / 7,786 |\n",
		"| stat | failed | n/c / 1,000 / 0 |\n",
		"- host: skipped: no VM\n",
		"- virtio-fs:cache=auto, stat: **failed**: exec failed\n",
		"| chown | read 16,000 | not counted |\n",
		"| chown | preadv 40,000 | fchownat 7,786 |\n",
		"[hostcost.json](bench/hostcost.json)",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	if strings.Contains(md, "| baseline |") {
		t.Errorf("the baseline has a row of its own:\n%s", md)
	}
}

func TestNum(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 999: "999", 1000: "1,000", 1234567: "1,234,567", -15: "−15", -1500: "−1,500"} {
		if got := num(n); got != want {
			t.Errorf("num(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestHostCostSteps: --only picks workloads and the baseline always runs;
// a name the pass does not have is an error, not an empty run.
func TestHostCostSteps(t *testing.T) {
	d := &driver{o: Options{Only: "chown, seqread"}}
	steps, err := d.hostCostSteps()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, st := range steps {
		names = append(names, st.Name)
	}
	if got := strings.Join(names, ","); got != "baseline,chown,seqread" {
		t.Errorf("steps %s, want baseline,chown,seqread", got)
	}
	d.o.Only = ""
	if all, _ := d.hostCostSteps(); len(all) != len(HostCostSteps()) {
		t.Errorf("no --only: %d steps, want all %d", len(all), len(HostCostSteps()))
	}
	d.o.Only = "chown,dbench"
	if _, err := d.hostCostSteps(); err == nil || !strings.Contains(err.Error(), "dbench") {
		t.Errorf("unknown workload: %v", err)
	}
}

// TestRequestsByOp: the imagefs-blk server's counter family, as its
// metrics socket serves it, becomes requests by operation.
func TestRequestsByOp(t *testing.T) {
	text := `# HELP kata_fsx_imagefs_blk_requests_total Virtio-blk requests.
# TYPE kata_fsx_imagefs_blk_requests_total counter
kata_fsx_imagefs_blk_requests_total{sandbox_id="p",op="read"} 1097
kata_fsx_imagefs_blk_requests_total{sandbox_id="p",op="write"} 83
kata_fsx_imagefs_blk_requests_total{sandbox_id="p",op="flush"} 2
kata_fsx_imagefs_blk_requests_total{sandbox_id="p",op="discard"} 0
# TYPE kata_fsx_imagefs_blk_errors_total counter
kata_fsx_imagefs_blk_errors_total{sandbox_id="p",op="read"} 5
`
	fams, err := metrics.Parse(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	got, err := RequestsByOp(fams, "kata_fsx_imagefs_blk_requests_total")
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]int64{"read": 1097, "write": 83, "flush": 2, "discard": 0}; !maps.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := RequestsByOp(fams, "kata_fsx_missing_total"); err == nil {
		t.Error("a missing family gave no error")
	}
}
