// Package config loads Kata's configuration.toml the way Kata does, adds the
// kata-fsx table, validates the result against the host, applies per-pod
// annotations and decides which filesystem backend a pod gets.
package config

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/BurntSushi/toml"
)

// Shared filesystem values of shared_fs.
const (
	SharedFSVirtioFS   = "virtio-fs"
	SharedFS9P         = "virtio-9p"
	SharedFSImagefsBlk = "imagefs-blk"
	SharedFSAuto       = "auto"
	// SharedFSVirtioFSNydus and SharedFSNone are Kata values kata-fsx
	// recognises but does not run.
	SharedFSVirtioFSNydus = "virtio-fs-nydus"
	SharedFSNone          = "none"
)

// Accelerator and agent transport choices of the kata_fsx table.
const (
	AccelAuto = "auto"
	AccelKVM  = "kvm"
	AccelTCG  = "tcg"

	// TransportAuto picks vhost-vsock, else hybrid vsock, else virtio-serial (package host decides).
	TransportAuto = "auto"
	// TransportVsock is Kata's vsock: vhost-vsock where the host has it, else hybrid vsock.
	TransportVsock = "vsock"
	// TransportHybridVsock is QEMU's vhost-user-vsock-pci served by kata-fsx, reached through a unix socket.
	TransportHybridVsock = "hybrid-vsock"
	// TransportVirtioSerial is a virtio-serial port, for kata-fsx's test agent only: Kata's agent does not speak it.
	TransportVirtioSerial = "virtio-serial"
)

// EnvConfigFile names the environment variable that points at a config file.
const EnvConfigFile = "KATA_FSX_CONF_FILE"

// DefaultPaths are the system locations searched, in order, after an
// explicit path and the environment variable: an admin's override in /etc,
// then the file 'make install' writes. They are kata-fsx's own file beside
// Kata's configuration.toml, which Kata's runtime reads first and which
// kata-fsx must never shadow.
var DefaultPaths = []string{
	"/etc/kata-containers/configuration-fsx.toml",
	"/usr/share/defaults/kata-containers/configuration-fsx.toml",
}

// QEMU is Kata's [hypervisor.qemu] table, restricted to the keys kata-fsx reads.
type QEMU struct {
	Path         string `toml:"path"`
	Kernel       string `toml:"kernel"`
	Image        string `toml:"image"`
	Initrd       string `toml:"initrd"`
	MachineType  string `toml:"machine_type"`
	KernelParams string `toml:"kernel_params"`
	// DefaultVCPUsRequested is default_vcpus as written: a float in Kata,
	// where 0 means one vCPU and a negative value or one above the host's
	// CPUs means all of them.
	DefaultVCPUsRequested float32 `toml:"default_vcpus"`
	// DefaultVCPUs is the vCPU count the VM gets: LoadFile resolves it from
	// DefaultVCPUsRequested by Kata's rule, rounding fractions up.
	DefaultVCPUs    int32  `toml:"-"`
	DefaultMemory   uint32 `toml:"default_memory"`
	EnableHugepages bool   `toml:"enable_hugepages"`
	// EnableMemPrealloc preallocates guest RAM when QEMU starts, as Kata's
	// key does, so a RAM file whose file system is full fails the boot
	// instead of a page fault later.
	EnableMemPrealloc bool `toml:"enable_mem_prealloc"`
	// FileMemBackend, when set, makes shared guest RAM a share=on file in
	// this directory, as in Kata; unset, it is a memfd (package host).
	FileMemBackend            string   `toml:"file_mem_backend"`
	EnableAnnotations         []string `toml:"enable_annotations"`
	SharedFS                  string   `toml:"shared_fs"`
	VirtioFSDaemon            string   `toml:"virtio_fs_daemon"`
	ValidVirtioFSDaemonPaths  []string `toml:"valid_virtio_fs_daemon_paths"`
	VirtioFSCacheSize         uint32   `toml:"virtio_fs_cache_size"`
	VirtioFSQueueSize         uint32   `toml:"virtio_fs_queue_size"`
	VirtioFSExtraArgs         []string `toml:"virtio_fs_extra_args"`
	VirtioFSCache             string   `toml:"virtio_fs_cache"`
	Msize9p                   uint32   `toml:"msize_9p"`
	BlockDeviceDriver         string   `toml:"block_device_driver"`
	DisableBlockDeviceUse     bool     `toml:"disable_block_device_use"`
	BlockDeviceCacheDirect    bool     `toml:"block_device_cache_direct"`
	BlockDeviceAIO            string   `toml:"block_device_aio"`
	EnableVhostUserStore      bool     `toml:"enable_vhost_user_store"`
	VhostUserStorePath        string   `toml:"vhost_user_store_path"`
	EnableDebug               bool     `toml:"enable_debug"`
	ValidHypervisorPaths      []string `toml:"valid_hypervisor_paths"`
	DisableVhostNet           bool     `toml:"disable_vhost_net"`
	EntropySource             string   `toml:"entropy_source"`
	DefaultBridges            uint32   `toml:"default_bridges"`
	MemorySlots               uint32   `toml:"memory_slots"`
	ValidVhostUserStorePaths  []string `toml:"valid_vhost_user_store_paths"`
	ValidFileMemBackends      []string `toml:"valid_file_mem_backends"`
	ValidEntropySources       []string `toml:"valid_entropy_sources"`
	DefaultMaxVCPUs           uint32   `toml:"default_maxvcpus"`
	DefaultMaxMemory          uint64   `toml:"default_maxmemory"`
	DisableImageNvdimm        bool     `toml:"disable_image_nvdimm"`
	StaticSandboxResourceMgmt bool     `toml:"static_sandbox_resource_mgmt"`
}

// Agent is Kata's [agent.kata] table.
type Agent struct {
	EnableDebug   bool     `toml:"enable_debug"`
	DialTimeout   uint32   `toml:"dial_timeout"` // seconds
	KernelModules []string `toml:"kernel_modules"`
}

// Runtime is Kata's [runtime] table.
type Runtime struct {
	EnableDebug bool `toml:"enable_debug"`
	// InterNetworkingModel is how the pod's network namespace reaches the
	// VM: "tcfilter" (Kata's default) or "none" (no NIC).
	InterNetworkingModel string `toml:"internetworking_model"`
	// StaticSandboxResourceMgmt sizes the VM at boot for its workload, as
	// Kata does: default_vcpus and default_memory plus the pod's CPU and
	// memory limits (CRI's sandbox annotations, or a lone container's
	// cgroup resources).
	StaticSandboxResourceMgmt bool `toml:"static_sandbox_resource_mgmt"`
	// DisableGuestSeccomp keeps the containers' seccomp profiles out of
	// the guest, as Kata does (its shipped file sets it; absent means false).
	DisableGuestSeccomp bool `toml:"disable_guest_seccomp"`
}

// ImagefsBlk is the [kata_fsx.imagefs_blk] table: the in-process block backend.
type ImagefsBlk struct {
	StateDir       string `toml:"state_dir"`
	WritableSizeMB uint64 `toml:"writable_size_mb"`
	BlockSize      uint32 `toml:"block_size"`
	NumQueues      uint32 `toml:"num_queues"`
	QueueSize      uint32 `toml:"queue_size"`
	Journal        bool   `toml:"journal"`
	JournalSizeMB  uint32 `toml:"journal_size_mb"`
	// Budgets that bound what a hostile image can make a build spend.
	MaxEntries       uint64 `toml:"max_entries"`         // entries of one layer and of the merged tree
	MaxLayerMB       uint64 `toml:"max_layer_mb"`        // one layer, uncompressed
	MaxMetadataMB    uint64 `toml:"max_metadata_mb"`     // synthesized ext4 metadata of one image
	MaxBuildMemoryMB uint64 `toml:"max_build_memory_mb"` // memory one image build holds, by its accounting
}

// Budgets returns the max_* keys in bytes (entries as a count), for the
// image build.
func (b ImagefsBlk) Budgets() (entries int, layerBytes, metadataBytes, buildMemory int64) {
	return int(b.MaxEntries), int64(b.MaxLayerMB) << 20, int64(b.MaxMetadataMB) << 20, int64(b.MaxBuildMemoryMB) << 20
}

// KataFSX is the [kata_fsx] table: everything Kata's own loader does not know.
type KataFSX struct {
	// SharedFS, when set, overrides hypervisor.qemu.shared_fs so that the
	// Kata table can keep a value Kata itself accepts.
	SharedFS       string      `toml:"shared_fs"`
	Accelerator    string      `toml:"accelerator"`
	AgentTransport string      `toml:"agent_transport"`
	StateDir       string      `toml:"state_dir"`
	ImagefsBlk     ImagefsBlk  `toml:"imagefs_blk"`
	Registry       Registry    `toml:"registry"`
	Snapshotter    Snapshotter `toml:"snapshotter"`
	Cache          Cache       `toml:"cache"`
}

type hypervisorTable struct {
	QEMU QEMU `toml:"qemu"`
}

type agentTable struct {
	Kata Agent `toml:"kata"`
}

// Config is a loaded configuration: Kata's tables plus ours.
type Config struct {
	Hypervisor hypervisorTable `toml:"hypervisor"`
	Agent      agentTable      `toml:"agent"`
	Runtime    Runtime         `toml:"runtime"`
	KataFSX    KataFSX         `toml:"kata_fsx"`

	// Path is the file the configuration was loaded from; DropIns lists the
	// config.d files merged over it, in order.
	Path    string   `toml:"-"`
	DropIns []string `toml:"-"`
	// Annotated records the pod annotations ApplyAnnotations used.
	Annotated map[string]string `toml:"-"`
	// Ignored lists the Kata keys set to change the VM in ways kata-fsx
	// does not implement; callers report them (check, the shim's log).
	Ignored []IgnoredKey `toml:"-"`
}

// QEMU returns the [hypervisor.qemu] table.
func (c *Config) QEMU() *QEMU { return &c.Hypervisor.QEMU }

// AgentKata returns the [agent.kata] table.
func (c *Config) AgentKata() *Agent { return &c.Agent.Kata }

// SharedFS returns the effective shared_fs: kata_fsx.shared_fs when set,
// otherwise hypervisor.qemu.shared_fs.
func (c *Config) SharedFS() string {
	if c.KataFSX.SharedFS != "" {
		return c.KataFSX.SharedFS
	}
	return c.Hypervisor.QEMU.SharedFS
}

// SharedFSKey names the key SharedFS came from, for error messages.
func (c *Config) SharedFSKey() string {
	if c.KataFSX.SharedFS != "" {
		return "kata_fsx.shared_fs"
	}
	return "hypervisor.qemu.shared_fs"
}

// Default returns the configuration Kata's loader would produce from an
// empty [hypervisor.qemu] table, plus kata-fsx's defaults.
func Default() *Config {
	return &Config{
		Hypervisor: hypervisorTable{QEMU: QEMU{
			Path:               "/usr/bin/qemu-system-x86_64",
			MachineType:        "q35",
			DefaultVCPUs:       1,
			DefaultMemory:      2048,
			SharedFS:           SharedFSVirtioFS,
			VirtioFSQueueSize:  1024,
			VirtioFSCache:      defaultVirtioFSCache,
			Msize9p:            8192,
			BlockDeviceDriver:  "virtio-scsi",
			BlockDeviceAIO:     "io_uring",
			DefaultBridges:     1,
			MemorySlots:        10,
			VhostUserStorePath: "/var/run/kata-containers/vhost-user",
		}},
		Agent:   agentTable{Kata: Agent{DialTimeout: 45}},
		Runtime: Runtime{InterNetworkingModel: "tcfilter"},
		KataFSX: KataFSX{
			Accelerator:    AccelAuto,
			AgentTransport: TransportAuto,
			StateDir:       "/run/kata-fsx",
			Registry:       DefaultRegistry(),
			Snapshotter:    DefaultSnapshotter(),
			Cache:          DefaultCache(),
			ImagefsBlk: ImagefsBlk{
				StateDir:       "/var/lib/kata-fsx/imagefs-blk",
				WritableSizeMB: 1024,
				BlockSize:      4096,
				NumQueues:      1,
				QueueSize:      256,
				Journal:        true,
				JournalSizeMB:  16,
				// Equal to blk/index's and blk/ext4's defaults.
				MaxEntries:       1 << 22,
				MaxLayerMB:       16 << 10,
				MaxMetadataMB:    4 << 10,
				MaxBuildMemoryMB: 1 << 10,
			},
		},
	}
}

// ErrNotFound is returned when no configuration file exists in any searched location.
var ErrNotFound = errors.New("no configuration file found")

// Locate returns the configuration file to load: explicit (a flag or
// containerd's ConfigPath option), then $KATA_FSX_CONF_FILE, then
// DefaultPaths, then the fallbacks (a development build's rendered file).
func Locate(explicit string, fallbacks ...string) (string, error) {
	if explicit != "" {
		return explicit, nil
	}
	if p := os.Getenv(EnvConfigFile); p != "" {
		return p, nil
	}
	searched := append(append([]string(nil), DefaultPaths...), fallbacks...)
	for _, p := range searched {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: looked at $%s and %s; pass --config or install one with 'make install'",
		ErrNotFound, EnvConfigFile, strings.Join(searched, ", "))
}

// DevPath is the configuration file 'make build' renders, found from the
// running binary in bin/, so a development tree works without 'make
// install'; both binaries pass it to Load as their last fallback.
func DevPath() string {
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	return filepath.Join(filepath.Dir(filepath.Dir(exe)), "build", "configuration.toml")
}

// Load locates and loads the configuration (see Locate), merging the
// config.d drop-ins beside it.
func Load(explicit string, fallbacks ...string) (*Config, error) {
	path, err := Locate(explicit, fallbacks...)
	if err != nil {
		return nil, err
	}
	return LoadFile(path)
}

// LoadFile loads path over the defaults, then every *.toml file of the
// config.d directory beside it in lexical order; each file overrides only
// the keys it sets. Zero values Kata reads as its defaults (default_vcpus,
// default_memory below 256, virtio_fs_cache, virtio_fs_queue_size) become
// those defaults, and default_vcpus is resolved to DefaultVCPUs.
func LoadFile(path string) (*Config, error) {
	cfg := Default()
	cfg.Path = path
	written := map[string]string{}
	md, err := decodeFile(path, cfg, written)
	if err != nil {
		return nil, err
	}
	if !md.IsDefined("hypervisor", "qemu") {
		return nil, &Error{Key: "hypervisor.qemu", Problem: fmt.Sprintf("%s has no [hypervisor.qemu] table", path),
			Fix: "kata-fsx runs QEMU only: use a configuration-qemu.toml"}
	}
	dropDir := filepath.Join(filepath.Dir(path), "config.d")
	entries, err := os.ReadDir(dropDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read drop-in directory %s: %w", dropDir, err)
	}
	var names []string
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".toml") {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	for _, n := range names {
		p := filepath.Join(dropDir, n)
		if _, err := decodeFile(p, cfg, written); err != nil {
			return nil, err
		}
		cfg.DropIns = append(cfg.DropIns, p)
	}
	q := cfg.QEMU()
	q.DefaultVCPUs = resolveVCPUs(q.DefaultVCPUsRequested, hostCPUs())
	cfg.applyKataDefaults()
	cfg.Ignored = ignoredKeys(written)
	return cfg, nil
}

// decodeFile decodes path over cfg and records in written the values of
// the Kata keys kata-fsx ignores.
func decodeFile(path string, cfg *Config, written map[string]string) (toml.MetaData, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return toml.MetaData{}, fmt.Errorf("read configuration: %w", err)
	}
	md, err := toml.Decode(string(data), cfg)
	if err != nil {
		var perr toml.ParseError
		if errors.As(err, &perr) {
			return md, fmt.Errorf("%s:%d: invalid TOML: %s (fix the syntax on that line)", path, perr.Position.Line, perr.Message)
		}
		return md, fmt.Errorf("%s: invalid TOML: %w", path, err)
	}
	collectWritten(string(data), written)
	// Kata ignores keys it does not know, so we must too in Kata's tables;
	// our own table is ours to police, which catches typos early.
	for _, k := range md.Undecoded() {
		if len(k) > 0 && k[0] == "kata_fsx" {
			return md, &Error{Key: k.String(), Problem: fmt.Sprintf("unknown key in %s", path),
				Fix: "remove it or check its spelling in docs/configuration.md"}
		}
	}
	return md, nil
}
