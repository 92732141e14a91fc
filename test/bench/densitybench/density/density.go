// Package density is the result of the density benchmark: N pods of one
// image started at once on a backend, what each pod's host processes hold
// in memory, and when the last pod's process printed its first line.
// test/e2e's TestDensityBench measures and writes it;
// test/bench/densitybench renders it into docs/benchmarks.md.
package density

import (
	"fmt"
	"slices"
	"strings"
)

// Process kinds of a pod on the host.
const (
	KindShim      = "shim"      // containerd-shim-kata-fsx-v2, with imagefs-blk served in it
	KindQEMU      = "qemu"      // qemu-system-x86_64, its guest RAM a shared memfd
	KindVirtiofsd = "virtiofsd" // virtiofsd and the child it forks
	KindOther     = "other"
)

// Result is one run of the benchmark.
type Result struct {
	// Title names the run where a section shows more than one.
	Title       string    `json:"title,omitempty"`
	Date        string    `json:"date"`
	Command     string    `json:"command"`
	Commit      string    `json:"commit"`
	WallSeconds float64   `json:"wall_seconds"`
	Host        Host      `json:"host"`
	Guest       Guest     `json:"guest"`
	Image       Image     `json:"image"`
	Backends    []Backend `json:"backends"`
	Notes       []string  `json:"notes,omitempty"`
}

// Host describes the machine the run measured.
type Host struct {
	CPUs        int    `json:"cpus"`
	MemTotalMiB int64  `json:"mem_total_mib"`
	Kernel      string `json:"kernel"`
	QEMU        string `json:"qemu"`
	Accel       string `json:"accelerator"`
	Containerd  string `json:"containerd"`
	LoadStart   string `json:"loadavg_start"`
	LoadEnd     string `json:"loadavg_end"`
}

// Guest is the size every pod's VM was given.
type Guest struct {
	MemoryMiB int `json:"memory_mib"`
	VCPUs     int `json:"vcpus"`
}

// Image is the one image every pod ran.
type Image struct {
	Name    string `json:"name"`
	Files   int    `json:"files"`
	Entries int    `json:"entries"` // files, directories and symlinks
	Bytes   int64  `json:"bytes"`   // the layer tar
}

// Backend is the sweep of pod counts on one backend.
type Backend struct {
	Name string `json:"name"`
	Runs []Run  `json:"runs"`
	// Stopped says why the sweep ended before its largest count, if it did.
	Stopped string `json:"stopped,omitempty"`
}

// Run is N pods started at once, measured once all of them printed.
type Run struct {
	N    int   `json:"n"`
	Pods []Pod `json:"pods"`
	// LastSeconds is the start of the last pod: from the concurrent
	// start to its first output line.
	LastSeconds  float64 `json:"last_seconds"`
	FirstSeconds float64 `json:"first_seconds"`
	// MemAvailableDropKiB is MemAvailable before the start less
	// MemAvailable once every pod printed; ClientsPSSKiB is what the
	// benchmark's own `ctr run` clients held then, part of that drop but
	// not of any pod.
	MemAvailableDropKiB int64 `json:"mem_available_drop_kib"`
	ClientsPSSKiB       int64 `json:"clients_pss_kib"`
	// MetadataEntries counts imagefs-blk's cache/images entries and
	// MetaFiles every meta.bin under the test's directory, both on the
	// node after the run's pods started (the store keeps entries after
	// their pods, so over a sweep they add up); MetaInUse counts the
	// distinct meta.bin files the run's pods hold open or mapped.
	MetadataEntries int    `json:"metadata_entries"`
	MetaFiles       int    `json:"meta_files"`
	MetaInUse       int    `json:"meta_in_use,omitempty"`
	Load            string `json:"loadavg"`
}

// Pod is one pod's host processes when every pod of its run was up.
type Pod struct {
	ID           string    `json:"id"`
	ReadySeconds float64   `json:"ready_seconds"`
	Procs        []Process `json:"procs"`
}

// Process is one host process of a pod: PSS from /proc/PID/smaps_rollup,
// Rss* from /proc/PID/status, in KiB.
type Process struct {
	Kind        string `json:"kind"`
	PID         int    `json:"pid"`
	Comm        string `json:"comm"`
	PssKiB      int64  `json:"pss_kib"`
	PssAnonKiB  int64  `json:"pss_anon_kib"`
	PssFileKiB  int64  `json:"pss_file_kib"`
	PssShmemKiB int64  `json:"pss_shmem_kib"`
	RssAnonKiB  int64  `json:"rss_anon_kib"`
	RssFileKiB  int64  `json:"rss_file_kib"`
	RssShmemKiB int64  `json:"rss_shmem_kib"`
}

// Sum adds up a field over the pod's processes of a kind ("" for all).
func (p Pod) Sum(kind string, field func(Process) int64) int64 {
	var n int64
	for _, pr := range p.Procs {
		if kind == "" || pr.Kind == kind {
			n += field(pr)
		}
	}
	return n
}

// ServingKind is the process kind that serves a backend's root
// filesystem: the shim for imagefs-blk (in-process vhost-user-blk),
// virtiofsd for virtio-fs.
func ServingKind(backend string) string {
	if backend == "imagefs-blk" {
		return KindShim
	}
	return KindVirtiofsd
}

// ServingRssAnonKiB is the private (anonymous resident) memory of the
// pod's serving side on backend.
func (p Pod) ServingRssAnonKiB(backend string) int64 {
	return p.Sum(ServingKind(backend), func(pr Process) int64 { return pr.RssAnonKiB })
}

// TotalPSSKiB is the run's host memory: the PSS of every process of
// every pod, which counts each shared page once across them.
func (r Run) TotalPSSKiB() int64 {
	var n int64
	for _, p := range r.Pods {
		n += p.Sum("", func(pr Process) int64 { return pr.PssKiB })
	}
	return n
}

func (r Run) sum(kind string, field func(Process) int64) int64 {
	var n int64
	for _, p := range r.Pods {
		n += p.Sum(kind, field)
	}
	return n
}

// servingRssAnon lists every pod's serving-side RssAnon, sorted.
func (r Run) servingRssAnon(backend string) []int64 {
	v := make([]int64, 0, len(r.Pods))
	for _, p := range r.Pods {
		v = append(v, p.ServingRssAnonKiB(backend))
	}
	slices.Sort(v)
	return v
}

func mib(kib int64) float64 { return float64(kib) / 1024 }

func median(v []int64) int64 {
	if len(v) == 0 {
		return 0
	}
	return v[len(v)/2]
}

// Markdown renders the run as the density section of docs/benchmarks.md.
func (res *Result) Markdown() string {
	var b strings.Builder
	if res.Title != "" {
		fmt.Fprintf(&b, "#### %s\n\n", res.Title)
	}
	fmt.Fprintf(&b, "Run %s, `%s` (commit %s), wall clock %.1f min.\n\n", res.Date, res.Command, res.Commit, res.WallSeconds/60)
	h := res.Host
	fmt.Fprintf(&b, "Host: %d CPUs, %d MiB, kernel %s, load average %s at the start and %s at the end (the machine is shared with other work); %s; accelerator **%s**; %s. ",
		h.CPUs, h.MemTotalMiB, h.Kernel, h.LoadStart, h.LoadEnd, h.QEMU, h.Accel, h.Containerd)
	fmt.Fprintf(&b, "Guests: %d vCPU, %d MiB (`default_memory`, a shared memfd). Image `%s`: one layer of %d entries (%d regular files, %.1f MiB tar), every pod runs `find /data | wc -l` and `md5sum` of one file, prints one line, then sleeps.\n\n",
		res.Guest.VCPUs, res.Guest.MemoryMiB, res.Image.Name, res.Image.Entries, res.Image.Files, float64(res.Image.Bytes)/(1<<20))
	for _, n := range res.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	if len(res.Notes) > 0 {
		b.WriteString("\n")
	}
	b.WriteString("| backend | pods at once | last pod's first output | first pod's | host memory: PSS of all pods' processes | per pod | per added pod (vs the row above) | per pod: guest RAM (shmem PSS) | per pod: QEMU without guest RAM | per pod: shim | per pod: virtiofsd | serving side's private memory (RssAnon) per pod: median (max) | MemAvailable drop per pod (clients excluded) |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	pss := func(pr Process) int64 { return pr.PssKiB }
	shm := func(pr Process) int64 { return pr.PssShmemKiB }
	for _, be := range res.Backends {
		var prev *Run
		for i := range be.Runs {
			r := &be.Runs[i]
			n := float64(r.N)
			total := r.TotalPSSKiB()
			added := "—"
			if prev != nil && r.N > prev.N {
				added = fmt.Sprintf("%.1f MiB", mib(total-prev.TotalPSSKiB())/float64(r.N-prev.N))
			}
			if r.N < 1 || len(r.Pods) == 0 {
				fmt.Fprintf(&b, "| %s | %d | no pod measured | | | | | | | | | | |\n", be.Name, r.N)
				continue
			}
			qemuNoRAM := r.sum(KindQEMU, pss) - r.sum(KindQEMU, shm)
			serving := r.servingRssAnon(be.Name)
			fmt.Fprintf(&b, "| %s | %d | %.1f s | %.1f s | %.0f MiB | %.1f MiB | %s | %.1f MiB | %.1f MiB | %.1f MiB | %.1f MiB | %.1f MiB (%.1f) | %.1f MiB |\n",
				be.Name, r.N, r.LastSeconds, r.FirstSeconds, mib(total), mib(total)/n, added,
				mib(r.sum("", shm))/n, mib(qemuNoRAM)/n, mib(r.sum(KindShim, pss))/n, mib(r.sum(KindVirtiofsd, pss))/n,
				mib(median(serving)), mib(serving[len(serving)-1]),
				mib(r.MemAvailableDropKiB-r.ClientsPSSKiB)/n)
			prev = r
		}
	}
	b.WriteString("\n")
	for _, be := range res.Backends {
		if be.Stopped != "" {
			fmt.Fprintf(&b, "The %s sweep stopped early: %s.\n\n", be.Name, be.Stopped)
		}
	}
	var meta []string
	for _, be := range res.Backends {
		if be.Name != "imagefs-blk" {
			continue
		}
		for _, r := range be.Runs {
			inUse := "not measured"
			if r.MetaInUse > 0 {
				inUse = fmt.Sprint(r.MetaInUse)
			}
			meta = append(meta, fmt.Sprintf("| %d | %s | %d | %d |", r.N, inUse, r.MetadataEntries, r.MetaFiles))
		}
	}
	if len(meta) > 0 {
		b.WriteString("imagefs-blk's synthesized metadata, counted in each run once every pod printed (the node's counts add up over the sweep: the store keeps an entry after its pods, until a prune):\n\n")
		b.WriteString("| pods at once | distinct meta.bin open or mapped by the run's pods | cache/images entries on the node | meta.bin files on the node |\n|---:|---:|---:|---:|\n")
		b.WriteString(strings.Join(meta, "\n") + "\n")
	}
	return b.String()
}
