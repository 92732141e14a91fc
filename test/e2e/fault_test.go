package e2e

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// The fault suite: pods whose shim, QEMU, virtiofsd, containerd or
// kata-fsx snapshotter is killed with SIGKILL at some point of their
// life, cleaned up the way an operator would, and nothing of them left
// afterwards.

// Targets a fault can kill. The snapshotter is killed only in the
// lifecycles whose pods take their rootfs from it (every third).
const (
	faultShim        = "shim"
	faultQEMU        = "qemu"
	faultVirtiofsd   = "virtiofsd"
	faultContainerd  = "containerd"
	faultSnapshotter = "snapshotter"
)

var (
	faultTargets = []string{faultShim, faultQEMU, faultVirtiofsd, faultContainerd, faultSnapshotter}
	faultPhases  = []string{"create", "start", "exec", "delete"}
)

// faultKill is what one lifecycle did and saw.
type faultKill struct {
	lifecycle int
	backend   string
	target    string
	// phase is where the pod was when the signal went out, observed rather
	// than planned: the first of create, start, exec, delete whose ctr
	// command had not completed ("create" while `ctr run -d` runs and the
	// task is not yet listed, "start" once it is). point is "during" when
	// that command was running, "before" when it had not started yet.
	phase, point string
	// missed: the target had already exited (a delete that finished
	// first), so no signal was sent.
	missed bool
	// reported: ctr said the pod failed (a command's error, a task
	// status other than RUNNING, a non-zero exit status at delete);
	// reason is what it said.
	reported bool
	reason   string
	// named: the reason names what was killed.
	named bool
	// logReason is the first line of containerd's log (where shims log)
	// about this pod, from the kill on, that names what was killed: where
	// an operator looks when ctr only says that the task stopped.
	logReason string
	// snapshotter: the pod's rootfs came from the kata-fsx snapshotter.
	snapshotter bool
	// keptRunning: containerd or the snapshotter died after the pod was
	// running, and the pod ran on (shims outlive containerd, and a
	// mounted rootfs no longer needs its snapshotter): not a failed pod.
	keptRunning bool
}

// faultTargetsFor is what a lifecycle on backend may kill: every target
// that backend runs, narrowed to KATA_FSX_FAULT_TARGETS (a comma list)
// when set, to replay one kind of fault. The snapshotter is a target only
// of the lifecycles whose pods run on it, and their only one.
func faultTargetsFor(t *testing.T, backend string, onSnapshotter bool) []string {
	only := map[string]bool{}
	if v := os.Getenv("KATA_FSX_FAULT_TARGETS"); v != "" {
		for _, name := range strings.Split(v, ",") {
			if !slices.Contains(faultTargets, name) {
				t.Fatalf("KATA_FSX_FAULT_TARGETS=%s: unknown target %q (want some of %s)", v, name, strings.Join(faultTargets, ","))
			}
			only[name] = true
		}
	}
	if onSnapshotter {
		return []string{faultSnapshotter}
	}
	var targets []string
	for _, name := range faultTargets {
		if name == faultVirtiofsd && backend != "virtio-fs" || name == faultSnapshotter {
			continue
		}
		if len(only) == 0 || only[name] {
			targets = append(targets, name)
		}
	}
	if len(targets) == 0 {
		// virtiofsd or the snapshotter alone: a pod that has neither
		// kills its shim instead.
		targets = []string{faultShim}
	}
	return targets
}

// faultOnSnapshotter says whether lifecycle i's pod takes its rootfs from
// the kata-fsx snapshotter: every third, unless KATA_FSX_FAULT_TARGETS
// leaves the snapshotter out (or names it alone: then every one).
func faultOnSnapshotter(i int) bool {
	v := os.Getenv("KATA_FSX_FAULT_TARGETS")
	if v == "" {
		return i%3 == 2
	}
	names := strings.Split(v, ",")
	if !slices.Contains(names, faultSnapshotter) {
		return false
	}
	return len(names) == 1 || i%3 == 2
}

// faultEnvInt reads a positive integer setting from the environment.
func faultEnvInt(t *testing.T, name string, def int64) int64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return n
}

// TestFaultLoop runs KATA_FSX_FAULT_LIFECYCLES pod lifecycles,
// alternating virtio-fs and imagefs-blk, every third with its rootfs from
// the kata-fsx snapshotter (a proxy snapshotter of containerd), and
// SIGKILLs one of the pod's shim, QEMU, virtiofsd (virtio-fs pods) or
// containerd, or the snapshotter in its lifecycles, at a random point of
// create, start, exec or delete, chosen by a seeded generator
// (KATA_FSX_FAULT_SEED replays a run). Each time: ctr reports the pod
// failed (a dead containerd or snapshotter fails the command in flight;
// the pod itself outlives them, as shims outlive containerd by design),
// containerd or the snapshotter is restarted on the same root and state
// if it was the one killed,
// `ctr task delete -f` and `ctr container rm` clean up, and nothing of the
// pod is left: no process, mount, sandbox or bundle directory, shim
// socket. Pods of later lifecycles start. After the loop no process,
// mount, tap, network namespace, guest RAM file in /dev/shm or state is
// left. KATA_FSX_FAULT_REPORT=<path> writes the counts into that file
// between its faults markers. It runs only when KATA_FSX_FAULT_LIFECYCLES
// is set (make faults sets 30): a lifecycle takes 30-40 s on 2 shared
// cores under TCG, so even 12 of them do not fit make test's budget.
func TestFaultLoop(t *testing.T) {
	if os.Getenv("KATA_FSX_FAULT_LIFECYCLES") == "" {
		t.Skip("the fault suite runs with KATA_FSX_FAULT_LIFECYCLES set (make faults)")
	}
	n := int(faultEnvInt(t, "KATA_FSX_FAULT_LIFECYCLES", 0))
	if n < 1 {
		t.Fatalf("KATA_FSX_FAULT_LIFECYCLES=%d: want at least one lifecycle", n)
	}
	seed := faultEnvInt(t, "KATA_FSX_FAULT_SEED", time.Now().UnixNano())
	t.Logf("fault seed %d (KATA_FSX_FAULT_SEED=%d replays it), %d lifecycles", seed, seed, n)
	rng := rand.New(rand.NewSource(seed))

	netnsBefore, tapsBefore, shmBefore := netnsNames(), hostTaps(), guestRAMFiles()
	snapSock := snapshotterSocket(t)
	var snap *snapshotterProc
	ce := newContainerdEnvWith(t, func() *env { return newEnv(t, `enable_annotations = ["shared_fs"]`) },
		map[string]string{"kata-fsx": snapSock},
		func(e *env) { snap = startSnapshotter(t, e.config, snapSock, filepath.Join(e.dir, "snapshotter")) })
	began := time.Now()
	var kills []faultKill
	started, startedAfterKill := 0, 0
	leftovers := 0
	for i := 0; i < n; i++ {
		backend := []string{"virtio-fs", "imagefs-blk"}[i%2]
		onSnap := faultOnSnapshotter(i)
		targets := faultTargetsFor(t, backend, onSnap)
		plan := faultPlan{
			target: targets[rng.Intn(len(targets))],
			phase:  faultPhases[rng.Intn(len(faultPhases))],
			before: rng.Intn(3) == 0,
			delay:  rng.Float64(),
		}
		id := fmt.Sprintf("fault%02d", i)
		var sp *snapshotterProc
		if onSnap {
			sp = snap
		}
		k, ran := ce.faultLifecycle(t, i, id, backend, plan, sp)
		kills = append(kills, k)
		if ran {
			started++
			if i > 0 {
				startedAfterKill++
			}
		}
		left := ce.podLeftovers(id)
		if len(left) > 0 && k.target == faultContainerd {
			// A containerd killed before Create finished loses the task;
			// the restarted 1.6 keeps the shim, which exits on its own
			// after its orphan grace (30 s), and containerd then runs
			// its `delete` and removes the bundle.
			_ = testenv.Wait(75*time.Second, func() (bool, error) {
				left = ce.podLeftovers(id)
				return len(left) == 0, nil
			})
		}
		if onSnap {
			left = append(left, ce.snapshotsOf(id)...)
		}
		if len(left) > 0 {
			leftovers += len(left)
			t.Errorf("lifecycle %d (%s, %s killed at %s/%s): left behind:\n  %s", i, backend, k.target, k.phase, k.point, strings.Join(left, "\n  "))
		}
		t.Logf("lifecycle %d: %s pod%s, %s killed %s %s%s; reported=%v named=%v reason=%q log=%q; pod ran=%v; %d left",
			i, backend, map[bool]string{true: " on the snapshotter"}[onSnap], k.target, k.point, k.phase, map[bool]string{true: " (missed: already gone)"}[k.missed],
			k.reported, k.named, k.reason, k.logReason, ran, len(left))
	}

	// A healthy pod on each backend after the loop: the host is usable.
	for _, backend := range []string{"virtio-fs", "imagefs-blk"} {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		id := "after-" + strings.ReplaceAll(backend, "-", "")
		ce.startLongRunning(ctx, t, id, backend)
		startedAfterKill++
		if r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "ok", id, "/bin/echo", "alive"); r.code != 0 || r.stdout != "alive\n" {
			t.Errorf("exec in %s after the loop: exit %d %q %q", id, r.code, r.stdout, r.stderr)
		}
		ce.operatorCleanup(ctx, id)
		cancel()
		if left := ce.podLeftovers(id); len(left) > 0 {
			leftovers += len(left)
			t.Errorf("pod %s after the loop left: %v", id, left)
		}
	}
	took := time.Since(began)

	// What the whole run left on the host.
	var left []string
	if pids := processesMentioning(ce.dir); len(pids) > 0 {
		for _, p := range pids {
			if p != ce.cmd.Process.Pid && p != snap.cmd.Process.Pid {
				left = append(left, "process "+describeProcess(p))
			}
		}
	}
	for name := range netnsNames() {
		// containerd's CRI names the network namespaces it makes for
		// pods cni-…; these pods go through ctr and get none, so such a
		// namespace belongs to another CRI user of the host.
		if !netnsBefore[name] && !strings.HasPrefix(name, "cni-") {
			left = append(left, "network namespace "+name)
		}
	}
	for name := range hostTaps() {
		if !tapsBefore[name] {
			left = append(left, "tap "+name)
		}
	}
	for name := range guestRAMFiles() {
		if !shmBefore[name] {
			left = append(left, "guest RAM file "+name)
		}
	}
	left = append(left, testMounts()...)
	ents, _ := os.ReadDir(ce.stateDir)
	for _, en := range ents {
		if en.Name() != "accel.json" {
			left = append(left, "state "+filepath.Join(ce.stateDir, en.Name()))
		}
	}
	for s := range socketsIn(ce.sockDir) {
		left = append(left, "shim socket "+s)
	}
	left = append(left, ce.snapshotsOf("")...)
	if len(left) > 0 {
		leftovers += len(left)
		t.Errorf("after %d lifecycles, left behind:\n  %s", n, strings.Join(left, "\n  "))
	}

	// A kill of the shim, QEMU or virtiofsd before the pod's delete must
	// fail the pod visibly; containerd's or the snapshotter's death fails
	// only the command in flight, and a kill during delete races a pod
	// that is going anyway.
	for _, k := range kills {
		if !k.missed && !k.reported && k.target != faultContainerd && k.target != faultSnapshotter && k.phase != "delete" {
			t.Errorf("lifecycle %d: %s killed %s %s, yet ctr never reported the pod failed", k.lifecycle, k.target, k.point, k.phase)
		}
	}
	table := faultTable(seed, n, took, kills, started, startedAfterKill, leftovers)
	t.Logf("\n%s", table)
	if path := os.Getenv("KATA_FSX_FAULT_REPORT"); path != "" {
		if err := writeMarkedSection(path, "faults", table); err != nil {
			t.Errorf("report: %v", err)
		}
	}
}

// faultPlan is the random part of a lifecycle: what to kill, at which
// phase, between phases (before its command) or during it, and after
// what fraction of the phase's delay range.
type faultPlan struct {
	target, phase string
	before        bool
	delay         float64
}

// ctrAsync runs ctr in the background; the channel yields its result.
func (ce *containerdEnv) ctrAsync(ctx context.Context, args ...string) <-chan result {
	ch := make(chan result, 1)
	go func() { ch <- ce.ctr(ctx, args...) }()
	return ch
}

// taskStatus is the task's status in `ctr task ls`, "" when not listed.
func (ce *containerdEnv) taskStatus(ctx context.Context, id string) string {
	for _, l := range strings.Split(ce.ctr(ctx, "tasks", "ls").stdout, "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == id {
			return f[2]
		}
	}
	return ""
}

// targetPids finds the processes a kill of target means for pod id.
func (ce *containerdEnv) targetPids(id, target string) []int {
	sandboxDir := filepath.Join(ce.stateDir, id)
	switch target {
	case faultQEMU:
		return pidsOf(sandboxDir, "qemu-system")
	case faultVirtiofsd:
		return pidsOf(sandboxDir, "virtiofsd")
	case faultContainerd:
		select {
		case <-ce.exited:
			return nil
		default:
			return []int{ce.cmd.Process.Pid}
		}
	}
	// The serving shim, not the short-lived `start` or `delete` one.
	var out []int
	for _, pid := range pidsOf(ce.sock, "containerd-shim-kata-fsx-v2") {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		last := args[len(args)-1]
		if last == "start" || last == "delete" {
			continue
		}
		for j, a := range args {
			if a == "-id" && j+1 < len(args) && args[j+1] == id {
				out = append(out, pid)
			}
		}
	}
	return out
}

// faultLifecycle runs one pod through create, start, exec and delete and
// SIGKILLs plan's target at plan's point, then has the failure reported,
// restarts containerd if it died and cleans up as an operator would. ran
// says the pod reached RUNNING.
func (ce *containerdEnv) faultLifecycle(t *testing.T, i int, id, backend string, plan faultPlan, snap *snapshotterProc) (k faultKill, ran bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	k = faultKill{lifecycle: i, backend: backend, target: plan.target, snapshotter: snap != nil}
	var outputs []string
	killed := false
	logFrom := ce.logLen()
	targetPids := func() []int {
		if plan.target != faultSnapshotter {
			return ce.targetPids(id, plan.target)
		}
		select {
		case <-snap.exited:
			return nil
		default:
			return []int{snap.cmd.Process.Pid}
		}
	}

	// kill delivers the signal and records where the pod was.
	kill := func(phase, point string, inFlight <-chan result) {
		if phase == "create" || phase == "start" {
			// ctr run -d does both; the task is listed once Create returned.
			phase = "create"
			if st := ce.taskStatus(ctx, id); st != "" {
				phase = "start"
			}
		}
		if len(inFlight) > 0 {
			// The phase's command completed before the kill: the pod is
			// between it and the next phase.
			switch phase {
			case "create", "start":
				phase, point = "exec", "before"
			case "exec":
				phase, point = "delete", "before"
			default:
				point = "after"
			}
		}
		k.phase, k.point = phase, point
		logFrom = ce.logLen()
		pids := targetPids()
		if len(pids) == 0 {
			k.missed = true
		}
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		killed = true
	}
	// waitKill waits for the target of a phase in flight to exist, then
	// for the random part of the phase's delay range, and kills.
	waitKill := func(phase string, maxDelay time.Duration, inFlight <-chan result) {
		for len(targetPids()) == 0 && len(inFlight) == 0 && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
		}
		if phase == "start" {
			// Start follows Create inside `ctr run -d`: wait for the task
			// to be listed, which it is once Create returned.
			for ce.taskStatus(ctx, id) == "" && len(inFlight) == 0 && ctx.Err() == nil {
				time.Sleep(20 * time.Millisecond)
			}
		}
		time.Sleep(time.Duration(plan.delay * float64(maxDelay)))
		kill(phase, "during", inFlight)
	}
	collect := func(r result) {
		if r.code != 0 {
			outputs = append(outputs, strings.TrimSpace(r.stderr+" "+r.stdout))
		}
	}

	// create and start: ctr run -d.
	if plan.phase == "create" && plan.before && plan.target == faultContainerd {
		kill("create", "before", nil)
	}
	runArgs := []string{"-d", "--annotation", "io.katacontainers.config.hypervisor.shared_fs=" + backend}
	if snap != nil {
		runArgs = append(runArgs, "--snapshotter", "kata-fsx")
	}
	run := ce.ctrAsync(ctx, ce.runArgs(append(runArgs, ce.image, id, "/bin/sleep", "600")...)...)
	if !killed && (plan.phase == "create" || plan.phase == "start") {
		max := time.Second
		if plan.phase == "start" {
			max = 150 * time.Millisecond
		}
		waitKill(plan.phase, max, run)
	}
	r := <-run
	collect(r)
	runOK := r.code == 0
	if r.code == 0 && !killed {
		if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
			t.Errorf("lifecycle %d: no fault yet, task %s is %q, want RUNNING\n%s%s", i, id, st, r.stdout, r.stderr)
		} else {
			ran = true
		}
	} else if r.code == 0 && ce.taskStatus(ctx, id) == "RUNNING" {
		ran = true
	} else if r.code != 0 && !killed {
		t.Errorf("lifecycle %d: ctr run -d failed before any fault: %d %s", i, r.code, r.stderr)
	}

	// exec: a command that lasts a second, so a kill can land inside it.
	if !killed && plan.phase == "exec" {
		if plan.before {
			kill("exec", "before", nil)
		}
		ex := ce.ctrAsync(ctx, "tasks", "exec", "--exec-id", "x", id, "/bin/sh", "-c", "sleep 1; echo done")
		if !killed {
			waitKill("exec", 1500*time.Millisecond, ex)
		}
		r := <-ex
		collect(r)
		if plan.target == faultSnapshotter && ran && (r.code != 0 || r.stdout != "done\n") {
			// A running pod's rootfs is mounted: the snapshotter is not
			// on its path any more.
			t.Errorf("lifecycle %d: the snapshotter killed %s exec: the exec in the running pod failed: exit %d %q %q", i, k.point, r.code, r.stdout, r.stderr)
		}
	}

	// delete: the operator's forced delete of a running task.
	if !killed && plan.phase == "delete" {
		if plan.before {
			kill("delete", "before", nil)
		}
		del := ce.ctrAsync(ctx, "tasks", "delete", "-f", id)
		if !killed {
			waitKill("delete", 300*time.Millisecond, del)
		}
		r := <-del
		collect(r)
	}

	switch {
	case plan.target == faultContainerd:
		// The command in flight saw its containerd die; bring it back on
		// the same root and state, as systemd would.
		if !k.missed {
			<-ce.exited
		}
		ce.startDaemon(t)
		if !ran && runOK {
			// ctr run -d returned before the kill, and the task could not
			// be listed while containerd was down: ask the new one.
			ran = ce.taskStatus(ctx, id) == "RUNNING"
		}
	case plan.target == faultSnapshotter:
		// The same for the snapshotter, before the cleanup needs it to
		// remove the pod's snapshot. A pod that was running still is.
		if !k.missed {
			<-snap.exited
		}
		if ran && k.phase != "delete" {
			if st := ce.taskStatus(ctx, id); st != "RUNNING" {
				t.Errorf("lifecycle %d: the snapshotter killed %s %s; the running pod's task is %q, want RUNNING", i, k.point, k.phase, st)
			}
		}
		snap.start()
		// containerd's client of a proxy snapshotter backs off between
		// reconnections (grpc's, up to 2 min): until it is back, calls
		// fail fast with "connection refused", as after a restart on a
		// node. The loop goes on once containerd reaches it again.
		if err := testenv.Wait(3*time.Minute, func() (bool, error) {
			return ce.ctr(ctx, "snapshots", "--snapshotter", "kata-fsx", "ls").code == 0, nil
		}); err != nil {
			t.Errorf("lifecycle %d: containerd did not reach the restarted snapshotter in 3 min: %v", i, err)
		}
	case !k.missed && k.phase != "delete":
		// The shim notices a dead VM or virtiofsd and exits the task; a
		// dead shim's task is dropped from the list.
		wctx, wcancel := context.WithTimeout(ctx, time.Minute)
		for ctx.Err() == nil {
			if st := ce.taskStatus(wctx, id); st != "RUNNING" {
				if st != "" {
					outputs = append(outputs, "task status "+st)
				}
				break
			}
			if wctx.Err() != nil {
				outputs = append(outputs, "task still RUNNING a minute after the kill")
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		wcancel()
	}
	if (plan.target == faultContainerd || plan.target == faultSnapshotter) && ran && !k.missed && k.phase != "delete" &&
		ce.taskStatus(ctx, id) == "RUNNING" {
		k.keptRunning = true
	}
	// The forced delete of a pod that ran on kills it (exit 137): the
	// operator's doing, not a failure.
	if cleanup := ce.operatorCleanup(ctx, id); !k.keptRunning {
		outputs = append(outputs, cleanup...)
	}
	if plan.target == faultContainerd || plan.target == faultSnapshotter {
		// A forced delete kills a running task (exit 137) whatever else
		// died: for a pod these two leave running it is the delete's own
		// doing, not a report of the kill.
		outputs = slices.DeleteFunc(outputs, func(o string) bool { return o == "delete: exit code 137" })
	}
	for _, o := range outputs {
		if o == "task still RUNNING a minute after the kill" {
			continue
		}
		k.reported = true
		if k.reason != "" {
			k.reason += " | "
		}
		k.reason += o
	}
	k.named = !k.missed && k.reported && namesTarget(plan.target, k.reason)
	if !k.missed {
		k.logReason = ce.logNaming(logFrom, id, plan.target)
	}
	return k, ran
}

// logLen is how much containerd has logged so far, an offset for
// logNaming.
func (ce *containerdEnv) logLen() int {
	ce.logMu.Lock()
	defer ce.logMu.Unlock()
	return ce.log.Len()
}

// logNaming is the message and error of the first warning or error line
// of containerd's log after offset from that mentions pod id and names
// target, "" when there is none.
func (ce *containerdEnv) logNaming(from int, id, target string) string {
	ce.logMu.Lock()
	text := string(ce.log.Bytes()[min(from, ce.log.Len()):])
	ce.logMu.Unlock()
	field := regexp.MustCompile(`\b(msg|error)="((?:[^"\\]|\\.)*)"`)
	for _, l := range strings.Split(text, "\n") {
		if !strings.Contains(l, id) || !(strings.Contains(l, "level=error") || strings.Contains(l, "level=warning")) {
			continue
		}
		var said []string
		for _, m := range field.FindAllStringSubmatch(l, -1) {
			said = append(said, m[2])
		}
		if r := strings.Join(said, ": "); namesTarget(target, r) {
			return r
		}
	}
	return ""
}

// snapshotsOf lists the kata-fsx snapshotter's active snapshots whose key
// is id (a container's rootfs under ctr), or every active one when id is
// "".
func (ce *containerdEnv) snapshotsOf(id string) []string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r := ce.ctr(ctx, "snapshots", "--snapshotter", "kata-fsx", "ls")
	if r.code != 0 {
		return []string{fmt.Sprintf("snapshots: ctr snapshots ls: exit %d %s", r.code, r.stderr)}
	}
	var left []string
	for _, l := range strings.Split(r.stdout, "\n")[1:] {
		f := strings.Fields(l)
		if len(f) >= 2 && f[len(f)-1] == "Active" && (id == "" || f[0] == id) {
			left = append(left, "snapshot "+f[0])
		}
	}
	return left
}

// operatorCleanup is what an operator does with a failed pod: a forced
// task delete (containerd runs the shim's `delete` when the shim is gone)
// and the container's removal. It returns what ctr said about the pod's
// end: errors and a non-zero exit status.
func (ce *containerdEnv) operatorCleanup(ctx context.Context, id string) []string {
	var said []string
	dctx, cancel := context.WithTimeout(ctx, time.Minute)
	r := ce.ctr(dctx, "tasks", "delete", "-f", id)
	cancel()
	if r.code == -1 {
		// A forced delete that hangs is a finding; the operator's next
		// step is to kill the shim, after which containerd's delete runs
		// the shim's cleanup, so the loop can go on and count leftovers.
		ce.t.Errorf("ctr tasks delete -f %s hung for a minute; killing its shim", id)
		said = append(said, "delete -f hung")
		for _, p := range ce.targetPids(id, faultShim) {
			syscall.Kill(p, syscall.SIGKILL)
		}
		r = ce.ctr(ctx, "tasks", "delete", "-f", id)
	}
	out := strings.TrimSpace(r.stdout + " " + r.stderr)
	if m := regexp.MustCompile(`exit code \d+`).FindString(out); m != "" && m != "exit code 0" {
		said = append(said, "delete: "+m)
	} else if r.code != 0 && !strings.Contains(out, "not found") {
		said = append(said, "delete: "+out)
	}
	if r := ce.ctr(ctx, "containers", "rm", id); r.code != 0 && !strings.Contains(r.stderr, "not found") {
		ce.t.Errorf("ctr containers rm %s: %d %s", id, r.code, r.stderr)
	}
	return said
}

// namesTarget says whether ctr's words for a pod's failure name what
// died: QEMU or the VM, virtiofsd, the shim (its connection closing),
// containerd (its socket refusing).
func namesTarget(target, reason string) bool {
	r := strings.ToLower(reason)
	words := map[string][]string{
		faultQEMU:        {"qemu", " vm ", "hypervisor"},
		faultVirtiofsd:   {"virtiofsd"},
		faultShim:        {"shim", "ttrpc: closed", "connection reset"},
		faultContainerd:  {"containerd.sock", "connection refused", "error reading from server: eof", "transport is closing", "unavailable"},
		faultSnapshotter: {"snapshotter", "snap.sock"},
	}[target]
	for _, w := range words {
		if strings.Contains(r, w) {
			return true
		}
	}
	return false
}

// podLeftovers waits up to 30 s for pod id's processes to exit and
// lists what of it remains: processes (shim, QEMU, virtiofsd), mounts,
// sandbox and bundle directories, the shim's socket.
func (ce *containerdEnv) podLeftovers(id string) []string {
	sandboxDir := filepath.Join(ce.stateDir, id)
	bundle := filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id)
	var left []string
	_ = testenv.Wait(30*time.Second, func() (bool, error) {
		left = nil
		for _, p := range processesMentioning(sandboxDir) {
			left = append(left, "process "+describeProcess(p))
		}
		for _, p := range ce.targetPids(id, faultShim) {
			left = append(left, "shim "+describeProcess(p))
		}
		for _, dir := range []string{sandboxDir, bundle} {
			for _, m := range sharedMounts(os.Getpid(), dir) {
				left = append(left, "mount "+m)
			}
			if _, err := os.Stat(dir); err == nil {
				left = append(left, "directory "+dir)
			}
		}
		return len(left) == 0, nil
	})
	for s := range socketsIn(ce.sockDir) {
		left = append(left, "shim socket "+s)
	}
	return left
}

// guestRAMFiles lists /dev/shm's entries that QEMU's guest RAM could
// leave: it creates its memory-backend-file there as qemu_back_mem.*.
func guestRAMFiles() map[string]bool {
	m := map[string]bool{}
	ents, _ := os.ReadDir("/dev/shm")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "qemu") {
			m[filepath.Join("/dev/shm", e.Name())] = true
		}
	}
	return m
}

// faultTable renders the run's counts as markdown.
func faultTable(seed int64, n int, took time.Duration, kills []faultKill, started, startedAfter, leftovers int) string {
	var b strings.Builder
	onSnap := 0
	for _, k := range kills {
		if k.snapshotter {
			onSnap++
		}
	}
	fmt.Fprintf(&b, "`make faults`: TestFaultLoop, seed %d, %d pod lifecycles alternating virtio-fs and imagefs-blk, %d of them with their rootfs from the kata-fsx snapshotter (and the snapshotter their target), in %s; one SIGKILL each.\n\n",
		seed, n, onSnap, took.Round(time.Second))
	b.WriteString("Kills by target and the phase the pod was in (during the phase's ctr command / between phases, before its command or after it completed; missed = the target had already exited):\n\n")
	b.WriteString("| target | create | start | exec | delete | missed | total |\n|---|---|---|---|---|---|---|\n")
	for _, tg := range faultTargets {
		fmt.Fprintf(&b, "| %s |", tg)
		total, missed := 0, 0
		for _, ph := range faultPhases {
			during, before := 0, 0
			for _, k := range kills {
				if k.target != tg || k.phase != ph {
					continue
				}
				switch {
				case k.missed:
					continue
				case k.point == "before" || k.point == "after":
					before++
				default:
					during++
				}
			}
			total += during + before
			fmt.Fprintf(&b, " %d / %d |", during, before)
		}
		for _, k := range kills {
			if k.target == tg && k.missed {
				missed++
			}
		}
		fmt.Fprintf(&b, " %d | %d |\n", missed, total+missed)
	}
	b.WriteString("\nFailed pods, as ctr reported them (kills that were not missed; a kill during delete races a pod on its way out, whose delete may then succeed, and a dead containerd or snapshotter fails only the ctr command in flight, the pod running on: \"pod ran on\", checked with the task's status, and for the snapshotter with an exec). \"ctr names it\": ctr's words name what died; \"or containerd's log\": they do, or a warning or error of containerd's log about the pod (where the shim logs) does, which is where an operator looks when ctr says only that the task stopped:\n\n")
	b.WriteString("| target | reported failed | ctr names it | ctr or containerd's log names it | not reported | pod ran on |\n|---|---|---|---|---|---|\n")
	for _, tg := range faultTargets {
		rep, named, logNamed, not, ranOn := 0, 0, 0, 0, 0
		for _, k := range kills {
			if k.target != tg || k.missed {
				continue
			}
			if k.keptRunning {
				ranOn++
			}
			switch {
			case k.reported:
				rep++
			case !k.keptRunning:
				not++
			}
			if k.named {
				named++
			}
			if k.reported && (k.named || k.logReason != "") {
				logNamed++
			}
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %d |\n", tg, rep, named, logNamed, not, ranOn)
	}
	reasons, logReasons := map[string]int{}, map[string]int{}
	// Pod ids and pids differ from run to run; exit codes do not.
	logPrefix := regexp.MustCompile(`time="[^"]*" level=\w+ `)
	tmpPath := regexp.MustCompile(`/tmp/(TestFaultLoop|kf?s)[^\s"\\]*`)
	num := regexp.MustCompile(`\bfault\d+|\b[0-9a-f]{12,}\b|pid \d+|\bx\.\d+`)
	oneLine := func(r string) string {
		// One table line each: ctr's log prefix, the run's temporary
		// paths, newlines and the guest console's control characters go.
		r = logPrefix.ReplaceAllString(r, "")
		r = tmpPath.ReplaceAllString(r, "…")
		r = strings.Join(strings.Fields(strings.Map(func(c rune) rune {
			if c < ' ' {
				return ' '
			}
			return c
		}, r)), " ")
		if rs := []rune(r); len(rs) > 160 {
			r = string(rs[:160]) + "…"
		}
		return num.ReplaceAllString(strings.ReplaceAll(r, "|", "/"), "…")
	}
	for _, k := range kills {
		if k.missed || !k.reported {
			continue
		}
		reasons[k.target+": "+oneLine(k.reason)]++
		if !k.named && k.logReason != "" {
			logReasons[k.target+": "+oneLine(k.logReason)]++
		}
	}
	for _, sec := range []struct {
		title string
		m     map[string]int
	}{
		{"Reasons (pod ids, exec ids and pids as …):\n\n| count | target: what ctr said |", reasons},
		{"Where ctr's words did not name what died, containerd's log line that does:\n\n| count | target: containerd's log |", logReasons},
	} {
		if len(sec.m) == 0 {
			continue
		}
		keys := make([]string, 0, len(sec.m))
		for r := range sec.m {
			keys = append(keys, r)
		}
		sort.Strings(keys)
		b.WriteString("\n" + sec.title + "\n|---|---|\n")
		for _, r := range keys {
			fmt.Fprintf(&b, "| %d | %s |\n", sec.m[r], strings.ReplaceAll(r, "`", "'"))
		}
	}
	fmt.Fprintf(&b, "\nPods that reached RUNNING: %d of %d lifecycles; pods started after a kill (including one per backend after the loop): %d.\n\n", started, n, startedAfter)
	fmt.Fprintf(&b, "Leftovers (processes, mounts, taps, network namespaces, /dev/shm guest RAM files, sandbox and bundle directories, shim sockets): %d.\n", leftovers)
	return b.String()
}

// writeMarkedSection replaces what lies between `<!-- name:begin -->`
// and `<!-- name:end -->` in the file at path with text, leaving the rest
// of the file (other sections) alone; a missing file or missing markers
// are added.
func writeMarkedSection(path, name, text string) error {
	begin, end := "<!-- "+name+":begin -->", "<!-- "+name+":end -->"
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	s := string(b)
	if s == "" {
		s = "# Reliability\n"
	}
	i, j := strings.Index(s, begin), strings.Index(s, end)
	if i < 0 || j < i {
		if !strings.HasSuffix(s, "\n") {
			s += "\n"
		}
		s += "\n" + begin + "\n" + end + "\n"
		i, j = strings.Index(s, begin), strings.Index(s, end)
	}
	s = s[:i+len(begin)] + "\n" + text + s[j:]
	return os.WriteFile(path, []byte(s), 0o644)
}
