package bench

import (
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
)

// Kinds of row: where the workloads run and how the bench image reaches them.
const (
	KindHost       = "host"        // no VM: a chroot on the host's filesystem
	KindVirtio9P   = "virtio-9p"   // QEMU's 9p server on a copy of the image
	KindVirtioFS   = "virtio-fs"   // virtiofsd on a copy of the image
	KindImagefsBlk = "imagefs-blk" // the image indexed, served by kata-fsx
	KindVirtioBlk  = "virtio-blk"  // the same image exported raw, behind QEMU's virtio-blk
)

// Row is one backend configuration of the matrix, parsed from a --backends item
// such as "virtio-fs:cache=auto,threads=2".
type Row struct {
	Spec string // as given, the row's name in reports
	Kind string
	// Cache is virtio_fs_cache; Threads the virtiofsd thread pool (0 = the
	// configuration's); DAXMiB the DAX window (0 = off).
	Cache   string
	Threads int
	DAXMiB  int
	// Agent is the row's kata_fsx.agent_transport (auto, vsock,
	// hybrid-vsock, virtio-serial); empty keeps the configuration's.
	Agent string
}

// DefaultBackends is the matrix `kata-fsx bench` runs without --backends.
func DefaultBackends() []string {
	return []string{
		KindHost,
		KindVirtio9P,
		"virtio-fs:cache=never",
		"virtio-fs:cache=auto",
		"virtio-fs:cache=always",
		fmt.Sprintf("virtio-fs:cache=auto,threads=%d", runtime.NumCPU()),
		"virtio-fs:cache=auto,dax=1024",
		KindImagefsBlk,
		KindVirtioBlk,
	}
}

// ParseRow parses one --backends item.
func ParseRow(spec string) (Row, error) {
	kind, opts, _ := strings.Cut(strings.TrimSpace(spec), ":")
	r := Row{Spec: strings.TrimSpace(spec), Kind: kind}
	kinds := []string{KindHost, KindVirtio9P, KindVirtioFS, KindImagefsBlk, KindVirtioBlk}
	if !slices.Contains(kinds, kind) {
		return r, fmt.Errorf("--backends %q: unknown backend %q; use one of %s", spec, kind, strings.Join(kinds, ", "))
	}
	if opts == "" {
		if kind == KindVirtioFS {
			r.Cache = "auto"
		}
		return r, nil
	}
	for _, kv := range strings.Split(opts, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return r, fmt.Errorf("--backends %q: option %q: want key=value", spec, kv)
		}
		switch {
		case k == "cache" && kind == KindVirtioFS:
			switch v {
			case "never", "none", "metadata", "auto", "always":
				r.Cache = v
			default:
				return r, fmt.Errorf("--backends %q: cache=%s: use never, metadata, auto or always", spec, v)
			}
		case k == "threads" && kind == KindVirtioFS:
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1024 {
				return r, fmt.Errorf("--backends %q: threads=%s: want a thread count from 1 to 1024", spec, v)
			}
			r.Threads = n
		case k == "dax" && kind == KindVirtioFS:
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1<<20 {
				return r, fmt.Errorf("--backends %q: dax=%s: want the DAX window in MiB", spec, v)
			}
			r.DAXMiB = n
		case k == "agent" && kind != KindHost:
			switch v {
			case "auto", "vsock", "hybrid-vsock", "virtio-serial":
				r.Agent = v
			default:
				return r, fmt.Errorf("--backends %q: agent=%s: use auto, vsock, hybrid-vsock or virtio-serial", spec, v)
			}
		default:
			return r, fmt.Errorf("--backends %q: option %q does not apply to %s (virtio-fs takes cache, threads, dax; VM rows take agent)", spec, k, kind)
		}
	}
	if kind == KindVirtioFS && r.Cache == "" {
		r.Cache = "auto"
	}
	return r, nil
}

// ParseRows parses a comma-separated --backends value; items are separated
// by ';' or by a ',' followed by a backend name, so "virtio-fs:cache=auto,threads=2"
// stays one item.
func ParseRows(list string) ([]Row, error) {
	var rows []Row
	seen := map[string]bool{}
	for _, item := range splitBackends(list) {
		r, err := ParseRow(item)
		if err != nil {
			return nil, err
		}
		if seen[r.Spec] {
			return nil, fmt.Errorf("--backends: %q is listed twice", r.Spec)
		}
		seen[r.Spec] = true
		rows = append(rows, r)
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("--backends: empty list")
	}
	return rows, nil
}

func splitBackends(list string) []string {
	var items []string
	for _, part := range strings.Split(list, ";") {
		cur := ""
		for _, f := range strings.Split(part, ",") {
			name, _, _ := strings.Cut(f, ":")
			isStart := slices.Contains([]string{KindHost, KindVirtio9P, KindVirtioFS, KindImagefsBlk, KindVirtioBlk}, strings.TrimSpace(name))
			if cur != "" && isStart {
				items = append(items, cur)
				cur = ""
			}
			if cur == "" {
				cur = strings.TrimSpace(f)
			} else {
				cur += "," + strings.TrimSpace(f)
			}
		}
		if cur != "" {
			items = append(items, cur)
		}
	}
	return items
}

// HostCaps is what decides whether a row can run on this host.
type HostCaps struct {
	Root        bool
	DAX         bool   // QEMU's vhost-user-fs-pci has cache-size
	Virtiofsd   string // the daemon's path, "" when none is configured or found
	Accel       string // kvm or tcg
	QEMUVersion string
}

// SkipReason says why a row cannot run here, or "" when it can.
func (r Row) SkipReason(h HostCaps) string {
	if !h.Root {
		return "needs root (VMs with vhost-user devices, mounts, drop_caches)"
	}
	switch r.Kind {
	case KindVirtioFS:
		if h.Virtiofsd == "" {
			return "no virtiofsd configured or found"
		}
		if r.DAXMiB > 0 && !h.DAX {
			return fmt.Sprintf("DAX not supported by this QEMU (%s: vhost-user-fs-pci has no cache-size property)", h.QEMUVersion)
		}
	}
	return ""
}

// UsesVM says whether the row boots a pod VM.
func (r Row) UsesVM() bool { return r.Kind != KindHost }
