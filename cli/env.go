package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/host"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

// envFormatVersion is the [Meta] Version of `kata-runtime env` whose
// layout we follow (formatVersion in Kata's kata-env.go).
const envFormatVersion = "1.0.27"

const notFound = "not found"

// EnvInfo is what `kata-fsx env` prints: every section and field of
// kata-runtime env at its path and with its type, and kata-fsx's own
// fields added after Kata's (never in their place).
type EnvInfo struct {
	Kernel     KernelInfo
	Meta       MetaInfo
	Image      PathInfo
	Initrd     PathInfo
	Hypervisor HypervisorInfo
	Runtime    RuntimeInfo
	Host       HostInfo
	Agent      AgentInfo
	ImagefsBlk ImagefsBlkInfo
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
	EntropySource     string
	SharedFS          string
	VirtioFSDaemon    string
	SocketPath        string
	Msize9p           uint32
	MemorySlots       uint32
	HotPlugVFIO       string
	ColdPlugVFIO      string
	PCIeRootPort      uint32
	PCIeSwitchPort    uint32
	Debug             bool
	SecurityInfo      SecurityInfo

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
	AcceleratorCacheDir   string
	DefaultMemory         uint32
	DefaultVCPUs          int32
	// GuestRAM is how a pod's RAM is backed: "memfd" (a share=on memfd),
	// "file" (a share=on file in GuestRAMPath), "private" (no vhost-user
	// device maps it: QEMU's own anonymous memory) or "unavailable" (it
	// must be shared and cannot be; the shim refuses the pod).
	GuestRAM       string
	GuestRAMPath   string
	GuestRAMReason string
}

// SecurityInfo is [Hypervisor.SecurityInfo].
type SecurityInfo struct {
	Rootless          bool
	DisableSeccomp    bool
	GuestHookPath     string
	EnableAnnotations []string
	ConfidentialGuest bool
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
	Config              RuntimeConfigInfo
	Path                string
	GuestSeLinuxLabel   string
	Experimental        []ExperimentalFeature
	Version             RuntimeVersionInfo
	Debug               bool
	Trace               bool
	DisableGuestSeccomp bool
	DisableNewNetNs     bool
	SandboxCgroupOnly   bool
}

// ExperimentalFeature is an element of [Runtime] Experimental.
type ExperimentalFeature struct {
	Name        string
	Description string
	ExpRelease  string
}

// RuntimeConfigInfo is [Runtime.Config].
type RuntimeConfigInfo struct {
	Path    string
	DropIns []string
}

// RuntimeVersionInfo is [Runtime.Version].
type RuntimeVersionInfo struct {
	OCI     string
	Version VersionInfo
}

// VersionInfo is [Runtime.Version.Version]: kata-fsx's release.
type VersionInfo struct {
	Semver string
	Commit string
	Major  uint64
	Minor  uint64
	Patch  uint64
}

// HostInfo is the [Host] section.
type HostInfo struct {
	AvailableGuestProtections []string
	Kernel                    string
	Architecture              string
	Distro                    DistroInfo
	CPU                       CPUInfo
	Memory                    MemoryInfo
	VMContainerCapable        bool
	SupportVSocks             bool

	ShmFreeMiB uint64
	Memfd      bool
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
	Debug bool
	Trace bool

	DialTimeout   uint32
	KernelModules []string
	// Transport is the agent transport pods get: vsock (vhost-vsock),
	// hybrid-vsock or virtio-serial; TransportReason says why.
	Transport       string
	TransportReason string
	// TransportError is the shim's refusal of every pod with this
	// transport; empty when pods boot.
	TransportError string
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
	cfgPath := fs.String("config", "", "configuration file (default: $"+config.EnvConfigFile+", then "+strings.Join(config.DefaultPaths, ", ")+")")
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
	h := host.Probe(ctx, c)
	if err := config.Validate(c, h.Facts()); err != nil {
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
	if h.Accel == hypervisor.AccelTCG {
		fmt.Fprintf(stderr, "warning: accelerator resolves to TCG (%s): guests run in software emulation, slowly\n", h.AccelReason)
	}
	if h.TransportErr != nil {
		fmt.Fprintf(stderr, "warning: agent transport %s: the shim refuses every pod: %v\n", h.Transport, h.TransportErr)
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
	d, err := sandbox.Decide(sandbox.Spec{Config: c, Annotations: ann, Rootfs: r})
	if err != nil {
		return nil, err
	}
	return &PolicyInfo{Annotations: path, Rootfs: desc, Backend: d.Backend, Reason: d.Reason, VolumesViaVirtioFS: d.VolumesViaVirtioFS}, nil
}

// buildEnv fills kata-runtime env's fields from the configuration and the
// host probe the shim boots pods with; Kata fields that name features
// kata-fsx does not have carry the value that matches its behaviour (no
// VFIO ports, no seccomp in the guest, no tracing, no experimental features).
func buildEnv(c *config.Config, h *host.Host) *EnvInfo {
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
			EntropySource:     q.EntropySource,
			SharedFS:          c.SharedFS(),
			VirtioFSDaemon:    q.VirtioFSDaemon,
			Msize9p:           q.Msize9p,
			MemorySlots:       q.MemorySlots,
			HotPlugVFIO:       noVFIOPort,
			ColdPlugVFIO:      noVFIOPort,
			Debug:             q.EnableDebug,
			SecurityInfo: SecurityInfo{
				DisableSeccomp:    true, // QEMU runs without -sandbox
				EnableAnnotations: nonNil(q.EnableAnnotations),
			},

			VirtioFSDaemonFlavour: notFound,
			VirtioFSDaemonVersion: notFound,
			VirtioFSCache:         q.VirtioFSCache,
			VirtioFSCacheSize:     q.VirtioFSCacheSize,
			VirtioFSQueueSize:     q.VirtioFSQueueSize,
			VirtioFSExtraArgs:     nonNil(q.VirtioFSExtraArgs),
			Accelerator:           string(h.Accel),
			AcceleratorReason:     h.AccelReason,
			AcceleratorCacheDir:   h.AccelCacheDir,
			DefaultMemory:         q.DefaultMemory,
			DefaultVCPUs:          q.DefaultVCPUs,
		},
		ImagefsBlk: ImagefsBlkInfo{
			StateDir: b.StateDir, WritableSizeMB: b.WritableSizeMB, BlockSize: b.BlockSize,
			NumQueues: b.NumQueues, QueueSize: b.QueueSize, Journal: b.Journal, JournalSizeMB: b.JournalSizeMB,
		},
		Runtime: RuntimeInfo{
			Config:              RuntimeConfigInfo{Path: c.Path, DropIns: nonNil(c.DropIns)},
			Experimental:        []ExperimentalFeature{},
			Version:             RuntimeVersionInfo{OCI: specs.Version, Version: versionInfo(Version)},
			Debug:               c.Runtime.EnableDebug,
			DisableGuestSeccomp: c.Runtime.DisableGuestSeccomp,
		},
		Agent: AgentInfo{
			Debug:         c.AgentKata().EnableDebug,
			DialTimeout:   c.AgentKata().DialTimeout,
			KernelModules: nonNil(c.AgentKata().KernelModules),
		},
	}
	if exe, err := os.Executable(); err == nil {
		info.Runtime.Path = exe
	}
	if h.QEMU != nil {
		info.Hypervisor.Version = h.QEMU.VersionLine
		info.Hypervisor.DAXSupported = h.QEMU.DAX
	}
	if h.Daemon != nil {
		info.Hypervisor.VirtioFSDaemonFlavour = string(h.Daemon.Flavour)
		info.Hypervisor.VirtioFSDaemonVersion = h.Daemon.Version
		if m, err := h.Daemon.Flavour.CacheMode(q.VirtioFSCache); err == nil {
			info.Hypervisor.VirtioFSDaemonCache = m
		}
	}
	switch h.Transport {
	case config.TransportHybridVsock:
		// Kata reports the unix socket template of a hybrid vsock here.
		info.Hypervisor.SocketPath = sandbox.HybridVsockSocket(c, "{ID}")
	case config.TransportVirtioSerial:
		// The virtio-serial channel's socket is a hybrid vsock's counterpart.
		info.Hypervisor.SocketPath = sandbox.AgentSocket(c, "{ID}")
	}
	info.Hypervisor.GuestRAM, info.Hypervisor.GuestRAMPath, info.Hypervisor.GuestRAMReason = guestRAMInfo(c, h)
	info.Agent.Transport, info.Agent.TransportReason = h.Transport, h.TransportReason
	if h.TransportErr != nil {
		info.Agent.TransportError = h.TransportErr.Error()
	}
	sys := h.System
	info.Host = HostInfo{
		AvailableGuestProtections: []string{},
		Kernel:                    sys.Kernel,
		Architecture:              sys.Architecture,
		Distro:                    DistroInfo{Name: sys.DistroName, Version: sys.DistroVersion},
		CPU:                       CPUInfo{Vendor: sys.CPUVendor, Model: sys.CPUModel, CPUs: sys.CPUs},
		Memory:                    MemoryInfo{Total: h.Memory.TotalKiB, Free: h.Memory.FreeKiB, Available: h.Memory.AvailableKiB},
		VMContainerCapable:        h.Accel == hypervisor.AccelKVM,
		SupportVSocks:             h.Vsock,
		ShmFreeMiB:                h.ShmFreeMiB,
		Memfd:                     h.Memfd,
	}
	return info
}

// guestRAMInfo says how the configuration's pods get their RAM on this
// host: shared as the probe decided when a vhost-user device maps it (the
// sandbox's rule), else private.
func guestRAMInfo(c *config.Config, h *host.Host) (backend, path, why string) {
	hybrid := h.TransportErr == nil && h.Transport == config.TransportHybridVsock
	if !c.NeedsSharedMemory() && !hybrid {
		return "private", "", fmt.Sprintf("no vhost-user device maps it (shared_fs %s, agent transport %s)", c.SharedFS(), h.Transport)
	}
	switch h.GuestRAM {
	case hypervisor.SharedMemoryMemfd:
		return "memfd", "", h.GuestRAMReason
	case hypervisor.SharedMemoryFile:
		return "file", h.GuestRAMDir, h.GuestRAMReason
	}
	return "unavailable", "", h.GuestRAMReason
}

// noVFIOPort is Kata's PCIePort value for VFIO hot- and cold-plug turned
// off, which is all kata-fsx does.
const noVFIOPort = "no-port"

// nonNil keeps empty lists printed as [] rather than null, as arrays.
func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// versionInfo splits a release as the Makefile stamps it (git describe:
// "1.2.3", "v1.2.3-4-gabc1234-dirty", or a bare "abc1234" where no tag
// exists) into Kata's VersionInfo. The commit is the one the Go toolchain
// recorded, else the one git describe names.
func versionInfo(release string) VersionInfo {
	v := VersionInfo{Semver: strings.TrimPrefix(release, "v")}
	core, _, _ := strings.Cut(v.Semver, "-")
	core, _, _ = strings.Cut(core, "+")
	nums := strings.SplitN(core, ".", 3)
	for i, dst := range []*uint64{&v.Major, &v.Minor, &v.Patch} {
		if i < len(nums) {
			*dst, _ = strconv.ParseUint(nums[i], 10, 64)
		}
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				v.Commit = s.Value
			}
		}
	}
	described := strings.TrimSuffix(v.Semver, "-dirty")
	if c := describedCommit(described); c == described {
		// No tag: the release is only a commit, and has no numbers.
		v.Major, v.Minor, v.Patch = 0, 0, 0
	}
	if v.Commit == "" {
		v.Commit = describedCommit(described)
	}
	return v
}

// describedCommit is the abbreviated commit in git describe's output:
// the "-g<hash>" suffix, or the whole output when no tag was found.
func describedCommit(d string) string {
	if i := strings.LastIndex(d, "-g"); i >= 0 && isHex(d[i+2:]) {
		return d[i+2:]
	}
	if isHex(d) && len(d) >= 7 {
		return d
	}
	return ""
}

func isHex(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !strings.ContainsRune("0123456789abcdef", r) {
			return false
		}
	}
	return true
}
