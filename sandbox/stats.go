package sandbox

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kata-fsx/kata-fsx/host"
)

// ProcessRef is a host process that does work for a sandbox.
type ProcessRef struct {
	Role string `json:"role"` // qemu, virtiofsd, or kata-fsx (the in-process imagefs-blk server)
	PID  int    `json:"pid"`
	// ServesRootfs is set on the process that reads the rootfs's bytes
	// from the host for the guest.
	ServesRootfs bool `json:"serves_rootfs"`
	// WithChildren counts the process's descendants as part of it: the C
	// virtiofsd serves from a forked child. Not for kata-fsx, whose
	// children are QEMU and virtiofsd.
	WithChildren bool `json:"with_children"`
}

// The roles of the processes that work for a sandbox.
const (
	roleQEMU      = "qemu"
	roleVirtiofsd = "virtiofsd"
	roleKataFSX   = "kata-fsx"
)

// Processes lists the host processes working for the sandbox.
func (s *Sandbox) Processes() []ProcessRef {
	var refs []ProcessRef
	server := s.backend.rootfsServer()
	if s.vm != nil {
		refs = append(refs, ProcessRef{Role: roleQEMU, PID: s.vm.Pid(), ServesRootfs: server == roleQEMU})
	}
	if vfsd := s.backend.virtiofsd(); vfsd != nil {
		refs = append(refs, ProcessRef{Role: roleVirtiofsd, PID: vfsd.Pid(), ServesRootfs: server == roleVirtiofsd, WithChildren: true})
	}
	if server == roleKataFSX {
		refs = append(refs, ProcessRef{Role: roleKataFSX, PID: os.Getpid(), ServesRootfs: true})
	}
	return refs
}

// ProcessSample is what /proc says about one process at one moment.
type ProcessSample struct {
	ProcessRef
	// RChar and ReadBytes are /proc/PID/io's rchar (bytes read by
	// read-like syscalls, page cache hits included) and read_bytes (bytes
	// fetched from storage; O_DIRECT and io_uring reads show only here).
	RChar     uint64 `json:"rchar"`
	ReadBytes uint64 `json:"read_bytes"`
	RSSKiB    uint64 `json:"rss_kib"`
	HWMKiB    uint64 `json:"hwm_kib"` // sum of the processes' peak RSS
	// AnonKiB is the private memory (RssAnon): RSS without the guest
	// memory a vhost-user backend maps and the files it has mapped.
	AnonKiB uint64 `json:"anon_kib"`
	// Processes is how many processes the sums cover (the process and its descendants).
	Processes int    `json:"processes"`
	Error     string `json:"error,omitempty"`
}

// Sample reads the counters of every process of the sandbox.
func (s *Sandbox) Sample() []ProcessSample {
	var out []ProcessSample
	for _, r := range s.Processes() {
		ps := ProcessSample{ProcessRef: r}
		if err := ps.read(); err != nil {
			ps.Error = err.Error()
		}
		out = append(out, ps)
	}
	return out
}

// read sums the counters over the process and, if asked, its descendants.
func (ps *ProcessSample) read() error {
	pids := []int{ps.PID}
	if ps.WithChildren {
		pids = append(pids, Descendants(ps.PID)...)
	}
	for i, pid := range pids {
		io, err := host.ProcFields(fmt.Sprintf("/proc/%d/io", pid))
		if err == nil {
			var st map[string]uint64
			if st, err = host.ProcFields(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
				ps.RChar += io["rchar"]
				ps.ReadBytes += io["read_bytes"]
				ps.RSSKiB += st["VmRSS"]
				ps.HWMKiB += st["VmHWM"]
				ps.AnonKiB += st["RssAnon"]
			}
		}
		// A descendant may exit between the listing and the read.
		if err != nil && i == 0 {
			return err
		}
	}
	ps.Processes = len(pids)
	return nil
}

// Descendants lists the processes below pid (from /proc), children first.
func Descendants(pid int) []int {
	var out []int
	queue := []int{pid}
	for len(queue) > 0 && len(out) < 1024 {
		p := queue[0]
		queue = queue[1:]
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", p))
		for _, t := range tasks {
			b, err := os.ReadFile(t)
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(b)) {
				if c, err := strconv.Atoi(f); err == nil {
					out = append(out, c)
					queue = append(queue, c)
				}
			}
		}
	}
	return out
}

// RunStats is what `kata-fsx run --stats-file` records about one run, for
// the benchmarks: when the process started and what the host processes
// serving the pod read and held.
type RunStats struct {
	SandboxID string `json:"sandbox_id"`
	Backend   string `json:"backend"`
	Reason    string `json:"reason"`
	// ReadySeconds runs from the start of `run` to the sandbox being up
	// (VM booted, agent answering; an imagefs-blk disk built and served).
	ReadySeconds float64 `json:"ready_seconds"`
	// StartSeconds runs from the start of `run` to the agent reporting the
	// container's process started (rootfs mounted, entrypoint executed).
	StartSeconds float64 `json:"start_seconds"`
	// FirstOutputSeconds runs from the start of `run` to the first byte
	// the process wrote to stdout (0 if it wrote none): the process has
	// been loaded and runs.
	FirstOutputSeconds float64 `json:"first_output_seconds,omitempty"`
	// AtReady, AtStart and AtEnd sample the processes when the sandbox is
	// up, when the container's process has started, and when it has
	// exited (before teardown).
	AtReady []ProcessSample `json:"at_ready"`
	AtStart []ProcessSample `json:"at_start"`
	AtEnd   []ProcessSample `json:"at_end"`
	// AtFirstOutput samples them when the process's first output arrives.
	AtFirstOutput []ProcessSample `json:"at_first_output,omitempty"`
	// Lazy is set for a registry: rootfs read on demand.
	Lazy *LazyStats `json:"lazy,omitempty"`
}

// LazyStats is what a lazy rootfs fetched from its registry.
type LazyStats struct {
	Image       string `json:"image"`
	IndexSource string `json:"index_source"` // artifact, node cache, or built by streaming
	// ImageBytes is the layers' compressed size: what a pull fetches.
	ImageBytes int64 `json:"image_bytes"`
	// FetchedAtFirstOutput and FetchedAtEnd are the layer bytes fetched
	// from the registry by the first output and by the process's exit.
	FetchedAtFirstOutput int64 `json:"fetched_at_first_output"`
	FetchedAtEnd         int64 `json:"fetched_at_end"`
	RangeRequests        int64 `json:"range_requests"`
	VerifyFailures       int64 `json:"verify_failures"`
	ReadErrors           int64 `json:"read_errors"`
}
