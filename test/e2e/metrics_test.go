package e2e

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// scrape GETs /metrics with the real curl, from a unix socket (sock) or
// a URL, and parses the exposition with the Prometheus project's parser.
func scrape(ctx context.Context, t *testing.T, sock, url string) map[string]*dto.MetricFamily {
	t.Helper()
	curl := testenv.Tool(t, "curl", "curl")
	args := []string{"-sS", "--fail", "--max-time", "60"}
	if sock != "" {
		args = append(args, "--unix-socket", sock, "http://localhost/metrics")
	} else {
		args = append(args, url)
	}
	out, err := exec.CommandContext(ctx, curl, args...).Output()
	if err != nil {
		t.Fatalf("curl %v: %v", args, err)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(out)))
	if err != nil {
		t.Fatalf("parse the exposition: %v\n%s", err, out)
	}
	return fams
}

// sampleValue is the value of family name's series whose labels include
// want (counter, gauge or untyped; a histogram's sample count).
func sampleValue(t *testing.T, fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	t.Helper()
	f := fams[name]
	if f == nil {
		t.Fatalf("no family %s", name)
	}
	for _, m := range f.Metric {
		ok := 0
		for _, l := range m.Label {
			if v, found := want[l.GetName()]; found && v == l.GetValue() {
				ok++
			}
		}
		if ok != len(want) {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		case m.Untyped != nil:
			return m.Untyped.GetValue()
		}
	}
	t.Fatalf("no series %s%v", name, want)
	return 0
}

// checkFamilies asserts each family exists with its type and a help line.
func checkFamilies(t *testing.T, fams map[string]*dto.MetricFamily, want map[string]dto.MetricType) {
	t.Helper()
	for name, typ := range want {
		f := fams[name]
		if f == nil {
			t.Errorf("family %s missing", name)
			continue
		}
		if f.GetType() != typ || f.GetHelp() == "" {
			t.Errorf("family %s: type %v help %q, want %v with help", name, f.GetType(), f.GetHelp(), typ)
		}
	}
}

// removePod kills a pod's task, waits for it to stop and deletes the
// task and the container; a pod already gone is left alone.
func (ce *containerdEnv) removePod(ctx context.Context, id string) {
	ce.t.Helper()
	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
	for ctx.Err() == nil {
		st := ""
		for _, l := range strings.Split(ce.ctr(ctx, "tasks", "ls").stdout, "\n") {
			if f := strings.Fields(l); len(f) >= 3 && f[0] == id {
				st = f[2]
			}
		}
		if st == "" || st == "STOPPED" {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	ce.ctr(ctx, "tasks", "delete", id)
	ce.ctr(ctx, "containers", "delete", id)
}

// TestMetricsImagefsBlk runs a workload of known size in an imagefs-blk
// pod started through containerd and the shim, and checks with curl on
// the pod's shim-monitor.sock that the read and write counters moved by
// at least the workload's bytes, that the latency histograms are whole,
// and that kata-fsx monitor serves the same series with sandbox_id.
func TestMetricsImagefsBlk(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	const id = "metricsblk"
	ce.startLongRunning(ctx, t, id, "imagefs-blk")
	defer ce.removePod(ctx, id)
	sock := sandbox.MetricsSocket(filepath.Join(ce.stateDir, id))
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("the pod's metrics socket: %v\n%s", err, ce.logTail(3000))
	}

	before := scrape(ctx, t, sock, "")
	c := map[string]string{"container": id}
	op := func(o string) map[string]string { return map[string]string{"container": id, "op": o} }
	readsBefore := sampleValue(t, before, "kata_fsx_imagefs_blk_bytes_total", op("read"))
	writesBefore := sampleValue(t, before, "kata_fsx_imagefs_blk_bytes_total", op("write"))
	flushesBefore := sampleValue(t, before, "kata_fsx_imagefs_blk_requests_total", op("flush"))
	readReqsBefore := sampleValue(t, before, "kata_fsx_imagefs_blk_requests_total", op("read"))
	if readReqsBefore == 0 {
		t.Errorf("a booted pod's disk served no reads")
	}

	// The workload: read the image's busybox binary with O_DIRECT (the
	// guest's page cache cannot answer it) and write 1 MiB the same way,
	// then sync.
	bb, err := os.Stat("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	const writeBytes = 256 * 4096
	wantRead := float64(bb.Size() / 4096 * 4096)
	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "work", id, "/bin/sh", "-c",
		"dd if=/bin/busybox of=/dev/null bs=4096 iflag=direct && dd if=/dev/zero of=/metrics.bin bs=4096 count=256 oflag=direct && sync")
	if r.code != 0 {
		t.Fatalf("workload: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}

	after := scrape(ctx, t, sock, "")
	checkFamilies(t, after, map[string]dto.MetricType{
		"kata_fsx_imagefs_blk_requests_total":           dto.MetricType_COUNTER,
		"kata_fsx_imagefs_blk_bytes_total":              dto.MetricType_COUNTER,
		"kata_fsx_imagefs_blk_errors_total":             dto.MetricType_COUNTER,
		"kata_fsx_imagefs_blk_request_duration_seconds": dto.MetricType_HISTOGRAM,
		"kata_fsx_overlay_dirty_bytes":                  dto.MetricType_GAUGE,
		"kata_fsx_imagefs_blk_build_seconds":            dto.MetricType_GAUGE,
		"kata_fsx_sandbox_info":                         dto.MetricType_GAUGE,
		"kata_hypervisor_io_stat":                       dto.MetricType_GAUGE,
		"kata_hypervisor_proc_status":                   dto.MetricType_GAUGE,
		"kata_hypervisor_threads":                       dto.MetricType_GAUGE,
		"kata_shim_io_stat":                             dto.MetricType_GAUGE,
		"kata_shim_fds":                                 dto.MetricType_GAUGE,
	})
	if got := after["kata_fsx_imagefs_blk_requests_total"].GetHelp(); !strings.Contains(got, "by operation") {
		t.Errorf("requests help %q", got)
	}
	readDelta := sampleValue(t, after, "kata_fsx_imagefs_blk_bytes_total", op("read")) - readsBefore
	writeDelta := sampleValue(t, after, "kata_fsx_imagefs_blk_bytes_total", op("write")) - writesBefore
	flushDelta := sampleValue(t, after, "kata_fsx_imagefs_blk_requests_total", op("flush")) - flushesBefore
	t.Logf("workload: read %d bytes, wrote %d; counters moved by read %.0f bytes, write %.0f bytes, %v flushes",
		bb.Size(), writeBytes, readDelta, writeDelta, flushDelta)
	if readDelta < wantRead {
		t.Errorf("read bytes moved by %.0f, want at least %.0f", readDelta, wantRead)
	}
	if writeDelta < writeBytes {
		t.Errorf("write bytes moved by %.0f, want at least %d", writeDelta, writeBytes)
	}
	if flushDelta < 1 {
		t.Errorf("sync sent no flush (moved by %v)", flushDelta)
	}
	if reqs := sampleValue(t, after, "kata_fsx_imagefs_blk_requests_total", op("read")); reqs-readReqsBefore < wantRead/float64(32<<20) {
		t.Errorf("read requests moved by %v", reqs-readReqsBefore)
	}
	// The histograms hold every request: count == requests, cumulative
	// buckets ending at the count.
	for _, o := range []string{"read", "write", "flush"} {
		n := sampleValue(t, after, "kata_fsx_imagefs_blk_requests_total", op(o))
		if h := sampleValue(t, after, "kata_fsx_imagefs_blk_request_duration_seconds", op(o)); h < n {
			t.Errorf("%s: histogram counts %v requests, counter %v", o, h, n)
		}
	}
	for _, m := range after["kata_fsx_imagefs_blk_request_duration_seconds"].Metric {
		prev := uint64(0)
		for _, b := range m.Histogram.Bucket {
			if b.GetCumulativeCount() < prev {
				t.Errorf("buckets not cumulative: %v", m.Histogram.Bucket)
			}
			prev = b.GetCumulativeCount()
		}
	}
	if dirty := sampleValue(t, after, "kata_fsx_overlay_dirty_bytes", c); dirty < writeBytes {
		t.Errorf("overlay dirty bytes %v after writing %d", dirty, writeBytes)
	}
	rss := map[string]string{"item": "rssanon"}
	t.Logf("the shim (the disk's server) holds %.2f MiB of private memory (kata_shim_proc_status rssanon) at the first scrape, %.2f MiB at the second, after the workload",
		sampleValue(t, before, "kata_shim_proc_status", rss)/(1<<20), sampleValue(t, after, "kata_shim_proc_status", rss)/(1<<20))
	if errs := sampleValue(t, after, "kata_fsx_imagefs_blk_errors_total", op("read")); errs != 0 {
		t.Errorf("read errors %v", errs)
	}

	// kata-fsx monitor serves the pod's series with its sandbox_id.
	mctx, mcancel := context.WithCancel(ctx)
	mon := exec.CommandContext(mctx, kataFSX(t), "monitor", "--listen", "127.0.0.1:0", "--state-dir", ce.stateDir)
	out, err := mon.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var monErr strings.Builder
	mon.Stderr = &monErr
	if err := mon.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		mcancel()
		mon.Wait()
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("monitor printed no address: %v", err)
	}
	url := strings.Fields(strings.TrimPrefix(line, "kata-fsx monitor: serving "))[0]
	agg := scrape(ctx, t, "", url)
	withID := map[string]string{"sandbox_id": id, "container": id, "op": "write"}
	if got := sampleValue(t, agg, "kata_fsx_imagefs_blk_bytes_total", withID); got < writesBefore+writeBytes {
		t.Errorf("monitor: write bytes %v, want at least %v", got, writesBefore+writeBytes)
	}
	if got := sampleValue(t, agg, "kata_monitor_running_shim_count", nil); got != 1 {
		t.Errorf("monitor: running shims %v, want 1", got)
	}
	checkFamilies(t, agg, map[string]dto.MetricType{
		"kata_fsx_imagefs_blk_request_duration_seconds": dto.MetricType_HISTOGRAM,
		"kata_monitor_scrape_count":                     dto.MetricType_COUNTER,
	})
	for _, m := range agg["kata_hypervisor_threads"].GetMetric() {
		if len(m.Label) == 0 || m.Label[0].GetName() != "sandbox_id" || m.Label[0].GetValue() != id {
			t.Errorf("monitor: series without sandbox_id=%s: %v", id, m)
		}
	}

	// Teardown removes the socket with the sandbox.
	ce.removePod(ctx, id)
	for ctx.Err() == nil {
		if _, err := os.Stat(sock); os.IsNotExist(err) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("metrics socket after the pod's teardown: %v", err)
	}
}

// TestMetricsVirtioFS writes 1 MiB in a virtio-fs pod and checks that
// virtiofsd's process I/O, in Kata's kata_virtiofsd_io_stat, moved by it.
func TestMetricsVirtioFS(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const id = "metricsvfs"
	ce.startLongRunning(ctx, t, id, "virtio-fs")
	defer ce.removePod(ctx, id)
	sock := sandbox.MetricsSocket(filepath.Join(ce.stateDir, id))
	item := func(i string) map[string]string { return map[string]string{"item": i} }
	before := scrape(ctx, t, sock, "")
	wcharBefore := sampleValue(t, before, "kata_virtiofsd_io_stat", item("wchar"))
	syscwBefore := sampleValue(t, before, "kata_virtiofsd_io_stat", item("syscw"))
	const writeBytes = 16 * 65536
	r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "work", id, "/bin/sh", "-c",
		"dd if=/dev/zero of=/metrics.bin bs=65536 count=16 && sync")
	if r.code != 0 {
		t.Fatalf("workload: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	after := scrape(ctx, t, sock, "")
	checkFamilies(t, after, map[string]dto.MetricType{
		"kata_virtiofsd_io_stat":     dto.MetricType_GAUGE,
		"kata_virtiofsd_proc_status": dto.MetricType_GAUGE,
		"kata_virtiofsd_proc_stat":   dto.MetricType_GAUGE,
		"kata_virtiofsd_threads":     dto.MetricType_GAUGE,
		"kata_virtiofsd_fds":         dto.MetricType_GAUGE,
		"kata_hypervisor_io_stat":    dto.MetricType_GAUGE,
	})
	if _, ok := after["kata_fsx_imagefs_blk_requests_total"]; ok {
		t.Error("a virtio-fs pod reports imagefs-blk requests")
	}
	if got := sampleValue(t, after, "kata_fsx_sandbox_info", map[string]string{"backend": "virtio-fs"}); got != 1 {
		t.Errorf("sandbox info %v", got)
	}
	wchar := sampleValue(t, after, "kata_virtiofsd_io_stat", item("wchar")) - wcharBefore
	syscw := sampleValue(t, after, "kata_virtiofsd_io_stat", item("syscw")) - syscwBefore
	t.Logf("workload wrote %d bytes; virtiofsd's wchar moved by %.0f, syscw by %.0f", writeBytes, wchar, syscw)
	if wchar < writeBytes {
		t.Errorf("virtiofsd wchar moved by %.0f, want at least %d", wchar, writeBytes)
	}
	if syscw < 1 {
		t.Errorf("virtiofsd syscw moved by %.0f", syscw)
	}
}

// TestMetricsRun: kata-fsx run --metrics serves the one-off pod's socket
// while its command runs, with the reads the command made, and removes it
// when the pod is torn down.
func TestMetricsRun(t *testing.T) {
	e := newEnv(t, "")
	rootfs := busyboxRootfs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const id = "metricsrun"
	cmd := exec.CommandContext(ctx, kataFSX(t), "run", "--config", e.config, "--metrics", "--id", id, "--backend", "imagefs-blk", "--rootfs", rootfs, "--",
		"/bin/sh", "-c", "dd if=/bin/busybox of=/dev/null bs=4096 iflag=direct 2>/dev/null && echo read && exec sleep 600")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := false
	defer func() {
		if !exited {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "read\n" {
		t.Fatalf("the command printed %q (%v); stderr:\n%s", line, err, stderr.String())
	}
	sock := sandbox.MetricsSocket(filepath.Join(e.stateDir, id))
	fams := scrape(ctx, t, sock, "")
	bb, err := os.Stat("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	read := sampleValue(t, fams, "kata_fsx_imagefs_blk_bytes_total", map[string]string{"container": id, "op": "read"})
	t.Logf("kata-fsx run pod: %.0f bytes read from its disk (busybox is %d)", read, bb.Size())
	if read < float64(bb.Size()/4096*4096) {
		t.Errorf("read bytes %.0f, want at least %d", read, bb.Size()/4096*4096)
	}
	if !strings.Contains(stderr.String(), "metrics on "+sock) {
		t.Errorf("run did not say where its metrics are:\n%s", stderr.String())
	}
	// SIGTERM tears the pod down, the socket with it.
	cmd.Process.Signal(syscall.SIGTERM)
	cmd.Wait()
	exited = true
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("metrics socket after run exited: %v", err)
	}
}
