package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/metrics"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// The host-cost pass (`kata-fsx bench --hostcost`) counts what each backend
// costs the host, apart from the timed matrix so that tracing never touches
// a timed number: per row one pod is started with `kata-fsx run --keep`,
// and each step runs in it through `kata-fsx exec` while strace counts the
// serving process's system calls. A baseline step (the same exec running a
// no-op) is subtracted from every workload step, so the exec, the shell and
// the guest's idle activity over a step do not count, and boot and mount
// happen before any counting starts.

// HostCostStep is one workload of the pass: Prep runs untimed and
// uncounted before it (the guest's caches are then dropped), Cmd is what is
// counted.
type HostCostStep struct {
	Name string `json:"name"`
	What string `json:"what"`
	Prep string `json:"prep,omitempty"`
	Cmd  string `json:"cmd"`
}

// baselineStep is subtracted from every other step.
const baselineStep = "baseline"

// HostCostSteps are the workloads the pass counts, the baseline first; each
// does a fixed amount of work (no time-based run), so the counts compare
// across backends.
func HostCostSteps() []HostCostStep {
	return []HostCostStep{
		{Name: baselineStep, What: "no-op (`sh -c true` through kata-fsx exec), subtracted from the others", Cmd: "true"},
		{Name: "stat", What: "lstat every entry of a 1056-entry, 5 MiB package tree (lodash)", Cmd: "find /bench/nm/node_modules/lodash -print0 | xargs -0 stat -c %s"},
		{Name: "chown", What: "chown -R the same tree to another owner, then sync", Cmd: "chown -R 1000:1000 /bench/nm/node_modules/lodash && sync"},
		{Name: "create", What: "cp -a of the same tree into a new directory, then sync",
			Prep: "rm -rf /bench/work/lodash && mkdir -p /bench/work", Cmd: "cp -a /bench/nm/node_modules/lodash /bench/work/lodash && sync"},
		{Name: "seqread", What: "read 8 MiB of a file sequentially (dd bs=128k)", Cmd: "dd if=/bench/node_modules.tar of=/dev/null bs=128k count=64"},
		{Name: "randread", What: "256 random 4 KiB reads of a 64 MiB file (fio psync, buffered)",
			Cmd: "fio --name=rr --filename=/bench/node_modules.tar --readonly --rw=randread --bs=4k --size=64m --number_ios=256 --ioengine=psync --norandommap --randrepeat=1 --output=/dev/null"},
		{Name: "write-fsync", What: "write 1 MiB in 4 KiB writes, then fsync (dd conv=fsync)",
			Prep: "rm -f /bench/work/wf && mkdir -p /bench/work", Cmd: "dd if=/dev/zero of=/bench/work/wf bs=4k count=256 conv=fsync"},
	}
}

// hostCostSteps are the steps the pass runs: the baseline and those of
// --only (all when it is empty).
func (d *driver) hostCostSteps() ([]HostCostStep, error) {
	want := map[string]bool{}
	for _, w := range strings.Split(d.o.Only, ",") {
		if w = strings.TrimSpace(w); w != "" {
			want[w] = true
		}
	}
	var out []HostCostStep
	known := map[string]bool{}
	for _, st := range HostCostSteps() {
		known[st.Name] = true
		if st.Name == baselineStep || len(want) == 0 || want[st.Name] {
			out = append(out, st)
		}
	}
	for w := range want {
		if known[w] {
			continue
		}
		return nil, fmt.Errorf("--only %s: not a --hostcost workload (those are stat, chown, create, seqread, randread, write-fsync)", w)
	}
	return out, nil
}

// HostCostDefaultBackends are the rows of the pass without --backends: one
// of each way the rootfs reaches the guest.
func HostCostDefaultBackends() string {
	return strings.Join([]string{"virtio-fs:cache=auto", KindVirtio9P, KindImagefsBlk, KindVirtioBlk}, ";")
}

// HostCostReport is the JSON document of a host-cost pass.
type HostCostReport struct {
	Date    string            `json:"date"`
	Command string            `json:"command"`
	Host    map[string]string `json:"host"`
	Steps   []HostCostStep    `json:"steps"`
	Rows    []*HostCostRow    `json:"rows"`
	Seconds float64           `json:"wall_seconds"`
}

// HostCostRow is the pass's result for one backend row.
type HostCostRow struct {
	Spec    string `json:"backend"`
	Kind    string `json:"kind"`
	Skipped string `json:"skipped,omitempty"`
	Error   string `json:"error,omitempty"`
	// Serving names the processes whose system calls were counted.
	Serving string `json:"serving"`
	// Requests says how the requests were counted, or why they were not.
	Requests string `json:"requests_counted_by"`
	// Raw are the counts of every step as measured, Net the workload steps
	// less the baseline step.
	Raw map[string]Counts `json:"raw"`
	Net map[string]Counts `json:"net"`
	// Failed are the steps that failed, with why.
	Failed  map[string]string `json:"failed,omitempty"`
	Seconds float64           `json:"wall_seconds"`
}

// requestSource says how a row's requests are counted; "" when they are not.
func requestSource(kind string) string {
	switch kind {
	case KindImagefsBlk:
		return "the imagefs-blk server's own counters (blk.Disk.Ops, kata_fsx_imagefs_blk_requests_total on the pod's metrics socket, `run --metrics`), scraped before and after the step; the guest's /proc/diskstats around the command, in the JSON as guest_disk_requests, tell the same"
	case KindVirtioBlk:
		return "guest /proc/diskstats: read, write, flush and discard requests completed by the rootfs disk, each one virtio-blk request the host served"
	case KindVirtioFS:
		return "virtiofsd -d: its log line per FUSE request received (\"unique: N, opcode: ...\"), read from a strace of its writes in a second pod, so the logging is not in the system call counts"
	}
	return ""
}

// hostCost runs the pass over every row of o and writes its report.
func (d *driver) hostCost(ctx context.Context, started time.Time, stdout io.Writer) error {
	if _, err := exec.LookPath("strace"); err != nil {
		return fmt.Errorf("--hostcost counts system calls with strace: %w", err)
	}
	steps, err := d.hostCostSteps()
	if err != nil {
		return err
	}
	rep := &HostCostReport{Date: started.UTC().Format(time.RFC3339), Command: d.o.Command, Host: d.host, Steps: steps}
	for i, r := range d.o.Backends {
		if ctx.Err() != nil {
			rep.Rows = append(rep.Rows, &HostCostRow{Spec: r.Spec, Kind: r.Kind, Error: "not run: interrupted"})
			continue
		}
		rep.Rows = append(rep.Rows, d.hostCostRow(ctx, i, r, steps))
	}
	rep.Seconds = time.Since(started).Seconds()
	rep.Host["loadavg_end"] = LoadAvg()
	if err := os.MkdirAll(filepath.Dir(d.o.HostCostJSON), 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(d.o.HostCostJSON, append(js, '\n'), 0o644); err != nil {
		return err
	}
	md := HostCostMarkdown(rep, d.o.HostCostJSON)
	if err := ReplaceSection(d.o.OutMD, hostCostSection, md); err != nil {
		return err
	}
	fmt.Fprint(stdout, md)
	var failed []string
	for _, r := range rep.Rows {
		if r.Error != "" {
			failed = append(failed, r.Spec)
		}
		for s := range r.Failed {
			failed = append(failed, r.Spec+" "+s)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("report written to %s, but these failed (errors in %s): %s", d.o.OutMD, d.o.HostCostJSON, strings.Join(failed, ", "))
	}
	return ctx.Err()
}

func (d *driver) hostCostRow(ctx context.Context, n int, r Row, steps []HostCostStep) *HostCostRow {
	res := &HostCostRow{Spec: r.Spec, Kind: r.Kind, Raw: map[string]Counts{}, Net: map[string]Counts{}, Failed: map[string]string{}}
	started := time.Now()
	defer func() { res.Seconds = time.Since(started).Seconds() }()
	if !r.UsesVM() {
		res.Skipped = "no VM: nothing of the host's serves it"
		return res
	}
	if why := r.SkipReason(d.caps); why != "" {
		res.Skipped = why
		d.logf("%s: skipped: %s", r.Spec, why)
		return res
	}
	res.Requests = requestSource(r.Kind)
	if res.Requests == "" {
		res.Requests = "not counted: QEMU's 9p server has no request counter"
	}
	ctx, cancel := context.WithTimeout(ctx, d.o.RowTimeout)
	defer cancel()
	dir := filepath.Join(d.tmp, fmt.Sprintf("hc%d", n))
	err := d.hostCostBoots(ctx, dir, n, r, steps, res)
	if rmErr := os.RemoveAll(dir); rmErr != nil {
		err = errors.Join(err, rmErr)
	}
	if err != nil {
		res.Error = err.Error()
		d.logf("%s: failed: %s", r.Spec, truncate(res.Error, 600))
	}
	base, ok := res.Raw[baselineStep]
	for name, c := range res.Raw {
		if name != baselineStep && ok {
			res.Net[name] = c.Minus(base)
		}
	}
	if len(res.Failed) == 0 {
		res.Failed = nil
	}
	d.logf("%s: host cost counted in %.0f s", r.Spec, time.Since(started).Seconds())
	return res
}

// hostCostBoots runs the row's counting pod, and for virtio-fs a second
// pod whose daemon logs every request.
func (d *driver) hostCostBoots(ctx context.Context, dir string, n int, r Row, steps []HostCostStep, res *HostCostRow) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := d.hostCostBoot(ctx, filepath.Join(dir, "s"), n, r, steps, false, res); err != nil {
		return err
	}
	if r.Kind == KindVirtioFS {
		return d.hostCostBoot(ctx, filepath.Join(dir, "f"), n, r, steps, true, res)
	}
	return nil
}

// hostCostBoot starts one pod of the row, runs every step in it and stops
// it. With fuseLog (virtio-fs only) the daemon runs with -d and only its
// log writes are traced, for the request counts; otherwise the system
// calls are counted and, on block rows, the disk's requests.
func (d *driver) hostCostBoot(ctx context.Context, dir string, n int, r Row, steps []HostCostStep, fuseLog bool, res *HostCostRow) (err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	cfg, err := d.rowConfig(dir, r)
	if err != nil {
		return err
	}
	// Counts do not depend on speed: a pod booting slowly on a loaded host
	// is waited for rather than failed.
	extra := "[agent.kata]\ndial_timeout = 300\n"
	if fuseLog {
		extra += fmt.Sprintf("[hypervisor.qemu]\nvirtio_fs_extra_args = [\"--thread-pool-size=%d\", \"-d\", \"-o\", \"log_level=debug\"]\n", max(r.Threads, 1))
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(cfg), "config.d", "zzz-hostcost.toml"), []byte(extra), 0o644); err != nil {
		return err
	}
	rootfs, err := d.rowRootfs(ctx, dir, r)
	if err != nil {
		return err
	}
	// Short: the pod's sockets live below dir, and a unix socket's path
	// has at most 107 bytes.
	id := fmt.Sprintf("hc%d-%d", n, os.Getpid())
	if fuseLog {
		id += "f"
	}
	what := "system calls"
	if fuseLog {
		what = "FUSE requests (virtiofsd -d)"
	}
	d.logf("%s: pod for %s", r.Spec, what)
	pod, err := d.startKeptPod(ctx, dir, cfg, r.Kind, rootfs, id, r.Kind == KindImagefsBlk)
	if err != nil {
		return err
	}
	defer func() {
		if serr := pod.stop(); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop pod: %w", serr))
		}
	}()
	pids, names, err := servingPIDs(pod.cmd.Process.Pid, r.Kind)
	if err != nil {
		return err
	}
	if !fuseLog {
		res.Serving = names
	}
	for _, st := range steps {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c, err := d.hostCostStep(ctx, dir, cfg, id, pids, st, fuseLog, pod.metrics)
		if err != nil && ctx.Err() != nil {
			return fmt.Errorf("%s: interrupted: %w", st.Name, ctx.Err())
		}
		if err != nil {
			res.Failed[st.Name] = err.Error()
			d.logf("%s: %s: %s", r.Spec, st.Name, truncate(err.Error(), 400))
			continue
		}
		raw := res.Raw[st.Name]
		if fuseLog {
			raw.Requests = c.Requests
		} else {
			raw.Syscalls, raw.GuestDisk = c.Syscalls, c.GuestDisk
			if r.Kind == KindImagefsBlk || r.Kind == KindVirtioBlk {
				raw.Requests = c.Requests
			}
		}
		res.Raw[st.Name] = raw
		d.logf("%s: %s: %d requests, %d system calls", r.Spec, st.Name, raw.RequestTotal(), raw.SyscallTotal())
	}
	return nil
}

// rowRootfs prepares the row's --rootfs source. Directory rows get a copy
// of the image each; imagefs-blk gets it as one layer, as containerd's
// snapshotter hands a rootfs to the shim (the per-layer index cache then
// works as for real pods; the guest's writes go to the overlay, not the
// layer); virtio-blk gets the same image exported raw.
func (d *driver) rowRootfs(ctx context.Context, dir string, r Row) (string, error) {
	switch r.Kind {
	case KindVirtioFS, KindVirtio9P:
		rootfs := filepath.Join(dir, "rootfs")
		d.logf("%s: copying the bench image", r.Spec)
		if out, err := exec.CommandContext(ctx, "cp", "-a", d.o.Image, rootfs).CombinedOutput(); err != nil {
			return "", fmt.Errorf("copy bench image: %w: %s", err, out)
		}
		return rootfs, nil
	case KindImagefsBlk:
		return "layers:" + d.o.Image, nil
	case KindVirtioBlk:
		raw := filepath.Join(dir, "rootfs.raw")
		if err := d.exportRaw(ctx, dir, raw); err != nil {
			return "", err
		}
		return "raw:" + raw, nil
	}
	return "", fmt.Errorf("row %s: no rootfs for kind %s", r.Spec, r.Kind)
}

// keptPod is a `kata-fsx run --keep` whose container idles for execs.
type keptPod struct {
	cmd  *exec.Cmd
	done chan error
	// metrics is the pod's metrics socket, "" when not served.
	metrics string
}

// startKeptPod boots the pod and returns once run says it keeps running.
func (d *driver) startKeptPod(ctx context.Context, dir, cfg, backend, rootfs, id string, withMetrics bool) (*keptPod, error) {
	logPath := filepath.Join(dir, "run.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	args := []string{"run", "--config", cfg, "--backend", backend, "--rootfs", rootfs, "--keep", "--id", id}
	if withMetrics {
		args = append(args, "--metrics")
	}
	cmd := exec.Command(d.o.KataFSX, append(args, "--", "/bin/true")...)
	cmd.Stdout, cmd.Stderr = io.Discard, pw
	// Its own process group: a Ctrl-C at the terminal reaches only the
	// bench, which then stops the pod with one SIGTERM and waits for its
	// teardown; the pod dies with the bench all the same.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		return nil, fmt.Errorf("kata-fsx run: %w", err)
	}
	pw.Close()
	p := &keptPod{cmd: cmd, done: make(chan error, 1)}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		signalled := false
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if sock, ok := strings.CutPrefix(sc.Text(), "kata-fsx run: metrics on "); ok && !signalled {
				p.metrics = strings.TrimSpace(sock)
			}
			if !signalled && strings.Contains(sc.Text(), "keeps running") {
				close(ready)
				signalled = true
			}
		}
		pr.Close()
		p.done <- cmd.Wait()
	}()
	select {
	case <-ready:
		if withMetrics && p.metrics == "" {
			return p, fmt.Errorf("kata-fsx run --metrics named no metrics socket%s", tailOf(logPath, 800))
		}
		return p, nil
	case err := <-p.done:
		p.done <- err
		return nil, fmt.Errorf("kata-fsx run --keep exited before the pod was up: %v%s", err, tailOf(logPath, 1500))
	case <-ctx.Done():
		err := p.stop()
		return nil, errors.Join(fmt.Errorf("waiting for the pod: %w%s", ctx.Err(), tailOf(logPath, 1500)), err)
	}
}

// stop tears the pod down as a user's Ctrl-C would, and waits for it.
func (p *keptPod) stop() error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case <-p.done:
		return nil // it exits non-zero on a signal: that is the ask, not a failure
	case <-time.After(60 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("kata-fsx run did not stop within 60 s of SIGTERM; killed")
	}
}

// servingPIDs are the processes whose system calls a row's step counts:
// the ones that serve the rootfs (sandbox.ProcessRef's ServesRootfs):
// kata-fsx run itself for imagefs-blk, virtiofsd and its forked child for
// virtio-fs, QEMU for virtio-9p and virtio-blk.
func servingPIDs(runPID int, kind string) ([]int, string, error) {
	if kind == KindImagefsBlk {
		return []int{runPID}, "kata-fsx (imagefs-blk's vhost-user-blk server, in the run process)", nil
	}
	want, label := "qemu-system", "qemu (its 9p server)"
	switch kind {
	case KindVirtioFS:
		want, label = "virtiofsd", "virtiofsd (both processes)"
	case KindVirtioBlk:
		label = "qemu (its virtio-blk device)"
	}
	var pids []int
	for _, p := range sandbox.Descendants(runPID) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", p))
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), want) {
			pids = append(pids, p)
		}
	}
	if len(pids) == 0 {
		return nil, "", fmt.Errorf("no %s process below kata-fsx run (pid %d)", want, runPID)
	}
	return pids, label, nil
}

// stepScript runs the step's command ($1) in the guest between two reads
// of /proc/diskstats, and reports its status; the command's output goes
// to tmpfs, not to the filesystem under test.
const stepScript = `b=$(cat /proc/diskstats)
sh -c "$1" >/dev/null 2>/dev/shm/hostcost.err
rc=$?
a=$(cat /proc/diskstats)
printf '@@BEFORE\n%s\n@@AFTER\n%s\n@@RC %d\n' "$b" "$a" "$rc"
[ "$rc" = 0 ] || tail -n 3 /dev/shm/hostcost.err
`

// hostCostStep runs one step: its preparation and a cache drop uncounted,
// then its command with strace attached to the serving processes.
func (d *driver) hostCostStep(ctx context.Context, dir, cfg, id string, pids []int, st HostCostStep, fuseLog bool, metricsSock string) (Counts, error) {
	prep := "sync; echo 3 > /proc/sys/vm/drop_caches"
	if st.Prep != "" {
		prep = "(" + st.Prep + ") && " + prep
	}
	if _, err := d.execIn(ctx, cfg, id, "/bin/sh", "-c", prep); err != nil {
		return Counts{}, fmt.Errorf("prepare: %w", err)
	}
	out := filepath.Join(dir, st.Name+".strace")
	args := []string{"-f", "-o", out}
	if fuseLog {
		// Only the log's writes, long enough to show the opcode.
		args = append(args, "-e", "trace=write", "-s", "256")
	} else {
		args = append(args, "-c")
	}
	for _, p := range pids {
		args = append(args, "-p", strconv.Itoa(p))
	}
	// The server's own counters are read outside strace's window: the
	// scrape is served by the traced process.
	var ops0, ops1 map[string]int64
	var err error
	if metricsSock != "" {
		if ops0, err = blkRequests(ctx, metricsSock); err != nil {
			return Counts{}, err
		}
	}
	tr, err := startStrace(ctx, args, len(pids))
	if err != nil {
		return Counts{}, err
	}
	stdout, runErr := d.execIn(ctx, cfg, id, "/bin/sh", "-c", stepScript, "hostcost", st.Cmd)
	if err := tr.stop(); err != nil {
		return Counts{}, err
	}
	if metricsSock != "" && runErr == nil {
		if ops1, err = blkRequests(ctx, metricsSock); err != nil {
			return Counts{}, err
		}
	}
	if runErr != nil {
		return Counts{}, runErr
	}
	before, after, rc, err := ParseStepOutput(stdout)
	if err != nil {
		return Counts{}, err
	}
	if rc != 0 {
		_, tail, _ := strings.Cut(stdout, "@@RC ")
		return Counts{}, fmt.Errorf("%s exited %d: %s", st.Cmd, rc, oneLine(tail, 300))
	}
	text, err := os.ReadFile(out)
	if err != nil {
		return Counts{}, err
	}
	if fuseLog {
		return Counts{Requests: CountFUSERequests(string(text))}, nil
	}
	calls, err := ParseStraceSummary(string(text))
	if err != nil {
		return Counts{}, err
	}
	disk := minus(after, before)
	if metricsSock != "" {
		return Counts{Syscalls: calls, Requests: minus(ops1, ops0), GuestDisk: disk}, nil
	}
	return Counts{Syscalls: calls, Requests: disk}, nil
}

// blkRequests scrapes the pod's metrics for the imagefs-blk server's
// requests by operation.
func blkRequests(ctx context.Context, sock string) (map[string]int64, error) {
	fams, err := metrics.ScrapeUnix(ctx, sock, 4<<20)
	if err != nil {
		return nil, err
	}
	return RequestsByOp(fams, "kata_fsx_imagefs_blk_requests_total")
}

// execIn runs a command in the pod's container and returns its stdout.
func (d *driver) execIn(ctx context.Context, cfg, id string, cmd ...string) (string, error) {
	var out, errb bytes.Buffer
	c := exec.CommandContext(ctx, d.o.KataFSX, append([]string{"exec", "--config", cfg, id, "--"}, cmd...)...)
	c.Stdout, c.Stderr = &out, &errb
	if err := c.Run(); err != nil {
		return out.String(), fmt.Errorf("kata-fsx exec %s: %w: %s", oneLine(strings.Join(cmd, " "), 120), err, oneLine(errb.String(), 400))
	}
	return out.String(), nil
}

// tracer is a running strace.
type tracer struct {
	cmd    *exec.Cmd
	stderr *bytes.Buffer
	done   chan error
}

// startStrace starts strace and returns once it has attached to all of
// its n processes (it says so on stderr), so no call of the step is missed.
func startStrace(ctx context.Context, args []string, n int) (*tracer, error) {
	cmd := exec.Command("strace", args...)
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = pw
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		return nil, fmt.Errorf("strace: %w", err)
	}
	pw.Close()
	t := &tracer{cmd: cmd, stderr: &bytes.Buffer{}, done: make(chan error, 1)}
	attached := make(chan struct{})
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		pr.Close()
		close(lines)
	}()
	go func() {
		seen := 0
		for l := range lines {
			t.stderr.WriteString(l + "\n")
			if strings.Contains(l, " attached") && strings.HasPrefix(l, "strace: Process ") {
				seen++
				if seen == n {
					close(attached)
				}
			}
		}
		t.done <- cmd.Wait()
	}()
	select {
	case <-attached:
		return t, nil
	case err := <-t.done:
		return nil, fmt.Errorf("strace exited before attaching: %v: %s", err, oneLine(t.stderr.String(), 400))
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-t.done
		return nil, fmt.Errorf("strace did not attach within 60 s")
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-t.done
		return nil, ctx.Err()
	}
}

// stop detaches strace (SIGINT), which then writes its summary.
func (t *tracer) stop() error {
	if err := t.cmd.Process.Signal(syscall.SIGINT); err != nil {
		return fmt.Errorf("strace: %w", err)
	}
	select {
	case <-t.done:
		return nil // strace exits with the traced process's status or 0; its output is checked by the parser
	case <-time.After(60 * time.Second):
		_ = t.cmd.Process.Kill()
		<-t.done
		return fmt.Errorf("strace did not detach within 60 s")
	}
}
