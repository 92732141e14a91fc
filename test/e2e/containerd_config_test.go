package e2e

import (
	"fmt"
	"runtime"
	"sort"
	"strings"
)

// criOptions are what a CRI test changes in the containerd its criEnv
// runs; the zero value is newCRIEnv's containerd.
type criOptions struct {
	// ProxySnapshotters are containerd proxy snapshotter plugins: name ->
	// the unix socket path their gRPC snapshots service listens on.
	ProxySnapshotters map[string]string
	// RuntimeSnapshotter is the snapshotter of both runtime handlers
	// (kata-fsx and runc): their containers' rootfs come from it, and CRI
	// pulls with it when the pull names the handler (1.7: the sandbox
	// config's io.containerd.cri.runtime-handler annotation; 2.x: the
	// ImageSpec's runtime_handler, or that annotation). containerd 1.7
	// and newer only (1.6 has no such key).
	RuntimeSnapshotter string
	// SnapshotAnnotations makes CRI pass its containerd.io/snapshot/cri.*
	// labels (image reference, layer digest, ...) to snapshotters, as
	// remote snapshotters need (containerd's default is not to).
	SnapshotAnnotations bool
	// Env is added to containerd's environment, which the shims it starts
	// inherit (KATA_FSX_* settings of the shim, say).
	Env []string
	// RegistryConfigPath is CRI's registry config_path: a certs.d
	// directory of hosts.toml files (a test registry's plain HTTP).
	RegistryConfigPath string
	// BeforeStart runs once the env and its kata-fsx configuration exist,
	// before containerd starts: what containerd must find running (a
	// proxy snapshotter, as systemd orders it before containerd).
	BeforeStart func(e *env)
	// KataConfig is extra TOML for the top of the kata-fsx configuration
	// the pods boot with (beside enable_annotations = ["shared_fs"]).
	KataConfig string
}

// containerdConfig is what a test's containerd runs with.
type containerdConfig struct {
	dir        string // root, state and (CRI) the opt and CNI directories live under it
	sock       string // containerd's gRPC socket
	kataConfig string // the kata-fsx runtime's ConfigPath
	// cri: the CRI env's containerd (runc the default runtime handler,
	// kata-fsx reached by name, a local pause image, an empty CNI
	// configuration) rather than ctr's (kata-fsx the default handler).
	cri  bool
	opts criOptions
}

// render writes c in the configuration format of containerd v: version 2
// for 1.x, version 3 (CRI split into the cri.v1 runtime and images
// plugins) for 2.x.
func (c containerdConfig) render(v containerdVersion) (string, error) {
	o := c.opts
	if o.RuntimeSnapshotter != "" && !v.AtLeast(1, 7) {
		return "", fmt.Errorf("a runtime handler's snapshotter needs containerd 1.7 or newer; %s is %s (%s)", containerdBin("containerd"), v, v.Full)
	}
	if !c.cri && (o.RuntimeSnapshotter != "" || o.SnapshotAnnotations) {
		return "", fmt.Errorf("runtime snapshotter and snapshot annotations are CRI settings; only newCRIEnvWith takes them")
	}
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	// Each format with the quoting of its version's documentation.
	q := `"`
	if v.Major >= 2 {
		q = `'`
	}
	str := func(s string) string { return q + s + q }
	version, runtimeTable := 2, `plugins."io.containerd.grpc.v1.cri"`
	if v.Major >= 2 {
		version, runtimeTable = 3, `plugins.'io.containerd.cri.v1.runtime'`
	}
	w("version = %d", version)
	w("root = %s", str(c.dir+"/root"))
	w("state = %s\n", str(c.dir+"/state"))
	w("[grpc]\n  address = %s\n", str(c.sock))
	w("[debug]\n  level = %s\n", str("debug"))
	names := make([]string, 0, len(o.ProxySnapshotters))
	for n := range o.ProxySnapshotters {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		w("[proxy_plugins.%s]\n  type = %s\n  address = %s\n", str(n), str("snapshot"), str(o.ProxySnapshotters[n]))
	}
	if v.Major >= 2 && len(names) > 0 {
		// 2.x's transfer service (ctr pull) unpacks only for the
		// snapshotters its unpack_config lists; the list replaces the
		// default overlayfs entry.
		for _, sn := range append([]string{"overlayfs"}, names...) {
			w("[[plugins.%s.unpack_config]]\n  platform = %s\n  snapshotter = %s\n  differ = %s\n",
				str("io.containerd.transfer.v1.local"), str("linux/"+runtime.GOARCH), str(sn), str("walking"))
		}
	}
	if c.cri {
		w("[plugins.%s]\n  path = %s", str("io.containerd.internal.v1.opt"), str(c.dir+"/opt"))
	}
	if v.Major >= 2 {
		// 2.x enables NRI by default, whose socket is one per host
		// (/var/run/nri/nri.sock): not for a test's containerd.
		w("[plugins.%s]\n  disable = true", str("io.containerd.nri.v1.nri"))
	}
	// The CRI server's stream server: a port of the kernel's choosing, as
	// tests run side by side. 1.x keeps every CRI setting in this table.
	w("[plugins.%s]", str("io.containerd.grpc.v1.cri"))
	if c.cri {
		w("  stream_server_address = %s", str("127.0.0.1"))
	}
	w("  stream_server_port = %s", str("0"))
	if v.Major < 2 && c.cri {
		w("  sandbox_image = %s", str(criPauseImage))
	}
	if c.cri {
		// AppArmor profiles would be loaded on the host for nothing:
		// the workload runs in the guest.
		if v.Major >= 2 {
			w("[%s]", runtimeTable)
		}
		w("  disable_apparmor = true")
		// A runc pod's pause gets oom_score_adj -998, which needs
		// CAP_SYS_RESOURCE: hosts (CI containers) without it must keep
		// containerd's own score as the floor.
		w("  restrict_oom_score_adj = true")
	}
	if v.Major >= 2 && c.cri {
		w("[plugins.'io.containerd.cri.v1.images']")
		if o.SnapshotAnnotations {
			w("  disable_snapshot_annotations = false")
		}
		w("[plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = %s", str(criPauseImage))
		// 2.x pulls and unpacks with the snapshotter of the images
		// plugin's runtime_platforms entry for the pull's runtime handler
		// (CRI's ImageSpec.runtime_handler, or the sandbox's
		// io.containerd.cri.runtime-handler annotation); the runtime
		// handler's own key is what the container's rootfs comes from.
		if o.RuntimeSnapshotter != "" {
			for _, h := range []string{"runc", criRuntime} {
				w("[plugins.'io.containerd.cri.v1.images'.runtime_platforms.%s]\n  snapshotter = %s", h, str(o.RuntimeSnapshotter))
			}
		}
	}
	if c.cri {
		binDir := "bin_dir = " + str(c.dir+"/cni/bin")
		if v.Major >= 2 {
			binDir = "bin_dirs = [" + str(c.dir+"/cni/bin") + "]"
		}
		w("[%s.cni]\n  %s\n  conf_dir = %s", runtimeTable, binDir, str(c.dir+"/cni/net.d"))
	}
	w("[%s.containerd]", runtimeTable)
	if !c.cri {
		w("  default_runtime_name = %s", str(criRuntime))
	}
	if o.SnapshotAnnotations && v.Major < 2 {
		w("  disable_snapshot_annotations = false")
	}
	if c.cri {
		// runc stays the default runtime handler, so a pod reaches
		// kata-fsx only through its runtime handler.
		w("[%s.containerd.runtimes.runc]\n  runtime_type = %s", runtimeTable, str("io.containerd.runc.v2"))
		if o.RuntimeSnapshotter != "" {
			w("  snapshotter = %s", str(o.RuntimeSnapshotter))
		}
	}
	w("[%s.containerd.runtimes.%s]\n  runtime_type = %s", runtimeTable, criRuntime, str("io.containerd.kata-fsx.v2"))
	if c.cri {
		// pod_annotations lets the per-pod shared_fs annotation through
		// to the sandbox's OCI spec.
		w("  pod_annotations = [%s]", str("io.katacontainers.*"))
	}
	if o.RuntimeSnapshotter != "" {
		w("  snapshotter = %s", str(o.RuntimeSnapshotter))
	}
	w("[%s.containerd.runtimes.%s.options]\n  ConfigPath = %s", runtimeTable, criRuntime, str(c.kataConfig))
	if o.RegistryConfigPath != "" {
		if !c.cri {
			return "", fmt.Errorf("a registry config_path is a CRI setting; only newCRIEnvWith takes it")
		}
		registryTable := `plugins."io.containerd.grpc.v1.cri".registry`
		if v.Major >= 2 {
			registryTable = `plugins.'io.containerd.cri.v1.images'.registry`
		}
		w("[%s]\n  config_path = %s", registryTable, str(o.RegistryConfigPath))
	}
	return b.String(), nil
}
