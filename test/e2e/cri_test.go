package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// criPod is one pod of TestCRIPods and what its guest must show.
type criPod struct {
	name, backend, fstype string
	id                    string
	cfg                   *runtimeapi.PodSandboxConfig
}

func hostNetwork() *runtimeapi.NamespaceOption {
	return &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE}
}

func (c *criEnv) podConfig(name, backend string) *runtimeapi.PodSandboxConfig {
	return &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Uid: name + "-uid", Namespace: "kata-fsx-e2e"},
		Hostname:     name,
		LogDirectory: filepath.Join(c.logDir, name),
		Annotations:  map[string]string{"io.katacontainers.config.hypervisor.shared_fs": backend},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: hostNetwork()},
		},
	}
}

// TestCRIPods drives kata-fsx the way the kubelet does, through the CRI of
// containerd: two pods at the same time, one per backend picked by the
// pod's shared_fs annotation, each with a workload container whose log,
// exec and mounts are checked, then stopped and removed without leftovers.
func TestCRIPods(t *testing.T) {
	c := newCRIEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	v, err := c.rt.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("CRI: %s %s, API %s", v.RuntimeName, v.RuntimeVersion, v.RuntimeApiVersion)

	pods := []*criPod{
		{name: "pod-virtiofs", backend: "virtio-fs", fstype: "virtiofs"},
		{name: "pod-imagefsblk", backend: "imagefs-blk", fstype: "ext4"},
	}
	// Both pods boot at once: the runtime handler must give each its own
	// shim and VM.
	var wg sync.WaitGroup
	errs := make([]error, len(pods))
	for i, p := range pods {
		p.cfg = c.podConfig(p.name, p.backend)
		if err := os.MkdirAll(p.cfg.LogDirectory, 0o755); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: p.cfg, RuntimeHandler: criRuntime})
			if err != nil {
				errs[i] = fmt.Errorf("RunPodSandbox %s: %w", p.name, err)
				return
			}
			p.id = r.PodSandboxId
			errs[i] = c.trackShim(p.id)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}

	logs := c.logTail(1 << 24)
	for _, p := range pods {
		st, err := c.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: p.id})
		if err != nil {
			t.Fatalf("PodSandboxStatus %s: %v", p.name, err)
		}
		if st.Status.State != runtimeapi.PodSandboxState_SANDBOX_READY || st.Status.RuntimeHandler != criRuntime {
			t.Fatalf("pod %s: state %v handler %q, want SANDBOX_READY on %q", p.name, st.Status.State, st.Status.RuntimeHandler, criRuntime)
		}
		if q := pidsOf(filepath.Join(c.stateDir, p.id), "qemu-system"); len(q) != 1 {
			t.Fatalf("pod %s: want one QEMU of its own, found %v", p.name, q)
		}
		// The annotation reached the sandbox's OCI spec only through the
		// runtime's pod_annotations, and the shim chose the backend from it.
		want := fmt.Sprintf(`sandbox %s: config %s; backend %s: annotation io.katacontainers.config.hypervisor.shared_fs = \"%s\"`,
			p.id, c.config, p.backend, p.backend)
		if !strings.Contains(logs, want) {
			t.Errorf("pod %s: the shim did not log %q", p.name, want)
		}
	}
	if q := pidsOf(c.stateDir, "qemu-system"); len(q) != 2 {
		t.Fatalf("want the two pods' QEMUs running side by side, found %v", q)
	}

	for _, p := range pods {
		t.Run(p.backend, func(t *testing.T) { c.workload(ctx, t, p) })
	}

	for _, p := range pods {
		if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.id}); err != nil {
			t.Fatalf("StopPodSandbox %s: %v", p.name, err)
		}
		st, err := c.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: p.id})
		if err != nil {
			t.Fatalf("PodSandboxStatus %s: %v", p.name, err)
		}
		if st.Status.State != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
			t.Errorf("pod %s after stop: %v, want SANDBOX_NOTREADY", p.name, st.Status.State)
		}
		cs, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: p.id}})
		if err != nil {
			t.Fatal(err)
		}
		for _, ctr := range cs.Containers {
			if ctr.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
				t.Errorf("pod %s: container %s still running after StopPodSandbox", p.name, ctr.Metadata.Name)
			}
		}
		if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.id}); err != nil {
			t.Fatalf("RemovePodSandbox %s: %v", p.name, err)
		}
	}
	if l, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err != nil || len(l.Items) != 0 {
		t.Errorf("pods listed after their removal: %v (%v)", l, err)
	}
	if l, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{}); err != nil || len(l.Containers) != 0 {
		t.Errorf("containers listed after their pods' removal: %v (%v)", l, err)
	}
	// The shims exit on their own once their pod's last task is deleted.
	if left := lingering(ctx, c.sock); len(left) > 0 {
		t.Errorf("shim, QEMU or virtiofsd still running after RemovePodSandbox: %v", left)
	}
}

// workload runs the pod's workload container: its log must show the
// guest's root filesystem of the pod's backend, and ExecSync must work.
func (c *criEnv) workload(ctx context.Context, t *testing.T, p *criPod) {
	cfg := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
		Image:    &runtimeapi.ImageSpec{Image: criBusyboxImage},
		Command:  []string{"sh", "-c", `echo hello-cri; grep " / " /proc/mounts; sleep 600`},
		LogPath:  "work.log",
		Linux: &runtimeapi.LinuxContainerConfig{
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()},
		},
	}
	cr, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: p.id, Config: cfg, SandboxConfig: p.cfg})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	id := cr.ContainerId
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id}); err != nil {
		t.Fatalf("StartContainer (%s): %v", p.backend, err)
	}

	logPath := filepath.Join(p.cfg.LogDirectory, cfg.LogPath)
	var stdout string
	for rootFstype(stdout) == "" {
		data, err := os.ReadFile(logPath)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if stdout, _, err = parseCRILog(data); err != nil {
			t.Fatalf("%s: %v", logPath, err)
		}
		if ctx.Err() != nil {
			t.Fatalf("the workload never logged its root mount to %s; log so far:\n%s", logPath, data)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("%s:\n%s", logPath, stdout)
	if !strings.HasPrefix(stdout, "hello-cri\n") {
		t.Errorf("workload log %q does not start with hello-cri", stdout)
	}
	if got := rootFstype(stdout); got != p.fstype {
		t.Errorf("guest / is %q, want %q for %s", got, p.fstype, p.backend)
	}
	if !strings.Contains(c.logTail(1<<24), fmt.Sprintf("container %s joins pod %s (backend %s)", id, p.id, p.backend)) {
		t.Errorf("workload %s was not served by pod %s's shim and VM", id, p.id)
	}
	st, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
	if err != nil {
		t.Fatal(err)
	}
	if st.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		t.Errorf("workload state %v, want CONTAINER_RUNNING", st.Status.State)
	}

	ex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Timeout: 120,
		Cmd: []string{"sh", "-c", `echo exec-out; echo exec-err >&2; grep " / " /proc/mounts; exit 7`}})
	if err != nil {
		t.Fatalf("ExecSync: %v", err)
	}
	if ex.ExitCode != 7 || !strings.HasPrefix(string(ex.Stdout), "exec-out\n") || string(ex.Stderr) != "exec-err\n" {
		t.Errorf("ExecSync: exit %d stdout %q stderr %q; want 7, exec-out..., exec-err", ex.ExitCode, ex.Stdout, ex.Stderr)
	}
	if got := rootFstype(string(ex.Stdout)); got != p.fstype {
		t.Errorf("exec sees / as %q, want %q", got, p.fstype)
	}
	// CRI's /etc/hosts, /etc/resolv.conf and /etc/hostname are host files
	// bound into the container: the guest must show what CRI wrote.
	t.Run("cri-files", func(t *testing.T) {
		b, err := os.ReadFile(filepath.Join(c.dir, "state", "io.containerd.runtime.v2.task", criNamespace, id, "config.json"))
		if err != nil {
			t.Fatal(err)
		}
		var spec struct {
			Mounts []struct{ Destination, Source string }
		}
		if err := json.Unmarshal(b, &spec); err != nil {
			t.Fatal(err)
		}
		for _, dst := range []string{"/etc/hosts", "/etc/resolv.conf", "/etc/hostname"} {
			src := ""
			for _, m := range spec.Mounts {
				if m.Destination == dst {
					src = m.Source
				}
			}
			if src == "" {
				t.Errorf("CRI bound no %s into the workload", dst)
				continue
			}
			want, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			ex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Timeout: 120, Cmd: []string{"cat", dst}})
			if err != nil {
				t.Fatalf("ExecSync cat %s: %v", dst, err)
			}
			if ex.ExitCode != 0 || string(ex.Stdout) != string(want) || len(want) == 0 {
				t.Errorf("%s in the workload: exit %d %q %s, want CRI's %s: %q", dst, ex.ExitCode, ex.Stdout, ex.Stderr, src, want)
			}
		}
	})
	// What the kubelet's pods expect of their container beyond the rootfs.
	t.Run("environment", func(t *testing.T) {
		for _, check := range []struct{ what, cmd string }{
			{"the pod's hostname", `test "$(hostname)" = ` + p.cfg.Hostname},
			{"/dev/null, a character device", "test -c /dev/null && echo x > /dev/null"},
			{"/dev/shm, a writable directory", "test -d /dev/shm && touch /dev/shm/x"},
		} {
			ex, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Timeout: 120, Cmd: []string{"sh", "-c", check.cmd}})
			if err != nil {
				t.Fatalf("ExecSync %q: %v", check.cmd, err)
			}
			if ex.ExitCode != 0 {
				t.Errorf("the workload has no %s: %q exits %d %s", check.what, check.cmd, ex.ExitCode, ex.Stderr)
			}
		}
	})
}

func TestParseCRILog(t *testing.T) {
	in := "2026-11-29T21:50:01.123456789Z stdout F hello\n" +
		"2026-11-29T21:50:01.2Z stdout P par\n" +
		"2026-11-29T21:50:01.3Z stderr F oops\n" +
		"2026-11-29T21:50:01.4Z stdout F tial\n" +
		"2026-11-29T21:50:01.5Z stdout F \n"
	out, errOut, err := parseCRILog([]byte(in))
	if err != nil || out != "hello\npartial\n\n" || errOut != "oops\n" {
		t.Fatalf("parseCRILog: %q %q %v", out, errOut, err)
	}
	for _, bad := range []string{"hello\n", "2026-11-29T21:50:01Z stdin F x\n", "yesterday stdout F x\n", "2026-11-29T21:50:01Z stdout X x\n"} {
		if _, _, err := parseCRILog([]byte(bad)); err == nil {
			t.Errorf("parseCRILog(%q) accepted a malformed line", bad)
		}
	}
}
