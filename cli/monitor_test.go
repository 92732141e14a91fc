package cli

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// podServer serves a pod's metrics socket under stateDir as the shim does.
func podServer(t *testing.T, stateDir, id string, requests float64) {
	t.Helper()
	dir := filepath.Join(stateDir, id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	srv, err := metrics.ServeUnix(sandbox.MetricsSocket(dir), metrics.Handler(func(s *metrics.Set) {
		s.Counter("kata_fsx_imagefs_blk_requests_total", "Requests.").Add(requests, metrics.L("container", id), metrics.L("op", "read"))
		s.Gauge("kata_fsx_sandbox_info", "Backend.").Add(1, metrics.L("backend", "imagefs-blk"))
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
}

// kata-fsx monitor serves every pod's families once each, every sample
// with its pod's sandbox_id, and counts a dead pod's socket as a failed
// scrape without failing the others.
func TestMonitorAggregates(t *testing.T) {
	stateDir := t.TempDir()
	podServer(t, stateDir, "pod-a", 3)
	podServer(t, stateDir, "pod-b", 7)
	// A dead shim's socket: a socket file nobody listens on.
	dead := filepath.Join(stateDir, "pod-dead")
	os.MkdirAll(dead, 0o700)
	ln, err := net.Listen("unix", sandbox.MetricsSocket(dead))
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	// A pod directory without a socket is no pod to scrape.
	os.MkdirAll(filepath.Join(stateDir, "pod-nosock"), 0o700)

	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int)
	var stderr strings.Builder
	go func() {
		done <- Main(ctx, []string{"monitor", "--listen", "127.0.0.1:0", "--state-dir", stateDir}, pw, &stderr)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("monitor printed no address: %v; stderr %s", err, stderr.String())
	}
	go io.Copy(io.Discard, pr)
	url := strings.Fields(strings.TrimPrefix(line, "kata-fsx monitor: serving "))[0]
	var fams []metrics.Family
	for range 2 { // the second scrape sees the counters of the first
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Get(url)
		if err != nil {
			t.Fatal(err)
		}
		if ct := resp.Header.Get("Content-Type"); ct != metrics.ContentType {
			t.Errorf("content type %q", ct)
		}
		fams, err = metrics.Parse(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("monitor exit %d: %s", code, stderr.String())
	}

	got := map[string]float64{}
	for _, f := range fams {
		for _, s := range f.Samples {
			key := s.Name
			for _, l := range s.Labels {
				key += "," + l.Name + "=" + l.Value
			}
			got[key] = s.Value
		}
	}
	want := map[string]float64{
		"kata_fsx_imagefs_blk_requests_total,sandbox_id=pod-a,container=pod-a,op=read": 3,
		"kata_fsx_imagefs_blk_requests_total,sandbox_id=pod-b,container=pod-b,op=read": 7,
		"kata_fsx_sandbox_info,sandbox_id=pod-a,backend=imagefs-blk":                   1,
		"kata_fsx_sandbox_info,sandbox_id=pod-b,backend=imagefs-blk":                   1,
		"kata_monitor_running_shim_count":                                              2,
		"kata_monitor_scrape_count":                                                    6,
		"kata_monitor_scrape_failed_count":                                             2,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("series %v, want %v", got, want)
	}
	if !strings.Contains(stderr.String(), "pod-dead") {
		t.Errorf("the dead pod's failure was not logged: %s", stderr.String())
	}
}
