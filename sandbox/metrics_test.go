package sandbox

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/vhostblk/blktest"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
)

// value finds the sample of family name whose labels include want.
func value(t *testing.T, fams []metrics.Family, name string, want ...metrics.Label) float64 {
	t.Helper()
	for _, f := range fams {
		for _, s := range f.Samples {
			if s.Name != name {
				continue
			}
			match := 0
			for _, w := range want {
				for _, l := range s.Labels {
					if l == w {
						match++
					}
				}
			}
			if match == len(want) {
				return s.Value
			}
		}
	}
	t.Fatalf("no sample %s%v", name, want)
	return 0
}

func metricFamily(fams []metrics.Family, name string) *metrics.Family {
	for i := range fams {
		if fams[i].Name == name {
			return &fams[i]
		}
	}
	return nil
}

// A pod with an imagefs-blk disk serves its metrics on shim-monitor.sock:
// the requests a frontend sent are counted by operation, with bytes and
// latency, the overlay's dirty bytes and the build times are there, the
// shim's own process series too; Stop removes the socket.
func TestServeMetrics(t *testing.T) {
	s := bareSandbox(t)
	layer := t.TempDir()
	if err := os.WriteFile(filepath.Join(layer, "f"), bytes.Repeat([]byte("y"), 20000), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := s.backend.(*imagefsBackend).createDisk(context.Background(), "c1", config.Rootfs{Kind: config.RootfsDir, Layers: []string{layer}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ServeMetrics(); err == nil {
		t.Fatal("metrics served while booting")
	}
	s.mu.Lock()
	if err := s.moveLocked(StateReady); err != nil {
		t.Fatal(err)
	}
	s.mu.Unlock()
	if err := s.ServeMetrics(); err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	if err := s.ServeMetrics(); err == nil {
		t.Fatal("second ServeMetrics accepted")
	}
	sock := MetricsSocket(s.Dir)

	f := vhostusertest.Dial(t, d.Socket)
	defer f.Close()
	f.Negotiate(0)
	f.SetupMemory()
	q := f.StartQueue(0, 64)
	const reads, writes = 5, 2
	for i := range reads {
		if st := blktest.Request(q, 0, uint64(i*8), nil, 4096); st != 0 {
			t.Fatalf("read: status %d", st)
		}
	}
	for i := range writes {
		if st := blktest.Request(q, 1, uint64(1024+i*8), bytes.Repeat([]byte{7}, 4096), 0); st != 0 {
			t.Fatalf("write: status %d", st)
		}
	}
	if st := blktest.Request(q, 4, 0, nil, 0); st != 0 {
		t.Fatalf("flush: status %d", st)
	}

	fams, err := metrics.ScrapeUnix(context.Background(), sock, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c := metrics.L("container", "c1")
	for _, tc := range []struct {
		name string
		op   string
		want float64
	}{
		{"kata_fsx_imagefs_blk_requests_total", "read", reads},
		{"kata_fsx_imagefs_blk_bytes_total", "read", reads * 4096},
		{"kata_fsx_imagefs_blk_requests_total", "write", writes},
		{"kata_fsx_imagefs_blk_bytes_total", "write", writes * 4096},
		{"kata_fsx_imagefs_blk_requests_total", "flush", 1},
		{"kata_fsx_imagefs_blk_errors_total", "read", 0},
		{"kata_fsx_imagefs_blk_request_duration_seconds_count", "read", reads},
		{"kata_fsx_imagefs_blk_request_duration_seconds_bucket", "write", writes}, // le=+Inf below
	} {
		labels := []metrics.Label{c, metrics.L("op", tc.op)}
		if tc.name == "kata_fsx_imagefs_blk_request_duration_seconds_bucket" {
			labels = append(labels, metrics.L("le", "+Inf"))
		}
		if got := value(t, fams, tc.name, labels...); got != tc.want {
			t.Errorf("%s{op=%s} = %v, want %v", tc.name, tc.op, got, tc.want)
		}
	}
	for name, typ := range map[string]metrics.Type{
		"kata_fsx_imagefs_blk_requests_total":           metrics.Counter,
		"kata_fsx_imagefs_blk_request_duration_seconds": metrics.Histogram,
		"kata_fsx_overlay_dirty_bytes":                  metrics.Gauge,
		"kata_fsx_imagefs_blk_build_seconds":            metrics.Gauge,
		"kata_shim_io_stat":                             metrics.Gauge,
		"kata_fsx_sandbox_info":                         metrics.Gauge,
	} {
		if f := metricFamily(fams, name); f == nil || f.Type != typ || f.Help == "" {
			t.Errorf("family %s: %+v, want a %s with help", name, f, typ)
		}
	}
	if got := value(t, fams, "kata_fsx_overlay_dirty_bytes", c); got != writes*4096 {
		t.Errorf("dirty bytes %v, want %v", got, writes*4096)
	}
	// The node image store fills Build when it builds or finds the image.
	if got := value(t, fams, "kata_fsx_imagefs_blk_build_seconds", c, metrics.L("phase", "synthesis")); got != d.Build.Synthesis.Seconds() {
		t.Errorf("synthesis seconds %v, want the disk's %v", got, d.Build.Synthesis.Seconds())
	}
	if got := value(t, fams, "kata_fsx_imagefs_blk_build_seconds", c, metrics.L("phase", "index")); got != d.Build.Index.Seconds() {
		t.Errorf("index seconds %v, want the disk's %v", got, d.Build.Index.Seconds())
	}
	if got := value(t, fams, "kata_shim_io_stat", metrics.L("item", "rchar")); got <= 0 {
		t.Errorf("the shim's rchar %v", got)
	}
	if got := value(t, fams, "kata_fsx_sandbox_info", metrics.L("backend", config.SharedFSImagefsBlk)); got != 1 {
		t.Errorf("sandbox info %v", got)
	}

	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("metrics socket after Stop: %v", err)
	}
}

// A lazy store's counters appear by tier under its container's label.
func TestCollectLazy(t *testing.T) {
	var set metrics.Set
	collectLazy(&set, "c9", store.Stats{MemoryHits: 3, DiskHits: 2, FetchedChunks: 1, FetchedBytes: 4096, MemoryBytes: 10})
	var buf bytes.Buffer
	if _, err := set.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	fams, err := metrics.Parse(&buf)
	if err != nil {
		t.Fatal(err)
	}
	c := metrics.L("container", "c9")
	for tier, want := range map[string]float64{"memory": 3, "disk": 2, "registry": 1} {
		if got := value(t, fams, "kata_fsx_lazy_store_hits_total", c, metrics.L("tier", tier)); got != want {
			t.Errorf("tier %s: %v, want %v", tier, got, want)
		}
	}
	if got := value(t, fams, "kata_fsx_lazy_store_fetched_bytes_total", c); got != 4096 {
		t.Errorf("fetched bytes %v", got)
	}
}

// procStat reads this process's CPU times and threads; a process tree
// sums its members.
func TestProcCounters(t *testing.T) {
	_, threads, err := procStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if threads < 1 {
		t.Fatalf("threads %d", threads)
	}
	one := readProcs([]int{os.Getpid()})
	two := readProcs([]int{os.Getpid(), os.Getpid()})
	if !one.ok || two.io["syscr"] < 2*one.io["syscr"] || two.fds < 2*one.fds-2 {
		t.Fatalf("one %+v two %+v", one, two)
	}
	if gone := readProcs([]int{1 << 30}); gone.ok {
		t.Fatal("a missing process read")
	}
}
