package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestCRIRuncBeside runs a pod on the runc runtime handler of the CRI
// containerd that also serves kata-fsx: workloads not on kata-fsx keep
// working, through the containerd-shim-runc-v2 of the containerd under
// test (KATA_FSX_CONTAINERD's build, else Debian's), on the host.
func TestCRIRuncBeside(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/runc"); err != nil {
		testenv.Missing(t, "/usr/sbin/runc missing (apt-get install runc): %v", err)
	}
	c := newCRIEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := c.podConfig("pod-runc", "")
	cfg.Annotations = nil
	// A host-network pod shares the host's UTS namespace: runc refuses a hostname.
	cfg.Hostname = ""
	if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
		t.Fatal(err)
	}
	r, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: "runc"})
	if err != nil {
		t.Fatalf("RunPodSandbox on runc: %v\n%s", err, c.logTail(4000))
	}
	pod := r.PodSandboxId
	defer func() {
		c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod})
		c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod})
	}()
	// The runc shim serving the pod is the one of the containerd under test.
	var shims []string
	for _, pid := range pidsOf(c.sock, "containerd-shim-runc-v2") {
		if exe, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "exe")); err == nil {
			shims = append(shims, exe)
		}
	}
	if len(shims) != 1 || shims[0] != containerdBin("containerd-shim-runc-v2") {
		t.Errorf("runc pod's shims %v, want one %s", shims, containerdBin("containerd-shim-runc-v2"))
	}
	if q := pidsOf(filepath.Join(c.stateDir, pod), "qemu-system"); len(q) != 0 {
		t.Errorf("the runc pod has a QEMU: %v", q)
	}
	cc := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "work"},
		Image:    &runtimeapi.ImageSpec{Image: criBusyboxImage},
		Command:  []string{"sh", "-c", "echo hello-runc; tr '\\0' ' ' < /proc/1/cmdline; echo"},
		LogPath:  "work.log",
		Linux: &runtimeapi.LinuxContainerConfig{
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNetwork()},
		},
	}
	cr, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: cc, SandboxConfig: cfg})
	if err != nil {
		t.Fatalf("CreateContainer on runc: %v", err)
	}
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
		t.Fatalf("StartContainer on runc: %v", err)
	}
	for {
		st, err := c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: cr.ContainerId})
		if err != nil {
			t.Fatal(err)
		}
		if st.Status.State == runtimeapi.ContainerState_CONTAINER_EXITED {
			if st.Status.ExitCode != 0 {
				t.Errorf("runc workload exited %d", st.Status.ExitCode)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("runc workload still %v", st.Status.State)
		}
		time.Sleep(100 * time.Millisecond)
	}
	data, err := os.ReadFile(filepath.Join(cfg.LogDirectory, cc.LogPath))
	if err != nil {
		t.Fatal(err)
	}
	stdout, _, err := parseCRILog(data)
	if err != nil {
		t.Fatal(err)
	}
	// PID 1 of the pod's PID namespace is its pause (the test image's
	// /pause execs sleep), on the host, not a guest's init.
	if stdout != "hello-runc\nsleep inf \n" {
		t.Errorf("runc workload log %q, want hello-runc and the pod's pause (sleep inf) as PID 1", stdout)
	}
}
