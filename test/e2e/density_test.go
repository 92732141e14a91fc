package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/md5"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/test/bench/densitybench/density"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// The density image: busybox and densityDirs × densityFilesPerDir small
// files under /data, a tree large enough that an imagefs-blk pod's
// metadata is not lost in the noise of a busybox-only image.
const (
	densityImage       = "kata-fsx.test/density:latest"
	densityDirs        = 40
	densityFilesPerDir = 100
	// densityGuestMiB is the smallest memory Kata gives a VM
	// (config's minMemoryMiB).
	densityGuestMiB = 256
	// densityPodHostMiB bounds what one pod of densityGuestMiB takes on
	// the host (guest RAM, QEMU, shim, virtiofsd), to refuse a count the
	// host cannot hold before starting it.
	densityPodHostMiB = 400
	// densityReserveMiB is left to the rest of the machine.
	densityReserveMiB = 2048
	// densityServingMaxKiB bounds the imagefs-blk serving side's private
	// memory per pod: past it, the shim's share of a pod's cost is no
	// longer small beside the guest's.
	densityServingMaxKiB = 8 << 10
)

// densityScript is every pod's process: it walks the tree and reads one
// file, prints one line, then sleeps until it is killed.
const densityScript = `n=$(find /data | wc -l); s=$(md5sum /data/00/0000); echo "ready $n ${s%% *}"; exec sleep 3600`

// densityLayerTar is the image's one layer, byte for byte the same on
// every run: fixed names, sizes, contents, owners and times.
func densityLayerTar(t *testing.T) (layer []byte, entries, files int, wantLine string) {
	t.Helper()
	bb, err := os.ReadFile(filepath.Join(busyboxRootfs(t), "bin", "busybox"))
	if err != nil {
		t.Fatal(err)
	}
	mtime := time.Unix(1_700_000_000, 0)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(h *tar.Header, data []byte) {
		h.ModTime, h.Format = mtime, tar.FormatPAX
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(data))
			files++
		}
		entries++
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc", "root"} {
		add(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755}, nil)
	}
	add(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755}, bb)
	for _, a := range []string{"sh", "echo", "cat", "find", "wc", "md5sum", "sleep", "ls"} {
		add(&tar.Header{Name: "bin/" + a, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777}, nil)
	}
	add(&tar.Header{Name: "data/", Typeflag: tar.TypeDir, Mode: 0o755}, nil)
	var probe []byte
	for d := 0; d < densityDirs; d++ {
		add(&tar.Header{Name: fmt.Sprintf("data/%02d/", d), Typeflag: tar.TypeDir, Mode: 0o755}, nil)
		for f := 0; f < densityFilesPerDir; f++ {
			i := d*densityFilesPerDir + f
			// 64 B to 8 KiB, contents that differ per file.
			line := fmt.Sprintf("density file %d of %d\n", i, densityDirs*densityFilesPerDir)
			data := bytes.Repeat([]byte(line), (64+(i*797)%8128)/len(line)+1)
			if i == 0 {
				probe = data
			}
			add(&tar.Header{Name: fmt.Sprintf("data/%02d/%04d", d, f), Typeflag: tar.TypeReg, Mode: 0o644}, data)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	sum := md5.Sum(probe)
	// find /data counts /data, its directories and files.
	return buf.Bytes(), entries, files, fmt.Sprintf("ready %d %s", 1+densityDirs+densityDirs*densityFilesPerDir, hex.EncodeToString(sum[:]))
}

// densityImageInfo is the imported image and the line its pods print.
type densityImageInfo struct {
	density.Image
	wantLine string
}

// importDensityImage imports the density image as a docker archive.
func (ce *containerdEnv) importDensityImage(t *testing.T) densityImageInfo {
	t.Helper()
	layer, entries, files, want := densityLayerTar(t)
	diffID := sha256.Sum256(layer)
	imgCfg, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Env": []string{"PATH=/bin"}, "Cmd": []string{"/bin/sh"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
	})
	if err != nil {
		t.Fatal(err)
	}
	cfgSum := sha256.Sum256(imgCfg)
	cfgName := hex.EncodeToString(cfgSum[:]) + ".json"
	manifest, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{densityImage}, "Layers": []string{"layer.tar"}}})
	if err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(t.TempDir(), "density.tar")
	f, err := os.Create(archive)
	if err != nil {
		t.Fatal(err)
	}
	aw := tar.NewWriter(f)
	for _, m := range []struct {
		name string
		data []byte
	}{{"layer.tar", layer}, {cfgName, imgCfg}, {"manifest.json", manifest}} {
		if err := aw.WriteHeader(&tar.Header{Name: m.name, Mode: 0o644, Size: int64(len(m.data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := aw.Write(m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(aw.Close(), f.Close()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if r := ce.ctr(ctx, "images", "import", archive); r.code != 0 {
		t.Fatalf("ctr images import: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	return densityImageInfo{Image: density.Image{Name: densityImage, Files: files, Entries: entries, Bytes: int64(len(layer))}, wantLine: want}
}

// newDensityEnv is a private containerd whose pods are small guests
// (densityGuestMiB, one vCPU) with an agent dial timeout long enough for
// many TCG boots sharing two cores, and the density image imported.
func newDensityEnv(t *testing.T) (*containerdEnv, densityImageInfo) {
	ce := newContainerdEnvFor(t, func() *env {
		e := newEnv(t, `enable_annotations = ["shared_fs"]`)
		dropIn := fmt.Sprintf("[hypervisor.qemu]\ndefault_memory = %d\ndefault_vcpus = 1\n\n[agent.kata]\ndial_timeout = 600\n", densityGuestMiB)
		if err := os.MkdirAll(filepath.Join(e.dir, "config.d"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(e.dir, "config.d", "50-density.toml"), []byte(dropIn), 0o644); err != nil {
			t.Fatal(err)
		}
		return e
	})
	return ce, ce.importDensityImage(t)
}

// requireHostMemory ends the test through testenv when the host cannot
// hold n pods beside the rest of the machine.
func requireHostMemory(t *testing.T, n int) {
	t.Helper()
	avail, err := memAvailableKiB()
	if err != nil {
		t.Fatal(err)
	}
	need := int64(n*densityPodHostMiB+densityReserveMiB) << 10
	if avail < need {
		testenv.Missing(t, "host memory: %d MiB available, %d pods of %d MiB guests need about %d MiB (free memory or run on a larger host)",
			avail>>10, n, densityGuestMiB, need>>10)
	}
}

// memAvailableKiB is the kernel's estimate of memory available for new
// work without swapping (/proc/meminfo MemAvailable).
func memAvailableKiB() (int64, error) {
	return meminfoField("MemAvailable")
}

func meminfoField(name string) (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("meminfo: %w", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == name+":" {
			v, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("meminfo %s: %w", name, err)
			}
			return v, nil
		}
	}
	return 0, fmt.Errorf("meminfo has no %s", name)
}

// densityPod is one pod of a concurrent start: its attached `ctr run`
// client and when the pod's process printed its first line.
type densityPod struct {
	id     string
	client *exec.Cmd
	// ready is when the first line came, since the concurrent start;
	// line is that line (empty if the client ended without one).
	ready  time.Duration
	line   string
	stderr bytes.Buffer
	exited chan struct{} // closed once the client has exited
}

// densityStart starts one pod per id at once on backend, each through an
// attached `ctr run --rm` whose stdout carries the pod's output, and
// waits until every pod printed its first line or its client ended.
func (ce *containerdEnv) densityStart(ctx context.Context, t *testing.T, backend string, ids []string) []*densityPod {
	t.Helper()
	pods := make([]*densityPod, len(ids))
	var wg sync.WaitGroup
	start := time.Now()
	for i, id := range ids {
		p := &densityPod{id: id, exited: make(chan struct{})}
		pods[i] = p
		p.client = exec.CommandContext(ctx, containerdBin("ctr"), append([]string{"-a", ce.sock, "-n", "test"},
			ce.runArgs("--rm", "--annotation", "io.katacontainers.config.hypervisor.shared_fs="+backend,
				densityImage, id, "/bin/sh", "-c", densityScript)...)...)
		p.client.Stderr = &p.stderr
		out, err := p.client.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := p.client.Start(); err != nil {
			t.Fatalf("ctr run %s: %v", id, err)
		}
		wg.Add(1)
		go func() {
			defer close(p.exited)
			r := bufio.NewReader(out)
			line, err := r.ReadString('\n')
			if err == nil {
				p.ready, p.line = time.Since(start), strings.TrimSuffix(line, "\n")
			}
			wg.Done()
			io.Copy(io.Discard, r)
			p.client.Wait()
		}()
	}
	wg.Wait()
	return pods
}

// densityStop kills every pod's process, waits for the clients (which
// delete their containers) and for every shim, QEMU and virtiofsd of the
// env to exit, and reports what is left.
func (ce *containerdEnv) densityStop(ctx context.Context, t *testing.T, pods []*densityPod) []string {
	t.Helper()
	for _, p := range pods {
		if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", p.id); r.code != 0 && p.line != "" {
			t.Errorf("kill %s: exit %d %s", p.id, r.code, r.stderr)
		}
	}
	for _, p := range pods {
		select {
		case <-p.exited:
		case <-ctx.Done():
			t.Errorf("ctr run %s did not exit: %v", p.id, ctx.Err())
		}
	}
	left := lingering(ctx, ce.sock)
	left = append(left, lingering(ctx, ce.stateDir)...)
	if l := ce.ctr(ctx, "containers", "ls", "-q"); strings.TrimSpace(l.stdout) != "" {
		left = append(left, "containers: "+strings.Join(strings.Fields(l.stdout), " "))
	}
	return left
}

// densityProcs lists a pod's host processes: its shim (from the bundle's
// shim.pid) and every descendant (QEMU, virtiofsd and virtiofsd's child),
// measured now.
func (ce *containerdEnv) densityProcs(id string) ([]density.Process, error) {
	b, err := os.ReadFile(filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id, "shim.pid"))
	if err != nil {
		return nil, fmt.Errorf("pod %s: %w", id, err)
	}
	shim, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("pod %s: shim.pid: %w", id, err)
	}
	children := map[int][]int{}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, ok := procParent(pid); ok {
			children[ppid] = append(children[ppid], pid)
		}
	}
	var procs []density.Process
	queue := []int{shim}
	for len(queue) > 0 {
		pid := queue[0]
		queue = append(queue[1:], children[pid]...)
		pr, err := measureProcess(pid)
		if err != nil {
			return nil, fmt.Errorf("pod %s: %w", id, err)
		}
		switch {
		case pid == shim:
			pr.Kind = density.KindShim
		case strings.HasPrefix(pr.Comm, "qemu-system"):
			pr.Kind = density.KindQEMU
		case strings.HasPrefix(pr.Comm, "virtiofsd"):
			pr.Kind = density.KindVirtiofsd
		default:
			pr.Kind = density.KindOther
		}
		procs = append(procs, pr)
	}
	return procs, nil
}

// procParent reads a process's parent from /proc/PID/stat, after the
// command name, which may hold spaces and parentheses.
func procParent(pid int) (int, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, false
	}
	ppid, err := strconv.Atoi(f[1])
	return ppid, err == nil
}

// measureProcess reads a process's PSS (smaps_rollup) and resident set
// by kind (status), in KiB.
func measureProcess(pid int) (density.Process, error) {
	pr := density.Process{PID: pid}
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return pr, fmt.Errorf("process %d: %w", pid, err)
	}
	pr.Comm = strings.TrimSpace(string(comm))
	fields := map[string]*int64{
		"Pss:": &pr.PssKiB, "Pss_Anon:": &pr.PssAnonKiB, "Pss_File:": &pr.PssFileKiB, "Pss_Shmem:": &pr.PssShmemKiB,
		"RssAnon:": &pr.RssAnonKiB, "RssFile:": &pr.RssFileKiB, "RssShmem:": &pr.RssShmemKiB,
	}
	for _, f := range []string{"smaps_rollup", "status"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f))
		if err != nil {
			return pr, fmt.Errorf("process %d (%s): %w", pid, pr.Comm, err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			w := strings.Fields(l)
			if len(w) == 3 && w[2] == "kB" && fields[w[0]] != nil {
				v, err := strconv.ParseInt(w[1], 10, 64)
				if err != nil {
					return pr, fmt.Errorf("process %d %s %q: %w", pid, f, l, err)
				}
				*fields[w[0]] = v
			}
		}
	}
	return pr, nil
}

// densityMetadata counts imagefs-blk's node metadata: the entries
// (directories) of cache/images under the imagefs_blk state_dir, and every meta.bin under
// the test's directory (containerd's root, the pods' state, the caches),
// with their paths.
func (ce *containerdEnv) densityMetadata(t *testing.T) (entries int, metaFiles []string) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(ce.dir, "blk", "cache", "images"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() { // an entry; <key>.lock beside it is its lock file
			entries++
		}
	}
	err = filepath.WalkDir(ce.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // a file of a pod going away
			}
			return err
		}
		if d.IsDir() && p != ce.dir && isMountPoint(p) {
			return fs.SkipDir // a rootfs or shared directory: the image's files, not node state
		}
		if !d.IsDir() && d.Name() == ext4.MetaFile {
			metaFiles = append(metaFiles, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return entries, metaFiles
}

// metaInUse lists the distinct meta.bin files the pods' processes hold
// open or mapped (/proc/PID/fd and /proc/PID/maps): how many copies of the
// metadata the running pods actually serve.
func metaInUse(pods []density.Pod) []string {
	seen := map[string]bool{}
	for _, p := range pods {
		for _, pr := range p.Procs {
			fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pr.PID))
			for _, fd := range fds {
				if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pr.PID, fd.Name())); err == nil && filepath.Base(l) == ext4.MetaFile {
					seen[l] = true
				}
			}
			mapped, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pr.PID))
			for _, l := range strings.Split(string(mapped), "\n") {
				if f := strings.Fields(l); len(f) >= 6 && filepath.Base(f[5]) == ext4.MetaFile {
					seen[f[5]] = true
				}
			}
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// isMountPoint reports whether dir is mounted on (its device differs from
// its parent's).
func isMountPoint(dir string) bool {
	var a, b syscall.Stat_t
	if syscall.Lstat(dir, &a) != nil || syscall.Lstat(filepath.Dir(dir), &b) != nil {
		return false
	}
	return a.Dev != b.Dev
}

// densityIDs names n pods of a run.
func densityIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%02d", prefix, i)
	}
	return ids
}

// densityMeasure measures every pod of a started run.
func (ce *containerdEnv) densityMeasure(t *testing.T, pods []*densityPod) ([]density.Pod, int64) {
	t.Helper()
	out := make([]density.Pod, 0, len(pods))
	var clients int64
	for _, p := range pods {
		procs, err := ce.densityProcs(p.id)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, density.Pod{ID: p.id, ReadySeconds: p.ready.Seconds(), Procs: procs})
		if c, err := measureProcess(p.client.Process.Pid); err == nil {
			clients += c.PssKiB
		}
	}
	return out, clients
}

// checkReady fails the test for every pod that did not print the line
// the image makes it print.
func checkReady(t *testing.T, pods []*densityPod, want string) {
	t.Helper()
	for _, p := range pods {
		if p.line != want {
			t.Errorf("pod %s printed %q, want %q; ctr: %s", p.id, p.line, want, strings.TrimSpace(p.stderr.String()))
		}
	}
}

// TestDensityImagefsBlk20: the density claim. Twenty pods of one image
// started at once on imagefs-blk; once all of them run, each pod's
// serving side (the shim, which serves the pod's vhost-user-blk disk in
// process) holds at most 8 MiB of private memory, the synthesized
// metadata exists once on the node (one cache/images entry, one meta.bin,
// none in a pod's disk directory), and stopping them leaves no shim or
// QEMU behind.
func TestDensityImagefsBlk20(t *testing.T) {
	const n = 20
	guestKit(t)
	requireHostMemory(t, n)
	ce, img := newDensityEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	pods := ce.densityStart(ctx, t, "imagefs-blk", densityIDs("dens", n))
	stopped := false
	defer func() {
		if !stopped {
			ce.densityStop(ctx, t, pods)
		}
	}()
	checkReady(t, pods, img.wantLine)
	if t.Failed() {
		t.FailNow()
	}
	measured, _ := ce.densityMeasure(t, pods)
	var last time.Duration
	for i, p := range measured {
		last = max(last, pods[i].ready)
		rssAnon := p.ServingRssAnonKiB("imagefs-blk")
		pss := p.Sum("", func(pr density.Process) int64 { return pr.PssKiB })
		t.Logf("pod %s: first output at %.1f s, shim RssAnon %d KiB, pod PSS %d KiB (%d processes)",
			p.ID, p.ReadySeconds, rssAnon, pss, len(p.Procs))
		if rssAnon > densityServingMaxKiB {
			t.Errorf("pod %s: the imagefs-blk serving side (shim pid %d) holds %d KiB of private memory (RssAnon), over %d KiB",
				p.ID, p.Procs[0].PID, rssAnon, densityServingMaxKiB)
		}
		if got := kinds(p.Procs); !slices.Equal(got, []string{density.KindQEMU, density.KindShim}) {
			t.Errorf("pod %s: host processes %v, want one shim and one QEMU", p.ID, got)
		}
	}
	t.Logf("%d pods: last first output at %.1f s after the concurrent start", n, last.Seconds())
	entries, metaFiles := ce.densityMetadata(t)
	inUse := metaInUse(measured)
	t.Logf("metadata on the node: %d cache/images entries, %d meta.bin files %s; %d distinct ones open or mapped by the pods %s",
		entries, len(metaFiles), firstFew(metaFiles), len(inUse), firstFew(inUse))
	if entries != 1 {
		t.Errorf("cache/images holds %d entries for one image, want 1", entries)
	}
	imagesDir := filepath.Join(ce.dir, "blk", "cache", "images") + string(filepath.Separator)
	if len(metaFiles) != 1 || !strings.HasPrefix(metaFiles[0], imagesDir) {
		t.Errorf("%d meta.bin files on the node %s, want exactly one, under %s", len(metaFiles), firstFew(metaFiles), imagesDir)
	}
	var inPods []string
	for _, m := range metaFiles {
		if strings.HasPrefix(m, ce.stateDir+string(filepath.Separator)) {
			inPods = append(inPods, m)
		}
	}
	if len(inPods) > 0 {
		t.Errorf("%d pods' disk directories hold their own metadata %s", len(inPods), firstFew(inPods))
	}
	stopped = true
	if left := ce.densityStop(ctx, t, pods); len(left) > 0 {
		t.Errorf("left after stopping every pod: %v", left)
	}
}

// firstFew shows up to three paths and how many more there are.
func firstFew(paths []string) string {
	if len(paths) <= 3 {
		return fmt.Sprint(paths)
	}
	return fmt.Sprintf("%v and %d more", paths[:3], len(paths)-3)
}

// kinds lists the process kinds, sorted.
func kinds(procs []density.Process) []string {
	var k []string
	for _, p := range procs {
		k = append(k, p.Kind)
	}
	slices.Sort(k)
	return k
}

// TestDensityBench is the density benchmark (`make bench-density`), not
// part of `make test`: for each backend of KATA_FSX_DENSITY_BACKENDS
// (imagefs-blk,virtio-fs) and each count of KATA_FSX_DENSITY_N (1,5,10,20),
// that many pods of one image started at once, measured once every pod
// printed its line, then stopped; the result goes to KATA_FSX_DENSITY_OUT
// as JSON (test/bench/densitybench renders it). A count the host's
// memory cannot hold, or one that would not fit in what is left of
// KATA_FSX_DENSITY_BUDGET (40m), ends that backend's sweep;
// KATA_FSX_DENSITY_TITLE names the run in the rendered section.
func TestDensityBench(t *testing.T) {
	out := os.Getenv("KATA_FSX_DENSITY_OUT")
	if out == "" {
		t.Skip("the density benchmark runs with KATA_FSX_DENSITY_OUT set (make bench-density)")
	}
	counts, err := parseCounts(envOr("KATA_FSX_DENSITY_N", "1,5,10,20"))
	if err != nil {
		t.Fatal(err)
	}
	budget, err := time.ParseDuration(envOr("KATA_FSX_DENSITY_BUDGET", "40m"))
	if err != nil {
		t.Fatalf("KATA_FSX_DENSITY_BUDGET: %v", err)
	}
	backends := strings.Split(envOr("KATA_FSX_DENSITY_BACKENDS", "imagefs-blk,virtio-fs"), ",")
	guestKit(t)
	requireHostMemory(t, counts[0])
	began := time.Now()
	res := density.Result{
		Title:   os.Getenv("KATA_FSX_DENSITY_TITLE"),
		Date:    began.UTC().Format(time.RFC3339),
		Command: densityCommand(),
		Commit:  gitDescribe(),
		Guest:   density.Guest{MemoryMiB: densityGuestMiB, VCPUs: 1},
	}
	res.Host = densityHost(t)
	ce, img := newDensityEnv(t)
	res.Image = img.Image
	res.Host.Containerd = ce.version.Full
	// Each backend gets an equal share of the budget, the time a sweep
	// may take; a count starts only if the previous count's start time,
	// scaled to it, still fits.
	share := budget / time.Duration(len(backends))
	for _, backend := range backends {
		be := density.Backend{Name: backend}
		sweepStart := time.Now()
		var prevTook time.Duration
		prevN := 0
		for _, n := range counts {
			avail, err := memAvailableKiB()
			if err != nil {
				t.Fatal(err)
			}
			if need := int64(n*densityPodHostMiB+densityReserveMiB) << 10; avail < need {
				be.Stopped = fmt.Sprintf("%d pods need about %d MiB, %d MiB available", n, need>>10, avail>>10)
				break
			}
			if prevN > 0 {
				if guess := prevTook * time.Duration(n) / time.Duration(prevN); time.Since(sweepStart)+guess > share {
					be.Stopped = fmt.Sprintf("%d pods would not fit in the time budget (%s for the sweep; %d pods took %s)", n, share, prevN, prevTook.Round(time.Second))
					break
				}
			}
			runStart := time.Now()
			r := ce.densityRun(t, backend, n, img.wantLine, avail)
			prevTook, prevN = time.Since(runStart), n
			t.Logf("%s, %d pods: last first output %.1f s, PSS of all pods %d MiB (%.1f MiB per pod), took %s",
				backend, n, r.LastSeconds, r.TotalPSSKiB()>>10, float64(r.TotalPSSKiB())/1024/float64(n), prevTook.Round(time.Second))
			be.Runs = append(be.Runs, r)
			if t.Failed() {
				break
			}
		}
		res.Backends = append(res.Backends, be)
		if t.Failed() {
			break
		}
	}
	res.Host.LoadEnd = loadAvg()
	res.WallSeconds = time.Since(began).Seconds()
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s", out)
}

// densityRun starts n pods at once on backend, measures them once all
// printed, and stops them; availBefore is MemAvailable before the start.
func (ce *containerdEnv) densityRun(t *testing.T, backend string, n int, want string, availBefore int64) density.Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	prefix := "d" + strings.ReplaceAll(backend, "-", "")[:4] + strconv.Itoa(n)
	pods := ce.densityStart(ctx, t, backend, densityIDs(prefix, n))
	r := density.Run{N: n, Load: loadAvg()}
	checkReady(t, pods, want)
	if !t.Failed() {
		availAfter, err := memAvailableKiB()
		if err != nil {
			t.Fatal(err)
		}
		r.Pods, r.ClientsPSSKiB = ce.densityMeasure(t, pods)
		r.MemAvailableDropKiB = availBefore - availAfter
		r.FirstSeconds = r.Pods[0].ReadySeconds
		for _, p := range r.Pods {
			r.LastSeconds = max(r.LastSeconds, p.ReadySeconds)
			r.FirstSeconds = min(r.FirstSeconds, p.ReadySeconds)
		}
		if backend == "imagefs-blk" {
			var metas []string
			r.MetadataEntries, metas = ce.densityMetadata(t)
			r.MetaFiles = len(metas)
			r.MetaInUse = len(metaInUse(r.Pods))
		}
	}
	if left := ce.densityStop(ctx, t, pods); len(left) > 0 {
		t.Errorf("%s, %d pods: left after stopping: %v", backend, n, left)
	}
	return r
}

// densityCommand is how this run was asked for: the benchmark's settings
// from the environment and the test it ran.
func densityCommand() string {
	var set []string
	for _, v := range []string{"KATA_FSX_DENSITY_N", "KATA_FSX_DENSITY_BACKENDS", "KATA_FSX_DENSITY_BUDGET"} {
		if os.Getenv(v) != "" {
			set = append(set, v+"="+os.Getenv(v))
		}
	}
	return strings.Join(append(set, "go test -run '^TestDensityBench$' ./test/e2e"), " ")
}

func parseCounts(s string) ([]int, error) {
	var counts []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("KATA_FSX_DENSITY_N: %q is not a pod count", f)
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	return counts, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "unknown"
}

func gitDescribe() string {
	out, err := exec.Command("git", "-C", repoRoot, "describe", "--always", "--dirty").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

// densityHost describes the host for the result.
func densityHost(t *testing.T) density.Host {
	h := density.Host{CPUs: runtime.NumCPU(), LoadStart: loadAvg(), Accel: testAccel(kitDir())}
	if total, err := meminfoField("MemTotal"); err == nil {
		h.MemTotalMiB = total >> 10
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		h.Kernel = strings.TrimSpace(string(b))
	}
	if out, err := exec.Command("/usr/bin/qemu-system-x86_64", "--version").Output(); err == nil {
		h.QEMU, _, _ = strings.Cut(string(out), "\n")
	}
	return h
}
