package e2e

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"
)

// setKataFSX adds a line to the [kata_fsx] table of the env's configuration.
func (e *env) setKataFSX(line string) {
	e.t.Helper()
	b, err := os.ReadFile(e.config)
	if err != nil {
		e.t.Fatal(err)
	}
	s := strings.Replace(string(b), "[kata_fsx]\n", "[kata_fsx]\n"+line+"\n", 1)
	if s == string(b) {
		e.t.Fatalf("%s has no [kata_fsx] table", e.config)
	}
	if err := os.WriteFile(e.config, []byte(s), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// envTransport is the agent transport `kata-fsx env --json` reports for
// the env's configuration, with its reason.
func (e *env) envTransport(ctx context.Context) (string, string) {
	e.t.Helper()
	r := e.run(ctx, "env", "--json")
	if r.code != 0 {
		e.t.Fatalf("kata-fsx env: exit %d %s", r.code, r.stderr)
	}
	var out struct {
		Agent struct{ Transport, TransportReason, TransportError string }
	}
	if err := json.Unmarshal([]byte(r.stdout), &out); err != nil {
		e.t.Fatalf("kata-fsx env --json: %v", err)
	}
	if out.Agent.TransportError != "" {
		e.t.Fatalf("kata-fsx env: the transport is refused here: %s", out.Agent.TransportError)
	}
	return out.Agent.Transport, out.Agent.TransportReason
}

// The guest's view of its agent channel: virtio-serial ports, and whether
// the virtio vsock driver has a device.
const guestChannels = `echo ports=$(ls /sys/class/virtio-ports | wc -l); ls /sys/bus/virtio/drivers/vmw_vsock_virtio_transport | grep -c virtio; true`

// TestRunAgentTransportAsEnvSays boots pods with agent_transport "auto"
// and "vsock" on both backends through `kata-fsx run`: the transport the
// sandbox logs is the one `kata-fsx env` reports for the same file, and
// the guest has a vsock device and no virtio-serial port. On a host
// without /dev/vhost-vsock both settings resolve to hybrid vsock. The
// virtio-serial fallback (for kata-fsx's own agent) is booted once as well.
func TestRunAgentTransportAsEnvSays(t *testing.T) {
	rootfs := busyboxRootfs(t)
	for _, setting := range []string{"auto", "vsock", "virtio-serial"} {
		for _, backend := range []string{"virtio-fs", "imagefs-blk"} {
			if setting == "virtio-serial" && backend == "imagefs-blk" {
				continue
			}
			t.Run(setting+"/"+backend, func(t *testing.T) {
				e := newEnv(t, "")
				e.setKataFSX(`agent_transport = "` + setting + `"`)
				ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
				defer cancel()
				want, why := e.envTransport(ctx)
				if _, err := os.Stat("/dev/vhost-vsock"); err != nil && setting != "virtio-serial" && want != "hybrid-vsock" {
					t.Fatalf("env: transport %q (%s), want hybrid-vsock on a host without /dev/vhost-vsock", want, why)
				}
				src := rootfs
				if backend == "imagefs-blk" {
					src = "dir:" + rootfs
				}
				r := e.run(ctx, "run", "--backend", backend, "--rootfs", src, "--", "/bin/sh", "-c", guestChannels)
				if r.code != 0 {
					t.Fatalf("run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
				}
				if !strings.Contains(r.stderr, "agent transport "+want+": "+strings.ReplaceAll(why, `"`, `\"`)) {
					t.Errorf("the sandbox did not log env's transport %q (%s):\n%s", want, why, r.stderr)
				}
				wantPorts, wantVsock := "ports=0", "1"
				if setting == "virtio-serial" {
					wantPorts, wantVsock = "ports=1", "0"
				}
				if got := strings.Fields(r.stdout); len(got) != 2 || got[0] != wantPorts || got[1] != wantVsock {
					t.Errorf("guest channels %q, want %s and %s vsock device", r.stdout, wantPorts, wantVsock)
				}
			})
		}
	}
}

// TestShimAgentTransportAsEnvSays: a pod through containerd with
// agent_transport = "vsock" reaches its agent over the transport env names.
func TestShimAgentTransportAsEnvSays(t *testing.T) {
	ce := newContainerdEnv(t)
	ce.setKataFSX(`agent_transport = "vsock"`)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	want, why := ce.envTransport(ctx)
	r := ce.ctr(ctx, ce.runArgs("--rm", "--annotation", "io.katacontainers.config.hypervisor.shared_fs=imagefs-blk", ce.image, "transport", "/bin/sh", "-c", guestChannels)...)
	if r.code != 0 {
		t.Fatalf("ctr run: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if got := strings.Fields(r.stdout); len(got) != 2 || got[0] != "ports=0" || got[1] != "1" {
		t.Errorf("guest channels %q, want no virtio-serial port and one vsock device", r.stdout)
	}
	if logs := ce.logTail(1 << 22); !strings.Contains(logs, "agent transport "+want+": ") {
		t.Errorf("the shim did not log env's transport %q (%s)", want, why)
	}
}
