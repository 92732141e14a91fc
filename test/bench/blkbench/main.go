// Command blkbench measures imagefs-blk against the two ways QEMU would
// otherwise serve the same ext4 image, side by side in one run, one guest
// boot each: (a) imagefs-blk, synthesized metadata with data read through
// the block map and a copy-on-write overlay, served over vhost-user-blk by
// this process; (b) the raw export of that image behind QEMU's own
// virtio-blk-pci (cache=none); (c) the same raw export behind
// qemu-storage-daemon's vhost-user-blk export (O_DIRECT). The workloads run
// inside the guest as the container process and are timed there. It
// writes raw numbers as JSON and a Markdown section of docs/benchmarks.md.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/bench"
	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// options are the command-line settings.
type options struct {
	qemu, qsd, kit, cache string
	jsonOut, mdOut        string
	memoryMiB             int
	files, dirs, reps     int
	fioSecs, fioMiB       int
	imageMiB              int
	skipGoBench           bool
	writeback             bool
	only, backends        string
	cpuProfile            string
}

func main() {
	var o options
	flag.StringVar(&o.qemu, "qemu", "/usr/bin/qemu-system-x86_64", "QEMU binary")
	flag.StringVar(&o.qsd, "qsd", "qemu-storage-daemon", "qemu-storage-daemon binary")
	flag.StringVar(&o.kit, "kit", "build/guest", "guest kit directory (vmlinux, initrd.img; make guest)")
	flag.StringVar(&o.cache, "cache", "build/cache", "fixture and accelerator-verdict cache directory")
	flag.StringVar(&o.jsonOut, "json", "docs/bench/blk.json", "raw results")
	flag.StringVar(&o.mdOut, "md", "docs/benchmarks.md", "Markdown file whose blk-backends section is replaced")
	flag.IntVar(&o.memoryMiB, "mem", 1024, "guest RAM in MiB (shared memfd)")
	flag.IntVar(&o.files, "files", 5000, "small files created per repetition")
	flag.IntVar(&o.dirs, "dirs", 10, "directories the small files are spread over")
	flag.IntVar(&o.reps, "reps", 3, "repetitions of every workload within one boot")
	flag.IntVar(&o.fioSecs, "fio-runtime", 4, "seconds per fio read run")
	flag.IntVar(&o.fioMiB, "fio-size", 256, "MiB of the file fio writes and then reads")
	flag.IntVar(&o.imageMiB, "image-file", 256, "MiB of random data stored in the image itself for the image-file fio rows")
	flag.BoolVar(&o.skipGoBench, "skip-go-bench", false, "do not run BenchmarkRead4K")
	flag.BoolVar(&o.writeback, "writeback", true, "also boot (d): virtio-blk with cache=writeback, the control that reads through the host page cache like imagefs-blk")
	flag.StringVar(&o.only, "only", "all", "workload groups to run, comma-separated: files (create, chown, ls, cat, rm), seqwrite, randread, seqread, imgrandread, imgseqread; randread and seqread need seqwrite")
	flag.StringVar(&o.backends, "backends", "abcd", "backends to boot, by letter; a and b are always booted (d also needs -writeback)")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of this process (the imagefs-blk server) while guest (a) runs")
	flag.Parse()
	if err := checkOnly(o.only); err != nil {
		fmt.Fprintf(os.Stderr, "blkbench: %v\n", err)
		os.Exit(2)
	}
	if o.files <= 0 || o.dirs <= 0 || o.files%o.dirs != 0 || o.reps <= 0 || o.fioSecs <= 0 || o.fioMiB <= 0 || o.imageMiB <= 0 || o.memoryMiB < 256 {
		fmt.Fprintln(os.Stderr, "blkbench: -files must be a positive multiple of -dirs; -reps, -fio-runtime, -fio-size, -image-file positive; -mem at least 256")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, o)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "blkbench: %v\n", err)
		os.Exit(1)
	}
}

// backendResult is one backend's boot.
type backendResult struct {
	Label       string               `json:"label"`
	Name        string               `json:"name"`
	Device      string               `json:"device"`
	Host        string               `json:"host_side"`
	BootSeconds float64              `json:"boot_seconds,omitempty"`
	Samples     map[string][]float64 `json:"samples"`
	Error       string               `json:"error,omitempty"`
}

func run(ctx context.Context, o options) (err error) {
	started := time.Now()
	loadStart := bench.LoadAvg()
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if _, err := os.Stat(filepath.Join(o.kit, f)); err != nil {
			return fmt.Errorf("guest kit: %w (run 'make guest')", err)
		}
	}
	kit, err := filepath.Abs(o.kit)
	if err != nil {
		return err
	}
	qsd, err := exec.LookPath(o.qsd)
	if err != nil {
		return fmt.Errorf("qemu-storage-daemon: %w (apt-get install qemu-utils)", err)
	}
	if ok, why := hypervisor.MemfdAvailable(); !ok {
		return fmt.Errorf("vhost-user needs shared guest memory: %s", why)
	}
	caps, err := hypervisor.Probe(ctx, o.qemu)
	if err != nil {
		return err
	}
	if !caps.VhostUserBlk || !caps.VirtioBlk || !caps.VirtioSerial {
		return fmt.Errorf("%s lacks vhost-user-blk-pci, virtio-blk-pci or virtio-serial-pci", caps.Path)
	}
	accel, accelWhy := hypervisor.ResolveAccel(ctx, o.qemu, filepath.Join(kit, "vmlinux"), o.cache)
	fmt.Fprintf(os.Stderr, "blkbench: accelerator %s: %s\n", accel, accelWhy)

	debian, err := fixture("debian-rootfs.sh", o.cache)
	if err != nil {
		return fmt.Errorf("fixture test/fixtures/debian-rootfs.sh: %w", err)
	}
	tmp, err := os.MkdirTemp("", "blkbench-")
	if err != nil {
		return err
	}
	defer func() {
		if rmErr := os.RemoveAll(tmp); rmErr != nil {
			err = errors.Join(err, rmErr)
		}
	}()
	layer := filepath.Join(tmp, "layer")
	fmt.Fprintf(os.Stderr, "blkbench: rootfs = %s + fio layer (%d MiB image file)\n", debian, o.imageMiB)
	if err := benchLayer(layer, debian, o.imageMiB); err != nil {
		return fmt.Errorf("bench layer: %w", err)
	}
	icache := filepath.Join(tmp, "cache")
	idx, err := index.FromLayers(ctx, []string{debian, layer}, index.Options{CacheDir: icache})
	if err != nil {
		return err
	}
	// The shim's defaults, so (a) is the disk a pod gets.
	b := config.Default().KataFSX.ImagefsBlk
	bopts := blk.Options{CacheDir: icache, WritableSize: int64(b.WritableSizeMB) << 20, BlockSize: int(b.BlockSize),
		Journal: b.Journal, JournalSize: int64(b.JournalSizeMB) << 20, NumQueues: int(b.NumQueues), QueueSize: int(b.QueueSize)}
	disk, err := blk.CreateFromIndex(ctx, idx, filepath.Join(tmp, "imagefs"), bopts)
	if err != nil {
		return err
	}
	diskOpen := true
	defer func() {
		if diskOpen {
			if cErr := disk.Remove(); cErr != nil {
				err = errors.Join(err, cErr)
			}
		}
	}()
	imgBytes := disk.Image.Map.Blocks() * uint64(disk.Image.Map.BlockSize())
	// Each raw backend gets its own pristine copy: the guests write.
	rawB, rawC, rawD := filepath.Join(tmp, "virtio-blk.raw"), filepath.Join(tmp, "qsd.raw"), filepath.Join(tmp, "virtio-blk-wb.raw")
	raws := []string{rawB, rawC}
	if o.writeback && strings.Contains(o.backends, "d") {
		raws = append(raws, rawD)
	}
	t0 := time.Now()
	for _, p := range raws {
		if err := exportRaw(ctx, disk.Image, index.HostOpener{CacheDir: icache}, p); err != nil {
			return fmt.Errorf("export raw image: %w", err)
		}
	}
	fmt.Fprintf(os.Stderr, "blkbench: image %.0f MiB (metadata %.1f MiB), %d raw exports in %.1f s\n",
		float64(imgBytes)/(1<<20), float64(disk.Image.Manifest.MetaBytes)/(1<<20), len(raws), time.Since(t0).Seconds())
	aio, aioWhy := hypervisor.ProbeIOUring(ctx, rawB)
	fmt.Fprintf(os.Stderr, "blkbench: host aio %s (%s)\n", aio, aioWhy)

	s := vmSettings{kit: kit, caps: caps, accel: accel, memoryMiB: uint64(o.memoryMiB),
		files: o.files, dirs: o.dirs, reps: o.reps, fioSecs: o.fioSecs, fioMiB: o.fioMiB, only: o.only}
	var results []*backendResult
	measure := func(r *backendResult, name string, dev hypervisor.Device) {
		fmt.Fprintf(os.Stderr, "blkbench: %s: booting (%s)\n", r.Name, r.Device)
		dir := filepath.Join(tmp, name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			r.Error = err.Error()
			return
		}
		t := time.Now()
		g, err := bootAndMeasure(ctx, s, dir, name, dev)
		if err != nil {
			r.Error = err.Error()
			fmt.Fprintf(os.Stderr, "blkbench: %s failed: %v\n", r.Name, err)
			return
		}
		r.BootSeconds = g.bootSeconds
		r.Samples = map[string][]float64{}
		for _, sm := range g.samples {
			r.Samples[sm.workload] = append(r.Samples[sm.workload], sm.value)
		}
		fmt.Fprintf(os.Stderr, "blkbench: %s done in %.0f s\n", r.Name, time.Since(t).Seconds())
	}

	// (a) imagefs-blk, served by this process.
	ra := &backendResult{Label: "(a) imagefs-blk", Name: "imagefs-blk", Device: fmt.Sprintf("vhost-user-blk-pci (num-queues %d, queue-size %d, seg_max %d)", b.NumQueues, b.QueueSize, b.QueueSize-2),
		Host: "kata-fsx blk.CreateFromIndex in the benchmark process: ext4 metadata synthesized, data read from the layer files (host page cache), writes to a sparse overlay"}
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return err
	}
	measure(ra, "imagefs", &hypervisor.VhostUserBlk{ID: "imagefs-blk-0", SocketPath: disk.Socket, NumQueues: b.NumQueues, QueueSize: b.QueueSize})
	if err := stopProfile(); err != nil {
		return err
	}
	diskOpen = false
	if cErr := disk.Remove(); cErr != nil {
		return fmt.Errorf("imagefs-blk disk: %w", cErr)
	}
	results = append(results, ra)
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// (b) the raw export behind QEMU's virtio-blk.
	rb := &backendResult{Label: "(b) virtio-blk cache=none", Name: "virtio-blk", Device: fmt.Sprintf("virtio-blk-pci, -drive format=raw,cache=none,aio=%s", aio),
		Host: "QEMU's block layer on the raw export (O_DIRECT)"}
	measure(rb, "virtioblk", &hypervisor.VirtioBlk{ID: "virtio-blk-0", Path: rawB, Format: "raw", Cache: "none", AIO: aio})
	results = append(results, rb)
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// (c) the raw export behind qemu-storage-daemon's vhost-user-blk.
	rc := &backendResult{Label: "(c) qsd vhost-user-blk", Name: "qsd vhost-user-blk", Device: fmt.Sprintf("vhost-user-blk-pci (num-queues 1, queue-size %d)", b.QueueSize)}
	qsdDir := filepath.Join(tmp, "qsd")
	sock := filepath.Join(qsdDir, "vhost-blk.sock")
	if err := os.MkdirAll(qsdDir, 0o700); err != nil {
		return err
	}
	var d *storageDaemon
	if strings.Contains(o.backends, "c") {
		d, err = startStorageDaemon(ctx, qsd, rawC, sock, aio, filepath.Join(qsdDir, "qsd.log"))
	} else {
		err = errNotBooted
	}
	if err != nil {
		rc.Error = err.Error()
	} else {
		rc.Host = "qemu-storage-daemon " + strings.Join(d.Args[1:], " ")
		measure(rc, "qsdvub", &hypervisor.VhostUserBlk{ID: "qsd-blk-0", SocketPath: sock, NumQueues: 1, QueueSize: b.QueueSize})
		d.Stop()
	}
	results = append(results, rc)
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// (d) control: virtio-blk through the host page cache, as (a) reads
	// its layer files and writes its overlay.
	if o.writeback && strings.Contains(o.backends, "d") {
		rd := &backendResult{Label: "(d) virtio-blk cache=writeback", Name: "virtio-blk writeback",
			Device: fmt.Sprintf("virtio-blk-pci, -drive format=raw,cache=writeback,aio=%s", aio),
			Host:   "QEMU's block layer on the raw export through the host page cache (control, not a target)"}
		measure(rd, "virtioblkwb", &hypervisor.VirtioBlk{ID: "virtio-blk-0", Path: rawD, Format: "raw", Cache: "writeback", AIO: aio})
		results = append(results, rd)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}

	goBench := "not run (-skip-go-bench)"
	if !o.skipGoBench {
		goBench = runGoBench(ctx)
	}

	host := hostInfo(caps, qsd, accel, accelWhy, kit, aio, aioWhy)
	host["loadavg_start"], host["loadavg_end"] = loadStart, bench.LoadAvg()
	res := map[string]any{
		"date":    started.UTC().Format(time.RFC3339),
		"command": strings.TrimSpace("go run ./test/bench/blkbench " + strings.Join(os.Args[1:], " ")),
		"host":    host,
		"settings": map[string]any{
			"vcpus": 1, "memory_mib": o.memoryMiB, "memory_backend": "memory-backend-memfd,share=on", "machine": "q35",
			"only": o.only, "files": o.files, "dirs": o.dirs, "reps": o.reps, "fio_runtime_s": o.fioSecs, "fio_file_mib": o.fioMiB,
			"image_file_mib": o.imageMiB, "fio": "ioengine=libaio direct=1 iodepth=16",
			"image_bytes": imgBytes, "image_meta_bytes": disk.Image.Manifest.MetaBytes,
			"rootfs":  "Debian bookworm minbase (test/fixtures/debian-rootfs.sh) + layer with the host's fio and missing libraries",
			"imagefs": fmt.Sprintf("block size %d, journal %v (%d MiB), writable %d MiB", b.BlockSize, b.Journal, b.JournalSizeMB, b.WritableSizeMB),
		},
		"backends":           results,
		"inprocess_read4k":   goBench,
		"wall_clock_seconds": time.Since(started).Seconds(),
	}
	md := markdown(res, results, o, goBench, host)
	if err := os.MkdirAll(filepath.Dir(o.jsonOut), 0o755); err != nil {
		return err
	}
	js, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(o.jsonOut, append(js, '\n'), 0o644); err != nil {
		return err
	}
	if err := bench.ReplaceSection(o.mdOut, "blk-backends", md); err != nil {
		return err
	}
	fmt.Print(md)
	var failed []string
	for _, r := range results {
		if r.Error != "" && r.Error != errNotBooted.Error() {
			failed = append(failed, r.Name)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("backends failed: %s (errors in %s)", strings.Join(failed, ", "), o.jsonOut)
	}
	return nil
}

// startCPUProfile starts a CPU profile into path ("" = none) and returns
// the function that ends it.
func startCPUProfile(path string) (func() error, error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

// errNotBooted marks a backend left out with -backends.
var errNotBooted = errors.New("not booted (-backends)")

// checkOnly validates the -only list against the guest script's groups.
func checkOnly(only string) error {
	if only == "all" {
		return nil
	}
	groups := map[string]bool{}
	for _, g := range strings.Split(only, ",") {
		switch g {
		case "files", "seqwrite", "randread", "seqread", "imgrandread", "imgseqread":
			groups[g] = true
		default:
			return fmt.Errorf("-only: unknown workload group %q", g)
		}
	}
	if (groups["randread"] || groups["seqread"]) && !groups["seqwrite"] {
		return errors.New("-only: randread and seqread read the file seqwrite writes; add seqwrite")
	}
	return nil
}

// workload is one row of the table.
type workload struct {
	key, label, unit string
	higherIsBetter   bool
}

func workloads(o options) []workload {
	return []workload{
		{"create", fmt.Sprintf("create %d files (%d B) in %d dirs + sync", o.files, 1537, o.dirs), "s", false},
		{"chown", "chown -R + sync", "s", false},
		{"ls", "ls -lR, cold cache", "s", false},
		{"cat", "cat every file, cold cache", "s", false},
		{"rm", "rm -rf + sync", "s", false},
		{"seqwrite", fmt.Sprintf("fio 1M seq write %d MiB (new file)", o.fioMiB), "MB/s", true},
		{"randread", "fio 4k randread, file written in the guest", "IOPS", true},
		{"seqread", "fio 128k seqread, file written in the guest", "MB/s", true},
		{"imgrandread", fmt.Sprintf("fio 4k randread, %d MiB file of the image", o.imageMiB), "IOPS", true},
		{"imgseqread", fmt.Sprintf("fio 128k seqread, %d MiB file of the image", o.imageMiB), "MB/s", true},
	}
}

func stats(v []float64) (med, lo, hi float64) {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	n := len(s)
	med = s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return med, s[0], s[n-1]
}

func format(v float64, unit string) string {
	switch unit {
	case "s":
		return fmt.Sprintf("%.3f s", v)
	case "IOPS":
		return fmt.Sprintf("%.0f IOPS", v)
	}
	return fmt.Sprintf("%.1f %s", v, unit)
}

func markdown(res map[string]any, results []*backendResult, o options, goBench string, host map[string]string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Run %s, `%s`, wall clock %.0f s.\n\n", res["date"], res["command"], res["wall_clock_seconds"])
	fmt.Fprintf(&b, "Host: %s, %s CPUs (load average %s at the start, %s at the end: the machine is shared), accelerator **%s** (%s); %s; host kernel %s; guest kernel %s; %s. "+
		"Guest: q35, 1 vCPU, %d MiB RAM (memfd, share=on); host I/O for (b) and (c): O_DIRECT, aio=%s.\n\n",
		host["cpu"], host["cpus"], host["loadavg_start"], host["loadavg_end"], host["accel"], shortReason(host["accel_reason"]), host["qemu"], host["kernel"], host["guest_kernel"], host["fio"],
		o.memoryMiB, host["aio"])
	fmt.Fprintf(&b, "Median of %d repetitions in the same boot (min–max in brackets). Ratio = imagefs-blk's speed relative to virtio-blk "+
		"(time_virtio / time_imagefs, or throughput_imagefs / throughput_virtio): 1.00 is equal, above 1 imagefs-blk is faster. Target ≥ 0.90 on every row.\n\n", o.reps)
	b.WriteString("| workload |")
	for _, r := range results {
		b.WriteString(" " + r.Label + " |")
	}
	b.WriteString(" a / b | ≥ 0.9x |")
	// a / c compares the two vhost-user servers (same transport, same
	// QEMU device); a / d the two that go through the host page cache.
	extra := []int{}
	for _, i := range []int{2, 3} {
		if len(results) > i && results[i].Error == "" {
			extra = append(extra, i)
			fmt.Fprintf(&b, " a / %c |", 'a'+i)
		}
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", len(results)) + "---:|:---:|" + strings.Repeat("---:|", len(extra)))
	b.WriteString("\n")
	speed := func(w workload, a, base float64) float64 {
		if w.higherIsBetter {
			return a / base
		}
		return base / a
	}
	met, total := 0, 0
	var missed []string
	for _, w := range workloads(o) {
		ran := false
		for _, r := range results {
			ran = ran || len(r.Samples[w.key]) > 0
		}
		if !ran && o.only != "all" {
			continue // left out with -only
		}
		cells := make([]string, len(results))
		meds := make([]float64, len(results))
		for i, r := range results {
			v := r.Samples[w.key]
			if r.Error != "" || len(v) == 0 {
				cells[i] = "failed"
				continue
			}
			med, lo, hi := stats(v)
			meds[i] = med
			cells[i] = fmt.Sprintf("%s (%s–%s)", format(med, w.unit), trimUnit(format(lo, w.unit)), trimUnit(format(hi, w.unit)))
		}
		ratio, verdict := "—", "—"
		if len(results) >= 2 && meds[0] > 0 && meds[1] > 0 {
			q := speed(w, meds[0], meds[1])
			ratio = fmt.Sprintf("%.2f", q)
			total++
			if q >= 0.9 {
				verdict, met = "yes", met+1
			} else {
				verdict = "**no**"
				missed = append(missed, w.label)
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", w.label, strings.Join(cells, " | "), ratio, verdict)
		for _, i := range extra {
			if meds[0] > 0 && meds[i] > 0 {
				fmt.Fprintf(&b, " %.2f |", speed(w, meds[0], meds[i]))
			} else {
				b.WriteString(" — |")
			}
		}
		b.WriteString("\n")
	}
	var boots []string
	for _, r := range results {
		if r.Error == "" {
			boots = append(boots, fmt.Sprintf("%s %.1f s", r.Name, r.BootSeconds))
		}
	}
	fmt.Fprintf(&b, "\nTarget met on %d of %d rows", met, total)
	if len(missed) > 0 {
		fmt.Fprintf(&b, "; not met: %s", strings.Join(missed, "; "))
	}
	b.WriteString(".\n\n")
	fmt.Fprintf(&b, "Boot, QEMU start to container running (one sample each, not a target row): %s.\n\n", strings.Join(boots, ", "))
	for _, r := range results {
		if r.Error != "" {
			fmt.Fprintf(&b, "- **%s failed**: %s\n", r.Name, truncate(strings.ReplaceAll(r.Error, "\n", " "), 400))
		}
	}
	fmt.Fprintf(&b, "Raw request rate, no guest (`go test -run '^$' -bench BenchmarkRead4K ./blk/vhostuser/`: "+
		"the package's test frontend, a real vhost-user frontend over the unix socket with memfd memory, drives one queue with 4 KiB reads "+
		"in batches of 32 over the same 64 MiB raw file, through the host page cache, first against our server, then against "+
		"qemu-storage-daemon's vhost-user-blk export): %s.\n\n", goBench)
	b.WriteString("Notes: (a) reads image data from the layer files through the host page cache and writes its overlay through it, " +
		"while (b) and (c) use O_DIRECT on the raw file (cache=none / cache.direct=on), as asked of the comparison; " +
		"(d), when present, is the same virtio-blk with cache=writeback, a control that shares (a)'s host page cache. " +
		"a / c compares the two vhost-user servers over the same transport; a / c and a / d are context, not targets. " +
		"Each raw backend gets its own pristine copy of the image; guest writes land in (a)'s overlay. The guests ran one after another in the order of the columns. " +
		"Raw numbers: `docs/bench/blk.json`.\n")
	return b.String()
}

// shortReason keeps the first clause of an accelerator verdict: the full
// text (with the probe's console bytes) stays in the JSON.
func shortReason(s string) string {
	if i := strings.Index(s, " ("); i > 0 {
		s = s[:i]
	}
	return s
}

func trimUnit(s string) string {
	f := strings.Fields(s)
	return f[0]
}

// runGoBench runs the vhost-user server's in-process benchmark and returns its reads/s figure.
func runGoBench(ctx context.Context) string {
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "BenchmarkRead4K", "./blk/vhostuser/")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Sprintf("failed: %v: %s", err, truncate(strings.TrimSpace(string(out)), 400))
	}
	rates := map[string]float64{}
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || !strings.HasPrefix(f[0], "BenchmarkRead4K/") {
			continue
		}
		for i := 1; i < len(f); i++ {
			if f[i] == "reads/s" {
				if v, err := strconv.ParseFloat(f[i-1], 64); err == nil {
					// Drop the -GOMAXPROCS suffix the test binary adds.
					name := strings.TrimPrefix(f[0], "BenchmarkRead4K/")
					if i := strings.LastIndex(name, "-"); i > 0 {
						if _, err := strconv.Atoi(name[i+1:]); err == nil {
							name = name[:i]
						}
					}
					rates[name] = v
					lines = append(lines, strings.Join(f, " "))
				}
			}
		}
	}
	ours, ok := rates["imagefs-blk"]
	if !ok {
		return "no imagefs-blk reads/s line in: " + truncate(string(out), 400)
	}
	res := fmt.Sprintf("imagefs-blk **%.0f reads/s**", ours)
	if qsd, ok := rates["qemu-storage-daemon"]; ok && qsd > 0 {
		res += fmt.Sprintf(", qemu-storage-daemon **%.0f reads/s** (ratio %.2f)", qsd, ours/qsd)
	} else {
		res += " (qemu-storage-daemon not measured: " + truncate(string(out), 200) + ")"
	}
	return res + " (`" + strings.Join(lines, "`, `") + "`)"
}

// hostInfo describes the machine the numbers come from.
func hostInfo(caps *hypervisor.Caps, qsd string, accel hypervisor.Accel, accelWhy, kit, aio, aioWhy string) map[string]string {
	h := map[string]string{
		"cpus": strconv.Itoa(runtime.NumCPU()), "accel": string(accel), "accel_reason": accelWhy,
		"qemu": caps.VersionLine, "qemu_storage_daemon": versionLine(qsd), "fio": versionLine("fio"),
		"go": runtime.Version(), "aio": aio, "aio_reason": aioWhy, "cpu": "unknown", "guest_kernel": "unknown",
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				h["cpu"] = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		h["kernel"] = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile(filepath.Join(kit, "manifest")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "kernel_release="); ok {
				h["guest_kernel"] = v
			}
		}
	}
	return h
}

func fixture(script, cache string) (string, error) {
	cmd := exec.Command(filepath.Join("test", "fixtures", script), cache)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	return strings.TrimSpace(string(out)), err
}
