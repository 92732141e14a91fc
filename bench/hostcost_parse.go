package bench

import (
	"bufio"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"

	"github.com/kata-fsx/kata-fsx/metrics"
)

// Counts are one measurement of a host-cost step: the serving process's
// system calls by name and the requests it served by operation.
type Counts struct {
	Syscalls map[string]int64 `json:"syscalls"`
	Requests map[string]int64 `json:"requests,omitempty"`
	// GuestDisk are the rootfs disk's requests as the guest's diskstats
	// count them, beside Requests when those come from the host side.
	GuestDisk map[string]int64 `json:"guest_disk_requests,omitempty"`
}

// SyscallTotal is the sum of the system calls of every name.
func (c Counts) SyscallTotal() int64 { return sum(c.Syscalls) }

// RequestTotal is the sum of the requests of every operation.
func (c Counts) RequestTotal() int64 { return sum(c.Requests) }

// waitSyscalls are the system calls that wait, sleep, keep time or handle
// signals. A serving process makes them at a rate set by the clock and the
// runtime (QEMU's main loop and timers, Go's scheduler), not by the
// requests, so over a workload they grow with its duration; the report
// gives the count without them beside the total, the same set for every row.
var waitSyscalls = map[string]bool{
	"futex": true, "nanosleep": true, "clock_nanosleep": true, "ppoll": true, "poll": true,
	"epoll_wait": true, "epoll_pwait": true, "epoll_pwait2": true, "select": true, "pselect6": true,
	"sched_yield": true, "restart_syscall": true, "rt_sigreturn": true, "rt_sigprocmask": true,
	"rt_sigtimedwait": true, "tgkill": true, "getpid": true, "gettid": true, "clock_gettime": true,
	"timer_settime": true, "timerfd_settime": true,
}

// WorkSyscalls is SyscallTotal less the waits, timers and signals.
func (c Counts) WorkSyscalls() int64 {
	var n int64
	for k, v := range c.Syscalls {
		if !waitSyscalls[k] {
			n += v
		}
	}
	return n
}

func sum(m map[string]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// Minus is c less the baseline b, name by name. A name may go negative:
// the baseline step made more of that call than the workload (noise, such
// as timer wake-ups of a longer baseline), and hiding it would inflate the
// total.
func (c Counts) Minus(b Counts) Counts {
	return Counts{Syscalls: minus(c.Syscalls, b.Syscalls), Requests: minus(c.Requests, b.Requests), GuestDisk: minus(c.GuestDisk, b.GuestDisk)}
}

func minus(a, b map[string]int64) map[string]int64 {
	if a == nil && b == nil {
		return nil
	}
	out := make(map[string]int64, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] -= v
	}
	for k, v := range out {
		if v == 0 {
			delete(out, k)
		}
	}
	return out
}

// maxSyscallNames bounds a summary's table: Linux has fewer than 500
// system calls, so more rows is not strace -c output.
const maxSyscallNames = 1024

// ParseStraceSummary reads the table `strace -c` writes when it detaches:
// calls by system call name. It checks the table's total line against the
// sum of its rows, so a truncated or garbled summary is an error, not a
// silently smaller count.
func ParseStraceSummary(text string) (map[string]int64, error) {
	calls := map[string]int64{}
	var total int64 = -1
	var rows int64
	header, dashes := false, 0
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 4096), 4096)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
			continue
		case strings.HasPrefix(line, "% time"):
			header = true
			continue
		case strings.HasPrefix(line, "------"):
			dashes++
			continue
		}
		if !header || dashes == 0 {
			continue // strace's own messages before the table
		}
		f := strings.Fields(line)
		// % time, seconds, usecs/call, calls, [errors,] syscall
		if len(f) != 5 && len(f) != 6 {
			return nil, fmt.Errorf("strace summary: unexpected line %q", truncate(line, 120))
		}
		n, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("strace summary: calls %q in line %q", f[3], truncate(line, 120))
		}
		name := f[len(f)-1]
		if !validSyscallName(name) {
			return nil, fmt.Errorf("strace summary: system call name %q", truncate(name, 60))
		}
		if name == "total" && dashes >= 2 {
			total = n
			continue
		}
		if _, dup := calls[name]; dup {
			return nil, fmt.Errorf("strace summary: %s listed twice", name)
		}
		if len(calls) >= maxSyscallNames {
			return nil, fmt.Errorf("strace summary: more than %d system call names", maxSyscallNames)
		}
		calls[name] = n
		rows += n
		if rows < 0 {
			return nil, fmt.Errorf("strace summary: call counts overflow")
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("strace summary: %w", err)
	}
	if !header {
		return nil, fmt.Errorf("strace summary: no table (strace wrote %q)", truncate(strings.TrimSpace(text), 200))
	}
	if total < 0 {
		return nil, fmt.Errorf("strace summary: no total line (truncated?)")
	}
	if total != rows {
		return nil, fmt.Errorf("strace summary: rows add up to %d calls, total line says %d", rows, total)
	}
	return calls, nil
}

func validSyscallName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '?' || c == '(' || c == ')') {
			return false
		}
	}
	return true
}

// fuseOpcode matches the line the C virtiofsd logs for every FUSE request
// it receives when run with -d (fuse_lowlevel.c: "unique: N, opcode: NAME (N),
// nodeid: ..."); strace shows it inside the write(2) of the log line.
var fuseOpcode = regexp.MustCompile(`unique: [0-9]+, opcode: ([A-Z_0-9]+) \([0-9]+\)`)

// CountFUSERequests counts the FUSE requests by opcode in a strace -e
// trace=write log of a virtiofsd run with -d.
func CountFUSERequests(trace string) map[string]int64 {
	out := map[string]int64{}
	for _, m := range fuseOpcode.FindAllStringSubmatch(trace, -1) {
		out[m[1]]++
	}
	return out
}

// wholeDisk matches the guest's virtio, SCSI and pmem disks, not their
// partitions (a partition's requests are its disk's too).
var wholeDisk = regexp.MustCompile(`^(vd[a-z]+|sd[a-z]+|pmem[0-9]+)$`)

// ParseDiskstats sums /proc/diskstats over the whole disks: requests
// completed by operation (read, write, discard, flush; the fields after
// merging, so one is one request the device served).
func ParseDiskstats(text string) (map[string]int64, error) {
	out := map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) < 14 {
			return nil, fmt.Errorf("diskstats: short line %q", truncate(line, 120))
		}
		if !wholeDisk.MatchString(f[2]) {
			continue
		}
		// Completed reads, writes, discards and flushes (kernel
		// Documentation/admin-guide/iostats.rst, counted from the major number).
		for op, i := range map[string]int{"read": 3, "write": 7, "discard": 14, "flush": 18} {
			if i >= len(f) {
				continue // an older kernel without the field
			}
			n, err := strconv.ParseInt(f[i], 10, 64)
			if err != nil || n < 0 {
				return nil, fmt.Errorf("diskstats: %s of %s: %q", op, f[2], f[i])
			}
			out[op] += n
		}
	}
	for k, v := range out {
		if v == 0 {
			delete(out, k)
		}
	}
	return out, nil
}

// ParseStepOutput reads what the guest side of a host-cost step printed:
// /proc/diskstats before and after the workload and its exit status.
func ParseStepOutput(out string) (before, after map[string]int64, rc int, err error) {
	bi := strings.Index(out, "@@BEFORE\n")
	ai := strings.Index(out, "@@AFTER\n")
	ri := strings.Index(out, "@@RC ")
	if bi < 0 || ai < bi || ri < ai {
		return nil, nil, 0, fmt.Errorf("step output lacks its @@BEFORE/@@AFTER/@@RC markers: %q", truncate(out, 300))
	}
	if before, err = ParseDiskstats(out[bi+len("@@BEFORE\n") : ai]); err != nil {
		return nil, nil, 0, err
	}
	if after, err = ParseDiskstats(out[ai+len("@@AFTER\n") : ri]); err != nil {
		return nil, nil, 0, err
	}
	line, _, _ := strings.Cut(out[ri+len("@@RC "):], "\n")
	if rc, err = strconv.Atoi(strings.TrimSpace(line)); err != nil {
		return nil, nil, 0, fmt.Errorf("step exit status %q: %w", truncate(line, 40), err)
	}
	return before, after, rc, nil
}

// RequestsByOp sums a counter family's samples by their op label; an
// absent family is an error (the server did not export its counters).
func RequestsByOp(fams []metrics.Family, name string) (map[string]int64, error) {
	for _, f := range fams {
		if f.Name != name {
			continue
		}
		out := map[string]int64{}
		for _, s := range f.Samples {
			if s.Name != name {
				continue
			}
			if s.Value < 0 || s.Value > math.MaxInt64/2 || s.Value != math.Trunc(s.Value) {
				return nil, fmt.Errorf("%s: value %v is not a count", name, s.Value)
			}
			op := "other"
			for _, l := range s.Labels {
				if l.Name == "op" {
					op = l.Value
				}
			}
			out[op] += int64(s.Value)
		}
		return out, nil
	}
	return nil, fmt.Errorf("metrics: no %s family", name)
}
