package sandbox

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/vhostblk"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/metrics"
)

// MetricsSocketName is the pod's metrics socket in its sandbox directory:
// Kata's shim serves the same HTTP endpoints on a socket of this name in
// its own sandbox directory (/run/vc/sbs/<id>/shim-monitor.sock).
const MetricsSocketName = "shim-monitor.sock"

// MetricsSocket is the metrics socket of the sandbox whose directory is dir.
func MetricsSocket(dir string) string { return filepath.Join(dir, MetricsSocketName) }

// ServeMetrics serves the pod's metrics (CollectMetrics, built on each
// scrape) over HTTP, GET /metrics, on MetricsSocket(s.Dir) until Stop,
// which removes the socket. A second call is an error.
func (s *Sandbox) ServeMetrics() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.metricsSrv != nil {
		return fmt.Errorf("sandbox %s: metrics already served", s.ID)
	}
	if err := s.requireLocked("serve metrics", StateReady); err != nil {
		return err
	}
	srv, err := metrics.ServeUnix(MetricsSocket(s.Dir), metrics.Handler(s.CollectMetrics))
	if err != nil {
		return fmt.Errorf("sandbox %s: %w", s.ID, err)
	}
	s.metricsSrv = srv
	return nil
}

// stopMetrics ends the metrics server, if any, and removes its socket.
func (s *Sandbox) stopMetrics() error {
	s.mu.Lock()
	srv := s.metricsSrv
	s.metricsSrv = nil
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	if err := srv.Close(); err != nil {
		return fmt.Errorf("stop the metrics server: %w", err)
	}
	return nil
}

// lazyStatser is a LazyRootfs that counts its reads by tier (lazyroot.Root).
type lazyStatser interface {
	Stats() store.Stats
}

// CollectMetrics adds the pod's metrics to set: per imagefs-blk disk
// (label container) its requests, bytes, errors and latency by
// operation, overlay dirty bytes, build times; per lazy image store its
// reads by tier; the processes serving the pod in Kata's names
// (kata_hypervisor_*, kata_virtiofsd_*, kata_shim_*). docs/metrics.md
// lists them all.
func (s *Sandbox) CollectMetrics(set *metrics.Set) {
	set.Gauge("kata_fsx_sandbox_info", "The pod's rootfs backend (value 1).").Add(1, metrics.L("backend", s.Decision.Backend))

	s.backend.collectMetrics(set)

	if s.vm != nil {
		collectProcess(set, "kata_hypervisor", "Hypervisor (QEMU)", []int{s.vm.Pid()})
	}
	if vfsd := s.backend.virtiofsd(); vfsd != nil {
		// The C virtiofsd serves from a forked child: count the tree.
		pid := vfsd.Pid()
		collectProcess(set, "kata_virtiofsd", "Virtiofsd (with its children)", append([]int{pid}, Descendants(pid)...))
	}
	collectProcess(set, "kata_shim", "Kata-fsx shim (the imagefs-blk server)", []int{os.Getpid()})
}

// collectDisk adds one imagefs-blk disk's series, labelled by container.
func collectDisk(set *metrics.Set, cid string, d *podDisk) {
	if d == nil || d.Disk == nil {
		return
	}
	c := metrics.L("container", cid)
	reqs := set.Counter("kata_fsx_imagefs_blk_requests_total", "Virtio-blk requests the imagefs-blk server completed, failed ones included, by operation.")
	byts := set.Counter("kata_fsx_imagefs_blk_bytes_total", "Bytes the successful imagefs-blk requests moved (read, written, or discarded/zeroed ranges), by operation.")
	errs := set.Counter("kata_fsx_imagefs_blk_errors_total", "Imagefs-blk requests answered with an error status, by operation.")
	lat := set.Histogram("kata_fsx_imagefs_blk_request_duration_seconds", "Time the imagefs-blk server spent on a request, from taking it off the queue to its status, by operation.")
	bounds := vhostblk.LatencyBounds()
	secs := make([]float64, len(bounds))
	for i, b := range bounds {
		secs[i] = b.Seconds()
	}
	for op, st := range d.Ops().All() {
		o := metrics.L("op", op.String())
		reqs.Add(float64(st.Requests), c, o)
		byts.Add(float64(st.Bytes), c, o)
		errs.Add(float64(st.Errors), c, o)
		lat.AddHistogram(metrics.Buckets{Bounds: secs, Counts: st.Latency.Counts[:], Sum: st.Latency.Sum.Seconds()}, c, o)
	}
	if ov := d.Overlay(); ov != nil {
		set.Gauge("kata_fsx_overlay_dirty_bytes", "Bytes of the imagefs-blk disk the guest changed (blocks written, discarded or zeroed), held by the pod's overlay.").Add(float64(ov.DirtyBytes()), c)
		set.Gauge("kata_fsx_imagefs_blk_disk_bytes", "Size of the imagefs-blk disk.").Add(float64(ov.Size()), c)
	}
	build := set.Gauge("kata_fsx_imagefs_blk_build_seconds", "Time spent building the disk's image before serving it, by phase (index: indexing the rootfs; synthesis: the ext4 metadata); 0 for a phase skipped.")
	build.Add(d.Build.Index.Seconds(), c, metrics.L("phase", "index"))
	build.Add(d.Build.Synthesis.Seconds(), c, metrics.L("phase", "synthesis"))
	shared := 0.0
	if d.Build.Shared {
		shared = 1
	}
	set.Gauge("kata_fsx_imagefs_blk_metadata_shared", "1 if the disk's metadata came from the node's image store, built by another pod, 0 if this pod built it.").Add(shared, c)
}

// collectLazy adds one lazy image store's counters, labelled by the
// container whose rootfs it serves.
func collectLazy(set *metrics.Set, cid string, st store.Stats) {
	c := metrics.L("container", cid)
	hits := set.Counter("kata_fsx_lazy_store_hits_total", "Reads of the lazy image store served by each tier: memory (inflated spans and chunks), disk (the node's chunk cache), registry (chunks fetched).")
	hits.Add(float64(st.MemoryHits), c, metrics.L("tier", "memory"))
	hits.Add(float64(st.DiskHits), c, metrics.L("tier", "disk"))
	hits.Add(float64(st.FetchedChunks), c, metrics.L("tier", "registry"))
	set.Counter("kata_fsx_lazy_store_fetched_bytes_total", "Bytes the lazy image store received from registries.").Add(float64(st.FetchedBytes), c)
	set.Counter("kata_fsx_lazy_store_range_requests_total", "Range requests the lazy image store sent, retries included.").Add(float64(st.RangeRequests), c)
	set.Counter("kata_fsx_lazy_store_fetch_errors_total", "Range requests that failed.").Add(float64(st.FetchErrors), c)
	set.Counter("kata_fsx_lazy_store_verify_failures_total", "Chunks whose SHA-256 did not match the index.").Add(float64(st.VerifyFailures), c)
	set.Counter("kata_fsx_lazy_store_read_errors_total", "Reads the lazy image store failed (the guest's EIO).").Add(float64(st.ReadErrors), c)
	set.Gauge("kata_fsx_lazy_store_memory_bytes", "Bytes the lazy image store's memory tier holds.").Add(float64(st.MemoryBytes), c)
}

// procTotals is a process tree's /proc counters, summed.
type procTotals struct {
	io, status map[string]uint64
	stat       [4]uint64 // utime, stime, cutime, cstime (clock ticks)
	threads    uint64
	fds        uint64
	ok         bool // the first process was read
}

// readProcs sums the counters of pids; a process that exits between the
// listing and the read is left out.
func readProcs(pids []int) procTotals {
	t := procTotals{io: map[string]uint64{}, status: map[string]uint64{}}
	for i, pid := range pids {
		io, err := host.ProcFields(fmt.Sprintf("/proc/%d/io", pid))
		if err != nil {
			continue
		}
		st, err := host.ProcFields(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		stat, threads, err := procStat(pid)
		if err != nil {
			continue
		}
		for k, v := range io {
			t.io[k] += v
		}
		for k, v := range st {
			t.status[k] += v
		}
		for j := range stat {
			t.stat[j] += stat[j]
		}
		t.threads += threads
		if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
			t.fds += uint64(len(fds))
		}
		if i == 0 {
			t.ok = true
		}
	}
	return t
}

// procStat reads utime, stime, cutime, cstime and num_threads from
// /proc/PID/stat (fields 14-17 and 20, counted after the command's
// closing parenthesis, which the command itself may contain).
func procStat(pid int) ([4]uint64, uint64, error) {
	var out [4]uint64
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return out, 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return out, 0, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3, the state
	if len(f) < 18 {
		return out, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	for j := range out {
		if _, err := fmt.Sscan(f[11+j], &out[j]); err != nil {
			return out, 0, fmt.Errorf("/proc/%d/stat field %d: %w", pid, 14+j, err)
		}
	}
	var threads uint64
	if _, err := fmt.Sscan(f[17], &threads); err != nil {
		return out, 0, fmt.Errorf("/proc/%d/stat num_threads: %w", pid, err)
	}
	return out, threads, nil
}

// collectProcess adds Kata's process series for a process tree under ns
// (kata_hypervisor, kata_virtiofsd, kata_shim): io_stat, proc_status,
// proc_stat by item, threads and fds. Gauges, as Kata has them.
func collectProcess(set *metrics.Set, ns, who string, pids []int) {
	t := readProcs(pids)
	if !t.ok {
		return
	}
	// Kata's items: /proc/PID/io and /proc/PID/status keys with the item
	// label Kata's runtime gives them (status sizes in bytes).
	procIOItems := [][2]string{
		{"rchar", "rchar"}, {"wchar", "wchar"}, {"syscr", "syscr"}, {"syscw", "syscw"},
		{"read_bytes", "readbytes"}, {"write_bytes", "writebytes"}, {"cancelled_write_bytes", "cancelledwritebytes"},
	}
	procStatusItems := [][2]string{
		{"VmPeak", "vmpeak"}, {"VmSize", "vmsize"}, {"VmLck", "vmlck"}, {"VmPin", "vmpin"},
		{"VmHWM", "vmhwm"}, {"VmRSS", "vmrss"}, {"RssAnon", "rssanon"}, {"RssFile", "rssfile"},
		{"RssShmem", "rssshmem"}, {"VmData", "vmdata"}, {"VmStk", "vmstk"}, {"VmExe", "vmexe"},
		{"VmLib", "vmlib"}, {"VmPTE", "vmpte"}, {"VmSwap", "vmswap"}, {"HugetlbPages", "hugetlbpages"},
		{"voluntary_ctxt_switches", "voluntary_ctxt_switches"}, {"nonvoluntary_ctxt_switches", "nonvoluntary_ctxt_switches"},
	}
	io := set.Gauge(ns+"_io_stat", who+" process IO statistics (/proc/PID/io), by item.")
	for _, it := range procIOItems {
		io.Add(float64(t.io[it[0]]), metrics.L("item", it[1]))
	}
	status := set.Gauge(ns+"_proc_status", who+" process status (/proc/PID/status; sizes in bytes), by item.")
	for _, it := range procStatusItems {
		v, ok := t.status[it[0]]
		if !ok {
			continue
		}
		if strings.HasPrefix(it[0], "Vm") || strings.HasPrefix(it[0], "Rss") || it[0] == "HugetlbPages" {
			v *= 1024 // kB in /proc
		}
		status.Add(float64(v), metrics.L("item", it[1]))
	}
	stat := set.Gauge(ns+"_proc_stat", who+" process CPU times (/proc/PID/stat, clock ticks), by item.")
	for j, item := range []string{"utime", "stime", "cutime", "cstime"} {
		stat.Add(float64(t.stat[j]), metrics.L("item", item))
	}
	set.Gauge(ns+"_threads", who+" process threads.").Add(float64(t.threads))
	set.Gauge(ns+"_fds", who+" open file descriptors.").Add(float64(t.fds))
}
