package critest

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// handler is one CRI runtime handler of the test's containerd; the
// kata-fsx ones differ only in the [kata_fsx] shared_fs of the
// configuration their ConfigPath names.
type handler struct {
	name     string
	sharedFS string // "" for runc
}

// handlers are the runtime handlers critest runs against: runc as the
// reference, kata-fsx on the default policy and one pinned to each
// filesystem backend.
var handlers = []handler{
	{name: "runc"},
	{name: "kata-fsx", sharedFS: "auto"},
	{name: "kata-fsx-virtiofs", sharedFS: "virtio-fs"},
	{name: "kata-fsx-imagefs-blk", sharedFS: "imagefs-blk"},
}

// world is the directory tree of one run: containerd's root, state and
// socket, the pods' kata-fsx state, the CNI and registry configuration.
// It is short (under /tmp) because a pod's sockets live under its state
// directory and a CRI pod id is 64 characters.
type world struct {
	dir string
}

func (w world) path(p ...string) string { return filepath.Join(append([]string{w.dir}, p...)...) }
func (w world) sock() string            { return w.path("containerd.sock") }
func (w world) stateDir() string        { return w.path("run") }

// kataConfig is the configuration.toml of a kata-fsx handler: the guest
// kit's kernel and initrd, the run's state directories, and the
// handler's backend.
func (w world) kataConfig(kit, accel, sharedFS string) string {
	return fmt.Sprintf(`[hypervisor.qemu]
path = "/usr/bin/qemu-system-x86_64"
kernel = %q
initrd = %q
default_memory = 512
virtio_fs_daemon = "/usr/lib/qemu/virtiofsd"
valid_virtio_fs_daemon_paths = ["/usr/lib/qemu/virtiofsd"]

[agent.kata]
dial_timeout = 120

[kata_fsx]
shared_fs = %q
accelerator = %q
state_dir = %q

[kata_fsx.imagefs_blk]
state_dir = %q
`, filepath.Join(kit, "vmlinux"), filepath.Join(kit, "initrd.img"), sharedFS, accel, w.stateDir(), w.path("blk"))
}

// containerdVersion is the major.minor of a containerd binary.
type containerdVersion struct {
	Major, Minor int
	Full         string
}

var versionRe = regexp.MustCompile(`\sv?(\d+)\.(\d+)\.\d+\S*`)

// probeVersion runs `containerd --version`.
func probeVersion(bin string) (containerdVersion, error) {
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return containerdVersion{}, fmt.Errorf("%s --version: %w", bin, err)
	}
	m := versionRe.FindStringSubmatch(" " + string(out))
	if m == nil {
		return containerdVersion{}, fmt.Errorf("no version in %q", out)
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	return containerdVersion{Major: major, Minor: minor, Full: strings.TrimSpace(m[0])}, nil
}

// containerdConfig renders the daemon's configuration for version v:
// format 2 (one CRI plugin table) for 1.x, 3 (runtime and images plugins)
// for 2.x; every handler in hs, the loopback mirrors, the run's CNI
// directories, the pinned sandbox image and a stream server on loopback.
func (w world) containerdConfig(v containerdVersion, hs []handler) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	q := strconv.Quote
	version, rt, images := 2, `plugins."io.containerd.grpc.v1.cri"`, `plugins."io.containerd.grpc.v1.cri"`
	if v.Major >= 2 {
		version, rt, images = 3, `plugins."io.containerd.cri.v1.runtime"`, `plugins."io.containerd.cri.v1.images"`
	}
	line("version = %d", version)
	line("root = %s\nstate = %s", q(w.path("root")), q(w.path("state")))
	line("[grpc]\n  address = %s", q(w.sock()))
	line(`[plugins."io.containerd.internal.v1.opt"]`+"\n  path = %s", q(w.path("opt")))
	if v.Major >= 2 {
		// NRI's socket is one per host; critest's NRI specs skip
		// without --nri-socket.
		line(`[plugins."io.containerd.nri.v1.nri"]` + "\n  disable = true")
	}
	line(`[plugins."io.containerd.grpc.v1.cri"]`)
	line("  stream_server_address = %s\n  stream_server_port = %s", q("127.0.0.1"), q("0"))
	if v.Major < 2 {
		line("  sandbox_image = %s", q(sandboxImage))
	}
	if v.Major >= 2 {
		line("[%s]", rt)
	}
	// The guest has no host AppArmor; runc pods get none either so the
	// columns compare the same settings. A runc pause's -998 needs
	// CAP_SYS_RESOURCE, which a CI container may lack.
	line("  disable_apparmor = true\n  restrict_oom_score_adj = true")
	if v.Major >= 2 {
		line("[%s]", images)
		line("[%s.pinned_images]\n  sandbox = %s", images, q(sandboxImage))
	}
	line("[%s.registry]\n  config_path = %s", images, q(w.path("certs.d")))
	binDir := "bin_dir = " + q(w.path("cni", "bin"))
	if v.Major >= 2 {
		binDir = "bin_dirs = [" + q(w.path("cni", "bin")) + "]"
	}
	line("[%s.cni]\n  %s\n  conf_dir = %s", rt, binDir, q(w.path("cni", "net.d")))
	line("[%s.containerd]\n  default_runtime_name = %s", rt, q("runc"))
	// runc is the default handler, which containerd 1.7 requires to be
	// configured, also in a run of the kata-fsx handlers alone.
	if !slices.ContainsFunc(hs, func(h handler) bool { return h.name == "runc" }) {
		line("[%s.containerd.runtimes.%s]\n  runtime_type = %s", rt, q("runc"), q("io.containerd.runc.v2"))
	}
	for _, h := range hs {
		if h.sharedFS == "" {
			line("[%s.containerd.runtimes.%s]\n  runtime_type = %s", rt, q(h.name), q("io.containerd.runc.v2"))
			continue
		}
		line("[%s.containerd.runtimes.%s]\n  runtime_type = %s\n  pod_annotations = [%s]", rt, q(h.name), q("io.containerd.kata-fsx.v2"), q("io.katacontainers.*"))
		line("[%s.containerd.runtimes.%s.options]\n  ConfigPath = %s", rt, q(h.name), q(w.path("configuration-"+h.name+".toml")))
	}
	return b.String()
}

// cniConfig is the run's CNI network: Debian's bridge plugin on a
// bridge and subnet of the run's own, no masquerading (nothing leaves
// the machine), and portmap for critest's host-port specs.
func (w world) cniConfig(bridge, subnet string) ([]byte, error) {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "kata-fsx-critest",
		"plugins": []any{
			map[string]any{
				"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false, "hairpinMode": true,
				"ipam": map[string]any{
					"type":    "host-local",
					"ranges":  []any{[]any{map[string]any{"subnet": subnet}}},
					"dataDir": w.path("cni", "ipam"),
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]any{"portMappings": true}},
		},
	}
	return json.MarshalIndent(conf, "", "  ")
}
