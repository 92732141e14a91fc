// Command blkbench measures imagefs-blk against the two ways QEMU would
// otherwise serve the same ext4 image, side by side in one guest boot with
// every disk attached at once: (a) imagefs-blk, synthesized metadata with
// data read through the block map and a copy-on-write overlay, served over
// vhost-user-blk by this process; (b) the raw export of that image behind
// QEMU's own virtio-blk-pci (cache=none); (c) the same raw export behind
// qemu-storage-daemon's vhost-user-blk export (O_DIRECT); (d) a control,
// virtio-blk with cache=writeback. The workloads run inside the guest as
// the container process, on each disk in turn, and are timed there. It
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
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
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
	flag.IntVar(&o.reps, "reps", 4, "repetitions of every workload on every disk (the disk order rotates each repetition)")
	flag.IntVar(&o.fioSecs, "fio-runtime", 4, "seconds per fio read run")
	flag.IntVar(&o.fioMiB, "fio-size", 256, "MiB of the file fio writes and then reads")
	flag.IntVar(&o.imageMiB, "image-file", 256, "MiB of random data stored in the image itself for the image-file fio rows")
	flag.BoolVar(&o.skipGoBench, "skip-go-bench", false, "do not run BenchmarkRead4K")
	flag.BoolVar(&o.writeback, "writeback", true, "also attach (d): virtio-blk with cache=writeback, the control that reads through the host page cache like imagefs-blk")
	flag.StringVar(&o.only, "only", "all", "workload groups to run, comma-separated: files (create, chown, ls, cat, rm), seqwrite, randread, seqread, imgrandread, imgseqread; randread and seqread need seqwrite")
	flag.StringVar(&o.backends, "backends", "abcd", "disks to attach, by letter; a and b are always attached (d also needs -writeback)")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of this process (the imagefs-blk server) while the guest runs")
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

// backendResult is one disk under test: its samples from the shared guest.
type backendResult struct {
	Label   string               `json:"label"`
	Name    string               `json:"name"`
	Device  string               `json:"device"`
	Host    string               `json:"host_side"`
	Samples map[string][]float64 `json:"samples"`
	Error   string               `json:"error,omitempty"`
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
	idx, err := overlayfs.FromLayers(ctx, []string{debian, layer}, index.Options{CacheDir: icache})
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
	// Each raw backend gets its own pristine copy: the guest writes. The
	// tools disk (the container's root) is one more, read-only.
	rawRoot, rawB, rawC, rawD := filepath.Join(tmp, "root.raw"), filepath.Join(tmp, "virtio-blk.raw"), filepath.Join(tmp, "qsd.raw"), filepath.Join(tmp, "virtio-blk-wb.raw")
	useC := strings.Contains(o.backends, "c")
	useD := o.writeback && strings.Contains(o.backends, "d")
	raws := []string{rawRoot, rawB}
	if useC {
		raws = append(raws, rawC)
	}
	if useD {
		raws = append(raws, rawD)
	}
	t0 := time.Now()
	for _, p := range raws {
		if err := exportRaw(ctx, disk.Image, hostfs.Opener{CacheDir: icache}, p); err != nil {
			return fmt.Errorf("export raw image: %w", err)
		}
	}
	fmt.Fprintf(os.Stderr, "blkbench: image %.0f MiB (metadata %.1f MiB), %d raw exports in %.1f s\n",
		float64(imgBytes)/(1<<20), float64(disk.Image.Manifest.MetaBytes)/(1<<20), len(raws), time.Since(t0).Seconds())
	aio, aioWhy := hypervisor.ProbeIOUring(ctx, rawB)
	fmt.Fprintf(os.Stderr, "blkbench: host aio %s (%s)\n", aio, aioWhy)

	s := vmSettings{kit: kit, caps: caps, accel: accel, memoryMiB: uint64(o.memoryMiB),
		files: o.files, dirs: o.dirs, reps: o.reps, fioSecs: o.fioSecs, fioMiB: o.fioMiB, only: o.only}

	// (a) imagefs-blk, served by this process.
	ra := &backendResult{Label: "(a) imagefs-blk", Name: "imagefs-blk", Device: fmt.Sprintf("vhost-user-blk-pci (num-queues %d, queue-size %d, seg_max %d)", b.NumQueues, b.QueueSize, b.QueueSize-2),
		Host: "kata-fsx blk.CreateFromIndex in the benchmark process: ext4 metadata synthesized, data read from the layer files (host page cache), writes to a sparse overlay"}
	// (b) the raw export behind QEMU's virtio-blk.
	rb := &backendResult{Label: "(b) virtio-blk cache=none", Name: "virtio-blk", Device: fmt.Sprintf("virtio-blk-pci, -drive format=raw,cache=none,aio=%s", aio),
		Host: "QEMU's block layer on the raw export (O_DIRECT)"}
	results := []*backendResult{ra, rb}
	disks := []benchDisk{
		{"a", &hypervisor.VhostUserBlk{ID: "imagefs-blk-0", SocketPath: disk.Socket, NumQueues: b.NumQueues, QueueSize: b.QueueSize}},
		{"b", &hypervisor.VirtioBlk{ID: "virtio-blk-b", Path: rawB, Format: "raw", Cache: "none", AIO: aio}},
	}
	byLabel := map[string]*backendResult{"a": ra, "b": rb}

	// (c) the raw export behind qemu-storage-daemon's vhost-user-blk.
	rc := &backendResult{Label: "(c) qsd vhost-user-blk", Name: "qsd vhost-user-blk", Device: fmt.Sprintf("vhost-user-blk-pci (num-queues 1, queue-size %d)", b.QueueSize)}
	results = append(results, rc)
	if useC {
		qsdDir := filepath.Join(tmp, "qsd")
		sock := filepath.Join(qsdDir, "vhost-blk.sock")
		if err := os.MkdirAll(qsdDir, 0o700); err != nil {
			return err
		}
		d, err := startStorageDaemon(ctx, qsd, rawC, sock, aio, filepath.Join(qsdDir, "qsd.log"))
		if err != nil {
			return err
		}
		defer d.Stop()
		rc.Host = "qemu-storage-daemon " + strings.Join(d.Args[1:], " ")
		disks = append(disks, benchDisk{"c", &hypervisor.VhostUserBlk{ID: "qsd-blk-0", SocketPath: sock, NumQueues: 1, QueueSize: b.QueueSize}})
		byLabel["c"] = rc
	} else {
		rc.Error = errNotBooted.Error()
	}

	// (d) control: virtio-blk through the host page cache, as (a) reads
	// its layer files and writes its overlay.
	if useD {
		rd := &backendResult{Label: "(d) virtio-blk cache=writeback", Name: "virtio-blk writeback",
			Device: fmt.Sprintf("virtio-blk-pci, -drive format=raw,cache=writeback,aio=%s", aio),
			Host:   "QEMU's block layer on the raw export through the host page cache (control, not a target)"}
		results = append(results, rd)
		disks = append(disks, benchDisk{"d", &hypervisor.VirtioBlk{ID: "virtio-blk-d", Path: rawD, Format: "raw", Cache: "writeback", AIO: aio}})
		byLabel["d"] = rd
	}
	root := &hypervisor.VirtioBlk{ID: "tools-blk", Path: rawRoot, Format: "raw", Cache: "writeback", AIO: aio, ReadOnly: true}

	var labels []string
	for _, d := range disks {
		labels = append(labels, d.label)
	}
	fmt.Fprintf(os.Stderr, "blkbench: booting one guest with disks %s and the tools disk\n", strings.Join(labels, ", "))
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return err
	}
	vmDir := filepath.Join(tmp, "vm")
	if err := os.MkdirAll(vmDir, 0o700); err != nil {
		return err
	}
	tRun := time.Now()
	g, runErr := bootAndMeasure(ctx, s, vmDir, root, disks)
	if err := stopProfile(); err != nil {
		return err
	}
	bootSeconds := 0.0
	if runErr != nil {
		fmt.Fprintf(os.Stderr, "blkbench: guest failed: %v\n", runErr)
		for _, r := range byLabel {
			r.Error = runErr.Error()
		}
	} else {
		bootSeconds = g.bootSeconds
		for _, r := range byLabel {
			r.Samples = map[string][]float64{}
		}
		for _, sm := range g.samples {
			r, ok := byLabel[sm.disk]
			if !ok {
				return fmt.Errorf("guest output names disk %q, which was not attached", sm.disk)
			}
			r.Samples[sm.workload] = append(r.Samples[sm.workload], sm.value)
		}
		fmt.Fprintf(os.Stderr, "blkbench: guest done in %.0f s\n", time.Since(tRun).Seconds())
	}
	diskOpen = false
	if cErr := disk.Remove(); cErr != nil {
		return fmt.Errorf("imagefs-blk disk: %w", cErr)
	}
	if ctx.Err() != nil {
		return ctx.Err()
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
		"boot_seconds":       bootSeconds,
		"inprocess_read4k":   goBench,
		"wall_clock_seconds": time.Since(started).Seconds(),
	}
	md := markdown(res, results, o, goBench, host, bootSeconds)
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

func markdown(res map[string]any, results []*backendResult, o options, goBench string, host map[string]string, bootSeconds float64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Run %s, `%s`, wall clock %.0f s.\n\n", res["date"], res["command"], res["wall_clock_seconds"])
	fmt.Fprintf(&b, "Host: %s, %s CPUs (load average %s at the start, %s at the end: the machine is shared), accelerator **%s** (%s); %s; host kernel %s; guest kernel %s; %s. "+
		"Guest: q35, 1 vCPU, %d MiB RAM (memfd, share=on); host I/O for (b) and (c): O_DIRECT, aio=%s. "+
		"One guest boot with every disk attached at once; each workload ran on every disk in turn before the next workload, the disk order rotating by one each repetition.\n\n",
		host["cpu"], host["cpus"], host["loadavg_start"], host["loadavg_end"], host["accel"], shortReason(host["accel_reason"]), host["qemu"], host["kernel"], host["guest_kernel"], host["fio"],
		o.memoryMiB, host["aio"])
	fmt.Fprintf(&b, "Median of %d repetitions per disk (min–max in brackets). Ratio = imagefs-blk's speed relative to virtio-blk "+
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
			if r.Error == errNotBooted.Error() {
				cells[i] = "not run"
				continue
			}
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
	fmt.Fprintf(&b, "\nTarget met on %d of %d rows", met, total)
	if len(missed) > 0 {
		fmt.Fprintf(&b, "; not met: %s", strings.Join(missed, "; "))
	}
	b.WriteString(".\n\n")
	if bootSeconds > 0 {
		fmt.Fprintf(&b, "Boot of the one guest, QEMU start to container running with every disk mounted: %.1f s.\n\n", bootSeconds)
	}
	for _, r := range results {
		if r.Error != "" {
			fmt.Fprintf(&b, "- **%s failed**: %s\n", r.Name, truncate(strings.ReplaceAll(r.Error, "\n", " "), 400))
		}
	}
	fmt.Fprintf(&b, "Raw request rate, no guest (`go test -run '^$' -bench BenchmarkRead4K ./blk/vhostblk/`: "+
		"the package's test frontend, a real vhost-user frontend over the unix socket with memfd memory, drives one queue with 4 KiB reads "+
		"in batches of 32 over the same 64 MiB raw file, through the host page cache, first against our server, then against "+
		"qemu-storage-daemon's vhost-user-blk export): %s.\n\n", goBench)
	b.WriteString("Notes: (a) reads image data from the layer files through the host page cache and writes its overlay through it, " +
		"while (b) and (c) use O_DIRECT on the raw file (cache=none / cache.direct=on), as asked of the comparison; " +
		"(d), when present, is the same virtio-blk with cache=writeback, a control that shares (a)'s host page cache. " +
		"a / c compares the two vhost-user servers over the same transport; a / c and a / d are context, not targets. " +
		"Each raw backend gets its own pristine copy of the image; guest writes land in (a)'s overlay. " +
		"The container's root (bash, fio, coreutils) is a fifth, read-only copy behind virtio-blk, so no disk under test also serves the tools; " +
		"the disks share one guest, one QEMU and the same stretch of time, so host noise (the shared disk behind (b) and (c), other tenants' CPU) falls on all of them alike. " +
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
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "BenchmarkRead4K", "./blk/vhostblk/")
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
