// Package cgroups drives the guest's cgroup v2 hierarchy for the agent: one
// cgroup per container with the spec's resources (as runc converts them),
// its accounting, freezing, and the OOM kills seen in it.
package cgroups

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// cgroupRoot is where the guest's cgroup v2 hierarchy is mounted, as Kata's
// agent has it.
const cgroupRoot = "/sys/fs/cgroup"

// wantedControllers are enabled down to every container cgroup; cpuset is
// only enabled when a container asks for cpus or mems, because an enabled
// cpuset makes every cgroup's cpus a constraint the VM's CPU hotplug must
// keep in step.
var wantedControllers = []string{"cpu", "memory", "pids"}

// oomQueue bounds the OOM events that wait for the host's GetOOMEvent.
const oomQueue = 64

// Hierarchy is the guest's cgroup v2 hierarchy as the agent uses it: one
// cgroup per container, and the OOM kills seen in them.
type Hierarchy struct {
	// mu guards the fields below; held for table updates and inotify
	// calls only. The OOM queue is sent to with mu released.
	mu          sync.Mutex
	ready       bool
	controllers map[string]bool // available at the root
	inotify     int
	watches     map[int]*Cgroup // inotify watch -> cgroup
	oom         chan string     // ids of containers with a new OOM kill
}

// New returns the hierarchy, set up (mounted, controllers enabled) at its
// first Create.
func New() *Hierarchy {
	return &Hierarchy{watches: map[int]*Cgroup{}, oom: make(chan string, oomQueue), inotify: -1}
}

// Cgroup is one container's cgroup.
type Cgroup struct {
	id      string
	path    string   // absolute, under cgroupRoot
	created []string // directories made for it, leaf last
	fd      int      // the leaf's directory, for clone3 CLONE_INTO_CGROUP
	wd      int      // inotify watch on memory.events, -1 when none
	oomKill uint64   // oom_kill count already reported
}

// setup mounts cgroup2 on cgroupRoot unless mounted, enables the wanted
// controllers at the root and starts the OOM watcher; it runs once, at the
// first container.
func (cs *Hierarchy) setup() error {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.ready {
		return nil
	}
	if err := os.MkdirAll(cgroupRoot, 0o755); err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(cgroupRoot, &st); err != nil {
		return fmt.Errorf("cgroups: statfs %s: %w", cgroupRoot, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		if isMountPoint(cgroupRoot) {
			return fmt.Errorf("cgroups: %s is mounted but is not cgroup2 (the kata-fsx agent only drives cgroup v2)", cgroupRoot)
		}
		if err := unix.Mount("cgroup2", cgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "nsdelegate"); err != nil {
			return fmt.Errorf("cgroups: mount cgroup2 on %s: %w", cgroupRoot, err)
		}
	}
	b, err := os.ReadFile(filepath.Join(cgroupRoot, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	cs.controllers = map[string]bool{}
	for _, c := range strings.Fields(string(b)) {
		cs.controllers[c] = true
	}
	if err := cs.enable(cgroupRoot, wantedControllers); err != nil {
		return err
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("cgroups: inotify: %w", err)
	}
	cs.inotify = fd
	go cs.watchOOM(fd)
	cs.ready = true
	log.Printf("cgroup v2 on %s, controllers %s", cgroupRoot, strings.TrimSpace(string(b)))
	return nil
}

// enable turns on those of ctrls the kernel has in dir's subtree_control.
func (cs *Hierarchy) enable(dir string, ctrls []string) error {
	var on []string
	for _, c := range ctrls {
		if cs.controllers[c] {
			on = append(on, "+"+c)
		}
	}
	if len(on) == 0 {
		return nil
	}
	f := filepath.Join(dir, "cgroup.subtree_control")
	if err := os.WriteFile(f, []byte(strings.Join(on, " ")), 0); err != nil {
		return fmt.Errorf("cgroups: enable %s in %s: %w", strings.Join(on, " "), f, err)
	}
	return nil
}

// cgroupPath is the container's cgroup below cgroupRoot: the spec's
// cgroupsPath when it is a plain path (ctr's /<namespace>/<id>, CRI's
// cgroupfs paths), else (systemd's slice:prefix:name form, or none)
// kata-fsx/<id>.
func cgroupPath(spec *pb.Spec, id string) string {
	p := spec.GetLinux().GetCgroupsPath()
	if p == "" || strings.Contains(p, ":") {
		return filepath.Join("kata-fsx", id)
	}
	p = filepath.Clean("/" + p)
	if p == "/" {
		return filepath.Join("kata-fsx", id)
	}
	return p[1:]
}

// Create makes the container's cgroup (and the parents it needs, with the
// controllers enabled down to it), applies res and watches it for OOM kills.
func (cs *Hierarchy) Create(id string, spec *pb.Spec) (*Cgroup, error) {
	if err := cs.setup(); err != nil {
		return nil, err
	}
	res := spec.GetLinux().GetResources()
	rel := cgroupPath(spec, id)
	cg := &Cgroup{id: id, path: filepath.Join(cgroupRoot, rel), fd: -1, wd: -1}
	ctrls := wantedControllers
	if res.GetCPU().GetCpus() != "" || res.GetCPU().GetMems() != "" {
		ctrls = append(ctrls[:len(ctrls):len(ctrls)], "cpuset")
	}
	dir := cgroupRoot
	parts := strings.Split(rel, "/")
	for i, part := range parts {
		if i > 0 || len(ctrls) > len(wantedControllers) {
			if err := cs.enable(dir, ctrls); err != nil {
				cs.removeDirs(cg)
				return nil, err
			}
		}
		dir = filepath.Join(dir, part)
		err := os.Mkdir(dir, 0o755)
		switch {
		case err == nil:
			cg.created = append(cg.created, dir)
		case errors.Is(err, fs.ErrExist) && i < len(parts)-1:
		case errors.Is(err, fs.ErrExist):
			cs.removeDirs(cg)
			return nil, status.Errorf(codes.AlreadyExists, "container %s: cgroup %s exists already", id, dir)
		default:
			cs.removeDirs(cg)
			return nil, fmt.Errorf("container %s: cgroup: %w", id, err)
		}
	}
	if err := cs.Apply(cg, res); err != nil {
		cs.removeDirs(cg)
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	fd, err := unix.Open(cg.path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		cs.removeDirs(cg)
		return nil, fmt.Errorf("container %s: open cgroup %s: %w", id, cg.path, err)
	}
	cg.fd = fd
	if cs.controllers["memory"] {
		cs.mu.Lock()
		wd, err := unix.InotifyAddWatch(cs.inotify, filepath.Join(cg.path, "memory.events"), unix.IN_MODIFY)
		if err == nil {
			cg.wd = wd
			cs.watches[wd] = cg
		}
		cs.mu.Unlock()
		if err != nil {
			cs.Remove(cg)
			return nil, fmt.Errorf("container %s: watch memory.events for OOM kills: %w", id, err)
		}
	}
	return cg, nil
}

// resourceWrite is one cgroup file and the value a resource asks for.
type resourceWrite struct {
	controller, file, value string
}

// resourceWrites converts OCI resources to cgroup v2 files, as runc does;
// Kata's protocol has no field presence, so zero means "not set".
func resourceWrites(res *pb.LinuxResources) ([]resourceWrite, error) {
	var w []resourceWrite
	if m := res.GetMemory(); m != nil {
		if m.GetLimit() != 0 {
			w = append(w, resourceWrite{"memory", "memory.max", limitValue(m.GetLimit())})
		}
		if m.GetReservation() != 0 {
			w = append(w, resourceWrite{"memory", "memory.low", limitValue(m.GetReservation())})
		}
		swap, err := swapV2(m.GetSwap(), m.GetLimit())
		if err != nil {
			return nil, err
		}
		if swap != 0 {
			w = append(w, resourceWrite{"memory", "memory.swap.max", limitValue(swap)})
		}
		if m.GetKernel() != 0 || m.GetKernelTCP() != 0 {
			log.Printf("memory: kernel and kernelTCP limits do not exist in cgroup v2: ignored, as runc does")
		}
	}
	if c := res.GetCPU(); c != nil {
		if s := c.GetShares(); s != 0 {
			w = append(w, resourceWrite{"cpu", "cpu.weight", strconv.FormatUint(sharesToWeight(s), 10)})
		}
		if c.GetQuota() != 0 || c.GetPeriod() != 0 {
			v := "max"
			if c.GetQuota() > 0 {
				v = strconv.FormatInt(c.GetQuota(), 10)
			}
			period := c.GetPeriod()
			if period == 0 {
				period = 100000
			}
			w = append(w, resourceWrite{"cpu", "cpu.max", v + " " + strconv.FormatUint(period, 10)})
		}
		if c.GetCpus() != "" {
			w = append(w, resourceWrite{"cpuset", "cpuset.cpus", c.GetCpus()})
		}
		if c.GetMems() != "" {
			w = append(w, resourceWrite{"cpuset", "cpuset.mems", c.GetMems()})
		}
		if c.GetRealtimeRuntime() != 0 || c.GetRealtimePeriod() != 0 {
			return nil, status.Errorf(codes.InvalidArgument, "cpu: realtime runtime and period have no cgroup v2 files; drop them from the spec")
		}
	}
	if p := res.GetPids(); p != nil && p.GetLimit() != 0 {
		w = append(w, resourceWrite{"pids", "pids.max", limitValue(p.GetLimit())})
	}
	return w, nil
}

func limitValue(v int64) string {
	if v < 0 {
		return "max"
	}
	return strconv.FormatInt(v, 10)
}

// swapV2 turns OCI's memory+swap total into cgroup v2's swap alone.
func swapV2(swap, mem int64) (int64, error) {
	switch {
	case mem == -1 && swap == 0:
		return -1, nil
	case swap == -1 || swap == 0:
		return swap, nil
	case mem <= 0:
		return 0, status.Errorf(codes.InvalidArgument, "memory: a swap limit (%d) needs a memory limit", swap)
	case swap < mem:
		return 0, status.Errorf(codes.InvalidArgument, "memory: memory+swap limit %d is below the memory limit %d", swap, mem)
	}
	return swap - mem, nil
}

// sharesToWeight maps cgroup v1 cpu shares [2, 262144] onto cgroup v2's
// cpu.weight [1, 10000], as runc does.
func sharesToWeight(shares uint64) uint64 {
	shares = min(max(shares, 2), 262144)
	return 1 + ((shares-2)*9999)/262142
}

// Apply writes res into the container's cgroup.
func (cs *Hierarchy) Apply(cg *Cgroup, res *pb.LinuxResources) error {
	writes, err := resourceWrites(res)
	if err != nil {
		return err
	}
	if len(res.GetDevices()) > 0 {
		log.Printf("container %s: %d device cgroup rules not applied: the guest has no device cgroup program (the VM only has the devices the shim gave it)", cg.id, len(res.GetDevices()))
	}
	for _, w := range writes {
		if !cs.controllers[w.controller] {
			return status.Errorf(codes.FailedPrecondition, "%s = %s needs the %s cgroup controller, which the guest kernel lacks", w.file, w.value, w.controller)
		}
		if err := os.WriteFile(filepath.Join(cg.path, w.file), []byte(w.value), 0); err != nil {
			return fmt.Errorf("cgroup %s: write %s = %s: %w", cg.path, w.file, w.value, err)
		}
	}
	return nil
}

// Remove drops the cgroup once its processes are gone, reporting an OOM
// kill the watcher has not seen yet.
func (cs *Hierarchy) Remove(cg *Cgroup) {
	cs.mu.Lock()
	if cg.wd >= 0 {
		_, _ = unix.InotifyRmWatch(cs.inotify, uint32(cg.wd))
		delete(cs.watches, cg.wd)
		cg.wd = -1
	}
	cs.mu.Unlock()
	cs.checkOOM(cg)
	if cg.fd >= 0 {
		unix.Close(cg.fd)
		cg.fd = -1
	}
	cs.removeDirs(cg)
}

// removeDirs removes the container's cgroup, then its parents up to the
// root while they are empty (a parent another container still uses stays).
// A cgroup still holding a process is logged and left.
func (cs *Hierarchy) removeDirs(cg *Cgroup) {
	if len(cg.created) == 0 {
		return
	}
	leaf := cg.created[len(cg.created)-1]
	err := unix.Rmdir(leaf)
	for try := 0; errors.Is(err, unix.EBUSY) && try < 50; try++ {
		// The last killed process leaves its cgroup a little after it
		// has been reaped.
		time.Sleep(20 * time.Millisecond)
		err = unix.Rmdir(leaf)
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Printf("container %s: remove cgroup %s: %v", cg.id, leaf, err)
		return
	}
	cg.created = nil
	for dir := filepath.Dir(leaf); dir != cgroupRoot && strings.HasPrefix(dir, cgroupRoot+"/"); dir = filepath.Dir(dir) {
		if unix.Rmdir(dir) != nil {
			return
		}
	}
}

// watchOOM turns memory.events changes into OOM events for the host.
func (cs *Hierarchy) watchOOM(fd int) {
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.PathMax))
	for {
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			log.Printf("cgroups: OOM watcher stops: %v", err)
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			off += unix.SizeofInotifyEvent + int(ev.Len)
			cs.mu.Lock()
			cg := cs.watches[int(ev.Wd)]
			cs.mu.Unlock()
			if cg != nil {
				cs.checkOOM(cg)
			}
		}
	}
}

// checkOOM queues an OOM event when cg's oom_kill count has grown.
func (cs *Hierarchy) checkOOM(cg *Cgroup) {
	ev, err := readKeyed(filepath.Join(cg.path, "memory.events"))
	if err != nil {
		return
	}
	cs.mu.Lock()
	grew := ev["oom_kill"] > cg.oomKill
	cg.oomKill = max(cg.oomKill, ev["oom_kill"])
	cs.mu.Unlock()
	if !grew {
		return
	}
	log.Printf("container %s: OOM kill (%d so far)", cg.id, ev["oom_kill"])
	select {
	case cs.oom <- cg.id:
	default:
		log.Printf("container %s: OOM event dropped: %d events wait for the host already", cg.id, oomQueue)
	}
}

// readKeyed reads a flat-keyed cgroup file ("key value" lines).
func readKeyed(path string) (map[string]uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out, nil
}

// readValue reads a one-value cgroup file; "max" is the largest value.
func readValue(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return math.MaxUint64, nil
	}
	return strconv.ParseUint(s, 10, 64)
}

// Stats reads the container cgroup's CPU, memory and pids accounting, in
// the units of Kata's agent (CPU times in nanoseconds).
func (cg *Cgroup) Stats() (*pb.CgroupStats, error) {
	cpu, err := readKeyed(filepath.Join(cg.path, "cpu.stat"))
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", cg.id, err)
	}
	out := &pb.CgroupStats{
		CpuStats: &pb.CpuStats{
			CpuUsage: &pb.CpuUsage{
				TotalUsage:        cpu["usage_usec"] * 1000,
				UsageInUsermode:   cpu["user_usec"] * 1000,
				UsageInKernelmode: cpu["system_usec"] * 1000,
			},
			ThrottlingData: &pb.ThrottlingData{
				Periods:          cpu["nr_periods"],
				ThrottledPeriods: cpu["nr_throttled"],
				ThrottledTime:    cpu["throttled_usec"] * 1000,
			},
		},
	}
	if mstat, err := readKeyed(filepath.Join(cg.path, "memory.stat")); err == nil {
		usage, _ := readValue(filepath.Join(cg.path, "memory.current"))
		limit, _ := readValue(filepath.Join(cg.path, "memory.max"))
		peak, _ := readValue(filepath.Join(cg.path, "memory.peak"))
		events, _ := readKeyed(filepath.Join(cg.path, "memory.events"))
		swap, _ := readValue(filepath.Join(cg.path, "memory.swap.current"))
		swapLimit, _ := readValue(filepath.Join(cg.path, "memory.swap.max"))
		out.MemoryStats = &pb.MemoryStats{
			Cache:        mstat["file"],
			Usage:        &pb.MemoryData{Usage: usage, MaxUsage: peak, Failcnt: events["max"], Limit: limit},
			SwapUsage:    &pb.MemoryData{Usage: swap, Limit: swapLimit},
			UseHierarchy: true,
			Stats:        mstat,
		}
	}
	if cur, err := readValue(filepath.Join(cg.path, "pids.current")); err == nil {
		limit, _ := readValue(filepath.Join(cg.path, "pids.max"))
		out.PidsStats = &pb.PidsStats{Current: cur, Limit: limit}
	}
	return out, nil
}

// Freeze freezes or thaws the cgroup and waits until the kernel says so.
func (cg *Cgroup) Freeze(ctx context.Context, on bool) error {
	v, want := "0", "frozen 0"
	if on {
		v, want = "1", "frozen 1"
	}
	if err := os.WriteFile(filepath.Join(cg.path, "cgroup.freeze"), []byte(v), 0); err != nil {
		return fmt.Errorf("container %s: write cgroup.freeze = %s: %w", cg.id, v, err)
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		b, err := os.ReadFile(filepath.Join(cg.path, "cgroup.events"))
		if err != nil {
			return fmt.Errorf("container %s: %w", cg.id, err)
		}
		if strings.Contains(string(b), want) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("container %s: cgroup not %s: %w", cg.id, want, ctx.Err())
		case <-t.C:
		}
	}
}

// Frozen says whether the cgroup is frozen (paused).
func (cg *Cgroup) Frozen() bool {
	b, err := os.ReadFile(filepath.Join(cg.path, "cgroup.freeze"))
	return err == nil && strings.TrimSpace(string(b)) == "1"
}

// OOM delivers the ids of containers whose cgroup saw a new OOM kill.
func (cs *Hierarchy) OOM() <-chan string { return cs.oom }

// ID is the container's id.
func (cg *Cgroup) ID() string { return cg.id }

// FD is the cgroup's directory, open for clone3's CLONE_INTO_CGROUP.
func (cg *Cgroup) FD() int { return cg.fd }

// isMountPoint says whether path is a mount point (or the root).
func isMountPoint(path string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(path, &st) != nil || unix.Lstat(filepath.Join(path, ".."), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev || st.Ino == parent.Ino
}
