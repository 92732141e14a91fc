package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"

	"github.com/BurntSushi/toml"

	"github.com/kata-fsx/kata-fsx/config"
)

// envFormatVersion is the [Meta] Version of `kata-runtime env` whose layout we follow.
const envFormatVersion = "1.0.26"

const notFound = "not found"

// EnvInfo is what `kata-fsx env` prints: kata-runtime env's sections and
// field names, plus kata-fsx's own.
type EnvInfo struct {
	Kernel     KernelInfo
	Meta       MetaInfo
	Image      PathInfo
	Initrd     PathInfo
	Hypervisor HypervisorInfo
	ImagefsBlk ImagefsBlkInfo
	Runtime    RuntimeInfo
	Host       HostInfo
	Agent      AgentInfo
	Policy     *PolicyInfo `toml:",omitempty" json:",omitempty"`
}

// KernelInfo is the [Kernel] section.
type KernelInfo struct {
	Path       string
	Parameters string
}

// MetaInfo is the [Meta] section.
type MetaInfo struct{ Version string }

// PathInfo is the [Image] and [Initrd] sections.
type PathInfo struct{ Path string }

// HypervisorInfo is the [Hypervisor] section.
type HypervisorInfo struct {
	MachineType       string
	Version           string
	Path              string
	BlockDeviceDriver string
	SharedFS          string
	VirtioFSDaemon    string
	Msize9p           uint32
	MemorySlots       uint32
	Debug             bool

	VirtioFSDaemonFlavour string
	VirtioFSDaemonVersion string
	VirtioFSCache         string
	VirtioFSDaemonCache   string // the cache mode in the daemon's own spelling
	VirtioFSCacheSize     uint32
	VirtioFSQueueSize     uint32
	VirtioFSExtraArgs     []string
	DAXSupported          bool
	Accelerator           string
	AcceleratorReason     string
	DefaultMemory         uint32
	DefaultVCPUs          int32
}

// ImagefsBlkInfo is the [ImagefsBlk] section: the kata_fsx.imagefs_blk table.
type ImagefsBlkInfo struct {
	StateDir       string
	WritableSizeMB uint64
	BlockSize      uint32
	NumQueues      uint32
	QueueSize      uint32
	Journal        bool
	JournalSizeMB  uint32
}

// RuntimeInfo is the [Runtime] section.
type RuntimeInfo struct {
	Path    string
	Debug   bool
	Config  RuntimeConfigInfo
	Version RuntimeVersionInfo
}

// RuntimeConfigInfo is [Runtime.Config].
type RuntimeConfigInfo struct {
	Path    string
	DropIns []string
}

// RuntimeVersionInfo is [Runtime.Version].
type RuntimeVersionInfo struct {
	Semver string
	OCI    string
}

// HostInfo is the [Host] section.
type HostInfo struct {
	Kernel             string
	Architecture       string
	VMContainerCapable bool
	SupportVSocks      bool
	Distro             DistroInfo
	CPU                CPUInfo
	Memory             MemoryInfo
	ShmFreeMiB         uint64
	Memfd              bool
}

// DistroInfo is [Host.Distro].
type DistroInfo struct{ Name, Version string }

// CPUInfo is [Host.CPU].
type CPUInfo struct {
	Vendor, Model string
	CPUs          int
}

// MemoryInfo is [Host.Memory], in KiB as kata-runtime reports it.
type MemoryInfo struct{ Total, Free, Available uint64 }

// AgentInfo is the [Agent] section.
type AgentInfo struct {
	Debug           bool
	DialTimeout     uint32
	KernelModules   []string
	Transport       string
	TransportReason string
}

// PolicyInfo is the backend decision for the pod given with --pod-annotations.
type PolicyInfo struct {
	Annotations        string
	Rootfs             string
	Backend            string
	Reason             string
	VolumesViaVirtioFS bool
}

func runEnv(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("env", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (default: $KATA_FSX_CONF_FILE, /etc/kata-containers/configuration.toml, /usr/share/defaults/kata-containers/configuration.toml)")
	asJSON := fs.Bool("json", false, "print JSON instead of TOML")
	podAnn := fs.String("pod-annotations", "", "JSON file with a pod's annotations: print the backend the policy picks for it")
	rootfsType := fs.String("rootfs-type", "overlay", "with --pod-annotations: the pod's rootfs (overlay, dir or other)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	c, err := config.Load(*cfgPath, config.DevPath())
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx env: %v\n", err)
		return 1
	}
	h := probeHost(ctx, c)
	if err := config.Validate(c, h.facts()); err != nil {
		if failed := reportValidation(stderr, err, false); failed {
			return 1
		}
	}
	info := buildEnv(c, h)
	if *podAnn != "" {
		p, err := decideForFile(c, *podAnn, *rootfsType)
		if err != nil {
			fmt.Fprintf(stderr, "kata-fsx env: pod %s: %v\n", *podAnn, err)
			return 1
		}
		info.Policy = p
	}
	if h.accel == "tcg" {
		fmt.Fprintf(stderr, "warning: accelerator resolves to TCG (%s): guests run in software emulation, slowly\n", h.accelWhy)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(info)
	} else {
		err = toml.NewEncoder(stdout).Encode(info)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx env: %v\n", err)
		return 1
	}
	return 0
}

// reportValidation prints validation problems; problems of the host are
// warnings unless strict, problems of the file always fail.
func reportValidation(w io.Writer, err error, strict bool) (failed bool) {
	for _, e := range unjoin(err) {
		var ce *config.Error
		if errors.As(e, &ce) && ce.Host && !strict {
			fmt.Fprintf(w, "warning: %v\n", e)
			continue
		}
		fmt.Fprintf(w, "error: %v\n", e)
		failed = true
	}
	return failed
}

func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func decideForFile(c *config.Config, path, rootfsType string) (*PolicyInfo, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var ann map[string]string
	if err := json.Unmarshal(data, &ann); err != nil {
		return nil, fmt.Errorf("want a JSON object of string annotations: %w", err)
	}
	var r config.Rootfs
	var desc string
	switch rootfsType {
	case "overlay":
		r = config.Rootfs{Kind: config.RootfsOverlay, Layers: []string{"/lower", "/upper"}, UpperDir: "/upper"}
		desc = "assumed: an overlayfs snapshot (containerd's default snapshotter)"
	case "dir":
		r = config.Rootfs{Kind: config.RootfsDir, Layers: []string{"/rootfs"}}
		desc = "assumed: a bind/native snapshot directory"
	case "other":
		r = config.Rootfs{Kind: config.RootfsOther, Why: "--rootfs-type other"}
		desc = "assumed: a rootfs that cannot be indexed"
	default:
		return nil, fmt.Errorf("--rootfs-type %q: use overlay, dir or other", rootfsType)
	}
	d, err := config.Decide(c, config.Pod{Annotations: ann, Rootfs: r})
	if err != nil {
		return nil, err
	}
	return &PolicyInfo{Annotations: path, Rootfs: desc, Backend: d.Backend, Reason: d.Reason, VolumesViaVirtioFS: d.VolumesViaVirtioFS}, nil
}

func buildEnv(c *config.Config, h *hostState) *EnvInfo {
	q := c.QEMU()
	b := c.KataFSX.ImagefsBlk
	info := &EnvInfo{
		Kernel: KernelInfo{Path: q.Kernel, Parameters: q.KernelParams},
		Meta:   MetaInfo{Version: envFormatVersion},
		Image:  PathInfo{Path: q.Image},
		Initrd: PathInfo{Path: q.Initrd},
		Hypervisor: HypervisorInfo{
			MachineType:       q.MachineType,
			Version:           notFound,
			Path:              q.Path,
			BlockDeviceDriver: q.BlockDeviceDriver,
			SharedFS:          c.SharedFS(),
			VirtioFSDaemon:    q.VirtioFSDaemon,
			Msize9p:           q.Msize9p,
			MemorySlots:       q.MemorySlots,
			Debug:             q.EnableDebug,

			VirtioFSDaemonFlavour: notFound,
			VirtioFSDaemonVersion: notFound,
			VirtioFSCache:         q.VirtioFSCache,
			VirtioFSCacheSize:     q.VirtioFSCacheSize,
			VirtioFSQueueSize:     q.VirtioFSQueueSize,
			VirtioFSExtraArgs:     q.VirtioFSExtraArgs,
			Accelerator:           string(h.accel),
			AcceleratorReason:     h.accelWhy,
			DefaultMemory:         q.DefaultMemory,
			DefaultVCPUs:          q.DefaultVCPUs,
		},
		ImagefsBlk: ImagefsBlkInfo{
			StateDir: b.StateDir, WritableSizeMB: b.WritableSizeMB, BlockSize: b.BlockSize,
			NumQueues: b.NumQueues, QueueSize: b.QueueSize, Journal: b.Journal, JournalSizeMB: b.JournalSizeMB,
		},
		Runtime: RuntimeInfo{
			Debug:   c.Runtime.EnableDebug,
			Config:  RuntimeConfigInfo{Path: c.Path, DropIns: c.DropIns},
			Version: RuntimeVersionInfo{Semver: Version, OCI: "1.1.0"},
		},
		Agent: AgentInfo{Debug: c.AgentKata().EnableDebug, DialTimeout: c.AgentKata().DialTimeout, KernelModules: c.AgentKata().KernelModules},
	}
	if exe, err := os.Executable(); err == nil {
		info.Runtime.Path = exe
	}
	if h.caps != nil {
		info.Hypervisor.Version = h.caps.VersionLine
		info.Hypervisor.DAXSupported = h.caps.DAX
	}
	if h.daemon != nil {
		info.Hypervisor.VirtioFSDaemonFlavour = string(h.daemon.Flavour)
		info.Hypervisor.VirtioFSDaemonVersion = h.daemon.Version
		if m, err := config.DaemonCacheMode(q.VirtioFSCache, h.daemon.Flavour); err == nil {
			info.Hypervisor.VirtioFSDaemonCache = m
		}
	}
	info.Agent.Transport, info.Agent.TransportReason = h.transport(c)
	name, ver := osRelease()
	vendor, model := cpuInfo()
	info.Host = HostInfo{
		Kernel:             kernelRelease(),
		Architecture:       goarch(),
		VMContainerCapable: h.accel == "kvm",
		SupportVSocks:      h.vsock,
		Distro:             DistroInfo{Name: name, Version: ver},
		CPU:                CPUInfo{Vendor: vendor, Model: model, CPUs: runtime.NumCPU()},
		Memory:             MemoryInfo{Total: h.mem.TotalKiB, Free: h.mem.FreeKiB, Available: h.mem.AvailableKiB},
		ShmFreeMiB:         h.shmFree,
		Memfd:              h.memfd,
	}
	return info
}
