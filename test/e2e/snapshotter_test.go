package e2e

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// snapshotterProc is a running `kata-fsx snapshotter`.
type snapshotterProc struct {
	t      *testing.T
	args   []string
	cmd    *exec.Cmd
	log    *bytes.Buffer
	logMu  *sync.Mutex
	exited chan struct{}
}

func startSnapshotter(t *testing.T, cfg, sock, root string) *snapshotterProc {
	t.Helper()
	p := &snapshotterProc{t: t, args: []string{"snapshotter", "--config", cfg, "--address", sock, "--root", root},
		log: &bytes.Buffer{}, logMu: &sync.Mutex{}}
	p.start()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("snapshotter log:\n%s", p.logText())
		}
	})
	return p
}

func (p *snapshotterProc) start() {
	t := p.t
	t.Helper()
	sock := p.args[4]
	// A snapshotter that was killed leaves its socket, which would pass
	// the wait below before the new one listens.
	if err := os.Remove(sock); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	cmd := exec.Command(kataFSX(t), p.args...)
	cmd.Stdout = lockedWriter{p.logMu, p.log}
	cmd.Stderr = lockedWriter{p.logMu, p.log}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	go func(c chan struct{}) { cmd.Wait(); close(c) }(p.exited)
	deadline := time.Now().Add(time.Minute)
	for {
		if _, err := os.Stat(sock); err == nil {
			return
		}
		select {
		case <-p.exited:
			t.Fatalf("kata-fsx snapshotter exited:\n%s", p.logText())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("kata-fsx snapshotter never served %s:\n%s", sock, p.logText())
		}
	}
}

// snapshotterSocket is a path for a snapshotter's socket in a directory
// of its own under /tmp, removed with the test: a test's own directory is
// too deep for sun_path's 107 bytes.
func snapshotterSocket(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "ks")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "snap.sock")
}

// stop ends the snapshotter with SIGTERM, as systemd would.
func (p *snapshotterProc) stop() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.t.Errorf("kata-fsx snapshotter ignored SIGTERM for 30s")
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
	p.cmd = nil
}

func (p *snapshotterProc) logText() string {
	p.logMu.Lock()
	defer p.logMu.Unlock()
	return p.log.String()
}

// allocated is the disk space the files under dir take (sparse files
// count what they hold).
func allocated(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Sys().(*syscall.Stat_t).Blocks * 512
		}
		return nil
	})
	return n
}

// TestSnapshotterCRI is the lazy CRI pull: a private containerd with the
// kata-fsx proxy snapshotter as the snapshotter of the kata-fsx and runc
// runtime handlers. A CRI pull of a 68 MB image from a loopback registry
// returns having fetched a small fraction of it; a kata-fsx pod on
// imagefs-blk reads its files lazily and correctly; a runc pod of the same
// image gets its layers materialized and reads the same bytes; the
// snapshotter restarts under running pods, which keep running, and a new
// pod starts after it.
func TestSnapshotterCRI(t *testing.T) {
	if v := containerdUnderTest(t); !v.AtLeast(1, 7) {
		// Not a missing tool: 1.6 has no per-runtime-handler snapshotter.
		// make test runs this test against 1.7.35 and 2.2.9 (CONTAINERD_E2E).
		t.Skipf("containerd %s has no per-runtime-handler snapshotter (1.7 or newer)", v)
	}
	if _, err := buildOverlayHelper(); err != nil {
		t.Fatal(err)
	}
	img := pushLazyImage(t)
	ref := strings.TrimPrefix(img.ref, "registry:")

	snapSock := snapshotterSocket(t)
	var snap *snapshotterProc
	c := newCRIEnvWith(t, criOptions{
		ProxySnapshotters:   map[string]string{"kata-fsx": snapSock},
		RuntimeSnapshotter:  "kata-fsx",
		SnapshotAnnotations: true,
		RegistryConfigPath:  img.reg.HostsDir(t, ""),
		BeforeStart: func(e *env) {
			// The shim and the snapshotter read one configuration, as on
			// a node: one registry access and one node store. The test
			// images CRI unpacks (the pause image, imported) name the
			// host kata-fsx.test: the snapshotter's look for their index
			// must end on loopback, not in a DNS query.
			hosts := img.reg.HostsDir(t, "")
			if err := os.MkdirAll(filepath.Join(hosts, "kata-fsx.test"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(hosts, "kata-fsx.test", "hosts.toml"), []byte("server = \"http://127.0.0.1:9\"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(e.config, os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(f, "\n[kata_fsx.registry]\nconfig_path = %q\n", hosts)
			f.Close()
			// Before containerd, as its systemd unit orders it.
			snap = startSnapshotter(t, e.config, snapSock, filepath.Join(e.dir, "snapshotter"))
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	if r := c.env.imageIndex(ctx, img.ref); r.code != 0 {
		t.Fatalf("kata-fsx image index: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}

	// A second, small image for a kata-fsx pod on virtio-fs, whose remote
	// layers the shim itself materializes (layerdir.Mount).
	small := t.TempDir()
	if err := os.MkdirAll(filepath.Join(small, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	smallData := bytes.Repeat([]byte("virtio-fs reads a materialized layer\n"), 1<<16)
	if err := os.WriteFile(filepath.Join(small, "data", "small"), smallData, 0o644); err != nil {
		t.Fatal(err)
	}
	smallOCI := t.TempDir()
	registrytest.WriteOCI(t, smallOCI, "v1", registrytest.TarDir(t, busyboxRootfs(t)), registrytest.TarDir(t, small))
	img.reg.Push(t, smallOCI, "v1", "lazy/small:v1")
	smallRef := img.reg.Addr + "/lazy/small:v1"
	if r := c.env.imageIndex(ctx, "registry:"+smallRef); r.code != 0 {
		t.Fatalf("kata-fsx image index %s: exit %d\n%s\n%s", smallRef, r.code, r.stdout, r.stderr)
	}

	storeDir := filepath.Join(blkStateDir(t, c.config), "content")
	podCfg := func(name, handler, backend string) *runtimeapi.PodSandboxConfig {
		cfg := c.podConfig(name, backend)
		if handler != criRuntime {
			// runc sets no hostname in the host's UTS namespace.
			cfg.Annotations, cfg.Hostname = nil, ""
		}
		cfg.Annotations = mergeMaps(cfg.Annotations, map[string]string{"io.containerd.cri.runtime-handler": handler})
		if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
			t.Fatal(err)
		}
		return cfg
	}

	// crictl pull, for the kata-fsx runtime handler (its pod config names
	// the handler, as the kubelet's pull does).
	pc := podCfg("pull", criRuntime, "imagefs-blk")
	pcFile := filepath.Join(t.TempDir(), "pod.json")
	b, _ := json.Marshal(map[string]any{"metadata": map[string]string{"name": "pull", "namespace": "kata-fsx-e2e", "uid": "pull-uid"},
		"annotations": pc.Annotations})
	if err := os.WriteFile(pcFile, b, 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if out, err := c.crictlRun(ctx, t, "pull", "--pod-config", pcFile, ref); err != nil {
		t.Fatalf("crictl pull %s: %v\n%s\n%s", ref, err, out, snap.logText())
	}
	fetched := allocated(t, storeDir)
	var imageBytes int64 = 0
	st, err := c.img.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil || st.Image == nil {
		t.Fatalf("ImageStatus %s after the pull: %v %v", ref, st, err)
	}
	imageBytes = int64(st.Image.Size)
	t.Logf("crictl pull: %.1fs; kata-fsx's node store holds %d bytes of the image's %d (%.1f%%)", time.Since(start).Seconds(), fetched, imageBytes, 100*float64(fetched)/float64(imageBytes))
	if !strings.Contains(snap.logText(), "layer "+img.layer.String()+" of ") || !strings.Contains(snap.logText(), ": remote (index ") {
		t.Errorf("the snapshotter never logged the big layer %s as remote:\n%s", img.layer, snap.logText())
	}
	if fetched > imageBytes/10 {
		t.Errorf("the pull fetched %d bytes of %d, want under 10%%", fetched, imageBytes)
	}
	// containerd downloaded none of the layer blobs.
	if out, err := c.ctrK8s(ctx, "content", "ls"); err != nil {
		t.Fatal(err)
	} else {
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 0 && f[0] == img.layer.String() {
				t.Errorf("containerd's content store holds the big layer %s: it was downloaded\n%s", img.layer, out)
			}
		}
	}

	runPod := func(name, handler, backend string) (*runtimeapi.PodSandboxConfig, string) {
		cfg := podCfg(name, handler, backend)
		r, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: handler})
		if err != nil {
			t.Fatalf("RunPodSandbox %s: %v", name, err)
		}
		if handler == criRuntime {
			if err := c.trackShim(r.PodSandboxId); err != nil {
				t.Fatal(err)
			}
		}
		return cfg, r.PodSandboxId
	}
	startCtr := func(pod string, cfg *runtimeapi.PodSandboxConfig) string {
		cc := &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
			Image:    &runtimeapi.ImageSpec{Image: ref},
			Command:  []string{"sh", "-c", "echo ready; sleep 900"},
			LogPath:  "work.log",
			Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()}},
		}
		cr, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: cc, SandboxConfig: cfg})
		if err != nil {
			t.Fatalf("CreateContainer in %s: %v\n%s", cfg.Metadata.Name, err, snap.logText())
		}
		if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
			t.Fatalf("StartContainer in %s: %v", cfg.Metadata.Name, err)
		}
		return cr.ContainerId
	}
	checkFiles := func(what, id string) {
		t.Helper()
		ex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Timeout: 300, Cmd: []string{"sh", "-c", "md5sum /data/big*; grep ' / ' /proc/mounts"}})
		if err != nil {
			t.Fatalf("%s: ExecSync md5sum: %v", what, err)
		}
		if n := img.checkMD5s(t, string(ex.Stdout)); ex.ExitCode != 0 || n != lazyBigFiles {
			t.Errorf("%s: md5sum exit %d, %d files checked of %d: %s %s", what, ex.ExitCode, n, lazyBigFiles, ex.Stdout, ex.Stderr)
		}
		t.Logf("%s: %s", what, strings.TrimSpace(string(ex.Stdout)))
	}

	// A kata-fsx pod on imagefs-blk, served from the lazy store.
	// The kata-fsx pod through crictl's runp, create and start, as an
	// operator would start it by hand.
	kataCfg := podCfg("snap-kata", criRuntime, "imagefs-blk")
	kataCC := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
		Image:    &runtimeapi.ImageSpec{Image: ref},
		Command:  []string{"sh", "-c", "echo ready; sleep 900"},
		LogPath:  "work.log",
		Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()}},
	}
	writeJSON := func(name string, v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	podJSON, ctrJSON := writeJSON("pod.json", kataCfg), writeJSON("container.json", kataCC)
	crictlID := func(args ...string) string {
		t.Helper()
		out, err := c.crictlRun(ctx, t, args...)
		if err != nil {
			t.Fatalf("crictl %s: %v\n%s\n%s", strings.Join(args, " "), err, out, snap.logText())
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		return strings.TrimSpace(lines[len(lines)-1])
	}
	kataPod := crictlID("runp", "--runtime", criRuntime, podJSON)
	if err := c.trackShim(kataPod); err != nil {
		t.Fatal(err)
	}
	kataCtr := crictlID("create", kataPod, ctrJSON, podJSON)
	crictlID("start", kataCtr)
	// Running, and still only a small part of the image on the node:
	// containerd's own look into the rootfs (the user's groups) got
	// skeletons, and the pod reads through the lazy store.
	ex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: kataCtr, Timeout: 120, Cmd: []string{"grep", " / ", "/proc/mounts"}})
	if err != nil || ex.ExitCode != 0 {
		t.Fatalf("kata-fsx pod: grep / /proc/mounts: %v %v", ex, err)
	}
	if fs := rootFstype(string(ex.Stdout)); fs != "ext4" {
		t.Errorf("kata-fsx pod: / is %q, want ext4 (imagefs-blk)", fs)
	}
	if held := allocated(t, storeDir); held > imageBytes/10 {
		t.Errorf("the kata-fsx pod runs with %d bytes of the image's %d on the node, want under 10%%", held, imageBytes)
	} else {
		t.Logf("kata-fsx pod running: the node store holds %d bytes of the image's %d (%.1f%%)", held, imageBytes, 100*float64(held)/float64(imageBytes))
	}
	checkFiles("kata-fsx pod", kataCtr)
	if logs := c.logTail(1 << 24); !strings.Contains(logs, "read lazily on imagefs-blk") {
		t.Errorf("the shim did not serve the pod's remote layers lazily")
	}

	// ctr snapshot usage: the remote layers count the store's blocks.
	if out, err := c.ctrK8s(ctx, "snapshot", "--snapshotter", "kata-fsx", "usage"); err != nil {
		t.Errorf("ctr snapshot usage: %v\n%s", err, out)
	} else {
		t.Logf("ctr snapshot usage:\n%s", out)
	}

	// A kata-fsx pod on virtio-fs: the shim materializes the remote layers
	// and shares the overlay.
	if out, err := c.crictlRun(ctx, t, "pull", "--pod-config", pcFile, smallRef); err != nil {
		t.Fatalf("crictl pull %s: %v\n%s", smallRef, err, out)
	}
	vfsCfg, vfsPod := runPod("snap-virtiofs", criRuntime, "virtio-fs")
	vfsCC := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
		Image:    &runtimeapi.ImageSpec{Image: smallRef},
		Command:  []string{"sh", "-c", "sleep 900"},
		LogPath:  "work.log",
		Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()}},
	}
	vcr, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: vfsPod, Config: vfsCC, SandboxConfig: vfsCfg})
	if err != nil {
		t.Fatalf("CreateContainer on virtio-fs: %v", err)
	}
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: vcr.ContainerId}); err != nil {
		t.Fatalf("StartContainer on virtio-fs: %v", err)
	}
	vex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: vcr.ContainerId, Timeout: 120, Cmd: []string{"sh", "-c", "md5sum /data/small; grep ' / ' /proc/mounts"}})
	if err != nil {
		t.Fatalf("virtio-fs pod: ExecSync: %v", err)
	}
	if want := fmt.Sprintf("%x  /data/small", md5.Sum(smallData)); vex.ExitCode != 0 || !strings.Contains(string(vex.Stdout), want) || rootFstype(string(vex.Stdout)) != "virtiofs" {
		t.Errorf("virtio-fs pod: exit %d %q %q; want %q on a virtiofs /", vex.ExitCode, vex.Stdout, vex.Stderr, want)
	}

	// A runc pod of the same image on the same node and snapshotter: its
	// layers are materialized on demand by the mount helper.
	runcCfg, runcPod := runPod("snap-runc", "runc", "")
	runcCtr := startCtr(runcPod, runcCfg)
	checkFiles("runc pod", runcCtr)

	// Plain ctr: a pull without CRI's labels (in a namespace of its own, so
	// containerd asks for every layer again) is an ordinary download and
	// unpack into the snapshotter, and runc runs the image from it.
	ctrPlain := func(args ...string) string {
		t.Helper()
		out, err := exec.CommandContext(ctx, containerdBin("ctr"), append([]string{"-a", c.sock, "-n", "plain"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ctr -n plain %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	ctrPlain("images", "pull", "--plain-http", "--hosts-dir", img.reg.HostsDir(t, ""), "--snapshotter", "kata-fsx", smallRef)
	if out := ctrPlain("run", "--rm", "--snapshotter", "kata-fsx", smallRef, "plain-ctr", "md5sum", "/data/small"); !strings.Contains(out, fmt.Sprintf("%x  /data/small", md5.Sum(smallData))) {
		t.Errorf("ctr run of the plainly pulled image: %q", out)
	}
	if out := ctrPlain("snapshot", "--snapshotter", "kata-fsx", "ls"); !strings.Contains(out, "Committed") {
		t.Errorf("ctr snapshot ls in the plain namespace shows no committed layer:\n%s", out)
	}
	ctrPlain("images", "rm", "--sync", smallRef)

	// Restart the snapshotter under the running pods.
	snap.stop()
	snap.start()
	checkFiles("kata-fsx pod after the snapshotter's restart", kataCtr)
	checkFiles("runc pod after the snapshotter's restart", runcCtr)
	newCfg, newPod := runPod("snap-new", criRuntime, "imagefs-blk")
	newCtr := startCtr(newPod, newCfg)
	checkFiles("a pod started after the restart", newCtr)

	for _, p := range []string{kataPod, vfsPod, runcPod, newPod} {
		if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p}); err != nil {
			t.Fatalf("StopPodSandbox: %v", err)
		}
		if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p}); err != nil {
			t.Fatalf("RemovePodSandbox: %v", err)
		}
	}

	// Removing the image lets containerd's garbage collection remove its
	// snapshots, and the last snapshot of a layer releases the layer's
	// files in the node store.
	layerData := filepath.Join(storeDir, "layers", img.layer.Encoded()+".data")
	if _, err := os.Stat(layerData); err != nil {
		t.Fatalf("the big layer's node store file: %v", err)
	}
	if out, err := c.crictlRun(ctx, t, "rmi", ref); err != nil {
		t.Fatalf("crictl rmi: %v\n%s", err, out)
	}
	testenv.Eventually(t, time.Minute, func() (bool, error) {
		_, err := os.Stat(layerData)
		return os.IsNotExist(err), fmt.Errorf("%s still there after crictl rmi:\n%s", layerData, snap.logText())
	})
	if !strings.Contains(snap.logText(), "the last snapshot of layer "+img.layer.String()+": its store files released") {
		t.Errorf("the snapshotter did not log releasing the big layer's store files:\n%s", snap.logText())
	}
}

func mergeMaps(a, b map[string]string) map[string]string {
	m := map[string]string{}
	for k, v := range a {
		m[k] = v
	}
	for k, v := range b {
		m[k] = v
	}
	return m
}

// blkStateDir is the [kata_fsx.imagefs_blk] state_dir a test config names.
func blkStateDir(t *testing.T, cfg string) string {
	t.Helper()
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\[kata_fsx\.imagefs_blk\]\s*\nstate_dir = "([^"]+)"`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s names no [kata_fsx.imagefs_blk] state_dir", cfg)
	}
	return string(m[1])
}
