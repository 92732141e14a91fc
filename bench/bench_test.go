package bench

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"
)

func TestParseRows(t *testing.T) {
	rows, err := ParseRows("host;virtio-fs:cache=always,threads=2,virtio-9p,imagefs-blk:agent=vsock,virtio-fs")
	if err != nil {
		t.Fatal(err)
	}
	var specs []string
	for _, r := range rows {
		specs = append(specs, r.Spec)
	}
	want := "host|virtio-fs:cache=always,threads=2|virtio-9p|imagefs-blk:agent=vsock|virtio-fs"
	if got := strings.Join(specs, "|"); got != want {
		t.Fatalf("rows %s, want %s", got, want)
	}
	if r := rows[1]; r.Cache != "always" || r.Threads != 2 {
		t.Fatalf("options not parsed: %+v", r)
	}
	if !rows[3].Vsock || rows[4].Cache != "auto" {
		t.Fatalf("agent or default cache: %+v %+v", rows[3], rows[4])
	}
	for _, bad := range []struct{ in, words string }{
		{"nfs", "unknown backend"},
		{"virtio-fs:cache=sometimes", "cache=sometimes"},
		{"virtio-fs:threads=0", "threads=0"},
		{"virtio-fs:dax=x", "dax=x"},
		{"imagefs-blk:cache=auto", "does not apply"},
		{"host:agent=vsock", "does not apply"},
		{"virtio-9p;virtio-9p", "listed twice"},
		{"virtio-fs:cache", "key=value"},
		{"", "empty"},
	} {
		if _, err := ParseRows(bad.in); err == nil || !strings.Contains(err.Error(), bad.words) {
			t.Errorf("ParseRows(%q) = %v, want an error with %q", bad.in, err, bad.words)
		}
	}
	for _, s := range DefaultBackends() {
		if _, err := ParseRow(s); err != nil {
			t.Errorf("default row %q: %v", s, err)
		}
	}
}

func TestSkipReasons(t *testing.T) {
	h := HostCaps{Root: true, Virtiofsd: "/usr/lib/qemu/virtiofsd", QEMUVersion: "QEMU emulator version 7.2.22"}
	dax, _ := ParseRow("virtio-fs:cache=auto,dax=1024")
	if why := dax.SkipReason(h); !strings.Contains(why, "not supported by this QEMU") {
		t.Fatalf("DAX without cache-size: %q", why)
	}
	h.DAX = true
	if why := dax.SkipReason(h); why != "" {
		t.Fatalf("DAX with cache-size skipped: %q", why)
	}
	vs, _ := ParseRow("imagefs-blk:agent=vsock")
	if why := vs.SkipReason(h); !strings.Contains(why, "/dev/vhost-vsock") {
		t.Fatalf("vsock without the device: %q", why)
	}
	h.VhostVsock = true
	if why := vs.SkipReason(h); !strings.Contains(why, "not wired") {
		t.Fatalf("vsock with the device: %q", why)
	}
	vfs, _ := ParseRow("virtio-fs")
	if why := vfs.SkipReason(HostCaps{Root: true}); !strings.Contains(why, "virtiofsd") {
		t.Fatalf("virtio-fs without a daemon: %q", why)
	}
	if why := vfs.SkipReason(HostCaps{}); !strings.Contains(why, "root") {
		t.Fatalf("non-root: %q", why)
	}
}

func TestParseOutput(t *testing.T) {
	out := `noise
@@START 1700000000000000
@@INFO fio_mode libaio direct=1
@@RESULT chown 1 1.500000 s
@@RESULT chown 2 0.500000 s
@@RESULT chown 3 1.000000 s
@@RESULT fio-randread 1 1234 IOPS
@@FAIL dbench 1 exit status 1: dbench: command not found
@@DONE
`
	o, err := ParseOutput(out)
	if err != nil {
		t.Fatal(err)
	}
	if !o.Started || !o.Done || o.Info["fio_mode"] != "libaio direct=1" || len(o.Failures["dbench"]) != 1 {
		t.Fatalf("parsed %+v", o)
	}
	st, ok := Summarize(o.Samples["chown"])
	if !ok || st.Median != 1 || st.Min != 0.5 || st.Max != 1.5 || st.N != 3 {
		t.Fatalf("chown stats %+v", st)
	}
	for _, bad := range []string{
		"@@RESULT chown 1 x s",
		"@@RESULT chown 1 -1 s",
		"@@RESULT chown 1 NaN s",
		"@@RESULT chown 1 1 furlongs",
		"@@RESULT chown one 1 s",
		"@@RESULT chown 1 1",
		"@@RESULT chown 1 1 s\n@@RESULT chown 2 1 IOPS",
		"@@FAIL chown",
		"@@INFO",
	} {
		if _, err := ParseOutput(bad); err == nil {
			t.Errorf("ParseOutput(%q) accepted", bad)
		}
	}
}

func TestSpeedup(t *testing.T) {
	secs := Workload{Unit: "s"}
	iops := Workload{Unit: "IOPS"}
	if got := Speedup(secs, 1, 8); got != 8 {
		t.Fatalf("1 s vs 8 s = %v, want 8", got)
	}
	if got := Speedup(iops, 50, 100); got != 0.5 {
		t.Fatalf("50 vs 100 IOPS = %v", got)
	}
	if !math.IsNaN(Speedup(secs, 0, 1)) {
		t.Fatal("zero time gave a ratio")
	}
	if st, ok := Summarize([]float64{4, 1, 3, 2}); !ok || st.Median != 2.5 {
		t.Fatalf("even median %+v", st)
	}
	if _, ok := Summarize(nil); ok {
		t.Fatal("no samples summarised")
	}
}

// TestTargets checks the verdicts on a report with known numbers.
func TestTargets(t *testing.T) {
	row := func(spec, kind string, v map[string][]float64) *RowResult {
		return &RowResult{Spec: spec, Kind: kind, Output: &Output{Samples: v, Info: map[string]string{}, Failures: map[string][]string{}}}
	}
	rep := &Report{Host: map[string]string{"accel": "tcg"}, Rows: []*RowResult{
		row("host", KindHost, map[string][]float64{"chown": {0.01}}),
		row("virtio-fs:cache=never", KindVirtioFS, map[string][]float64{"chown": {20}, "install": {30}, "stat": {4}}),
		row("virtio-fs:cache=auto", KindVirtioFS, map[string][]float64{"chown": {10}, "install": {40}, "stat": {3}}),
		row("imagefs-blk", KindImagefsBlk, map[string][]float64{"chown": {1}, "install": {5}, "stat": {1}, "fio-seqread": {90}}),
		row("virtio-blk", KindVirtioBlk, map[string][]float64{"chown": {1.2}, "fio-seqread": {100}}),
		{Spec: "virtio-fs:cache=auto,dax=1024", Kind: KindVirtioFS, Skipped: "DAX not supported by this QEMU"},
	}}
	md := Markdown(rep, Options{Baseline: "virtio-fs:cache=auto", Reps: 1, OutJSON: "x.json"}, map[string]string{})
	for _, want := range []string{
		"| chown -R node_modules ≥ 8x the best virtio-fs row | 10.0x (1.00 s vs 10.0 s on `virtio-fs:cache=auto`) | yes |",
		"| install: extract node_modules tarball ≥ 8x the best virtio-fs row | 6.0x (5.00 s vs 30.0 s on `virtio-fs:cache=never`) | **no** |",
		"| stat every entry of node_modules ≥ 2x the best virtio-fs row | 3.0x",
		"| fio 128k sequential read ≥ 0.9x raw virtio-blk | 0.90x | yes |",
		"| chown -R node_modules ≥ 0.9x raw virtio-blk | 1.20x | yes |",
		"Met 4 of 5.",
		"**skipped**: DAX not supported by this QEMU",
		"host (reference, not comparable under TCG)",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
}

func FuzzParseOutput(f *testing.F) {
	f.Add("@@START 1\n@@RESULT a 1 2.5 s\n@@FAIL b 1 oops\n@@INFO k v w\n@@DONE\n")
	f.Add("@@RESULT a 1 1e308 MB/s\n@@RESULT a 2 0 MB/s")
	f.Add("@@\n@@RESULT\n")
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseOutput(s)
		if err != nil {
			return
		}
		for w, v := range o.Samples {
			for _, x := range v {
				if math.IsNaN(x) || math.IsInf(x, 0) || x < 0 {
					t.Fatalf("%s: accepted %v", w, x)
				}
			}
			if _, ok := Summarize(v); !ok {
				t.Fatalf("%s: samples without a summary", w)
			}
		}
	})
}

func TestStallWatch(t *testing.T) {
	d := &driver{o: Options{StallTimeout: 100 * time.Millisecond}}
	ctx, w := d.watchdog(context.Background(), true)
	w.Write([]byte("@@RESULT chown 1 1.0 s\n"))
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a silent boot was never stopped")
	}
	if why := w.reason(); !strings.Contains(why, "no progress") || !strings.Contains(why, "@@RESULT chown 1") {
		t.Fatalf("reason %q", why)
	}
	w.stop()

	// Off for the cold-start boots: nothing fires.
	ctx, w = d.watchdog(context.Background(), false)
	time.Sleep(300 * time.Millisecond)
	if ctx.Err() != nil || w.reason() != "" {
		t.Fatalf("disabled watchdog fired: %v %q", ctx.Err(), w.reason())
	}
	w.stop()
	if ctx.Err() == nil {
		t.Fatal("stop did not release the boot's context")
	}
}

func TestUnfinishedAndMerge(t *testing.T) {
	d := &driver{o: Options{Reps: 2}}
	first, err := ParseOutput("@@RESULT chown 1 1 s\n@@RESULT chown 2 1 s\n@@RESULT stat 1 2 s\n@@FAIL dbench 1 no dbench\n@@INFO fio_mode psync\n")
	if err != nil {
		t.Fatal(err)
	}
	rest := d.unfinished(first, "chown,stat,dbench,find,rg", "no progress for 3m")
	// stat was running when the guest hung: charged with it, not retried.
	if strings.Join(rest, ",") != "find,rg" {
		t.Fatalf("unfinished = %v, want find,rg", rest)
	}
	if f := first.Failures["stat"]; len(f) != 1 || !strings.Contains(f[0], "rep 2: no progress") {
		t.Fatalf("hung workload not charged: %v", first.Failures)
	}
	if rest := d.unfinished(first, "chown,stat,dbench,find,rg", "again"); strings.Join(rest, ",") != "find,rg" {
		t.Fatalf("second call charged another workload: %v", rest)
	}
	second, _ := ParseOutput("@@RESULT stat 1 3 s\n@@RESULT stat 2 4 s\n@@RESULT find 1 1 s\n@@RESULT find 2 1 s\n@@INFO fio_mode libaio\n@@DONE\n")
	m := merge(first, second)
	if len(m.Samples["stat"]) != 3 || len(m.Samples["chown"]) != 2 || len(m.Samples["find"]) != 2 || !m.Done {
		t.Fatalf("merged %+v", m)
	}
	if m.Info["fio_mode"] != "psync" || len(m.Failures["dbench"]) != 1 {
		t.Fatalf("merged info/failures %+v", m)
	}
	if merge(nil, second) != second || merge(first, nil) != first {
		t.Fatal("merge with nil")
	}
}
