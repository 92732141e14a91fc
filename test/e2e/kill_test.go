package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func syscallKill(pid int) { _ = syscall.Kill(pid, syscall.SIGKILL) }

// TestShimSIGTERMWithContainerdGone: a shim whose containerd is dead, sent
// SIGTERM, takes its pod down before it exits: within 10 s no QEMU, no
// virtiofsd, no mount below the sandbox directory or of the container's
// rootfs, and no sandbox directory are left.
func TestShimSIGTERMWithContainerdGone(t *testing.T) {
	for _, backend := range []string{"virtio-fs", "imagefs-blk"} {
		t.Run(backend, func(t *testing.T) {
			ce := newContainerdEnv(t)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			id := "sigterm-" + strings.ReplaceAll(backend, "-", "")
			ce.startLongRunning(ctx, t, id, backend)
			shimPid := ce.shimPid(t, id)
			sandboxDir := filepath.Join(ce.stateDir, id)
			bundle := filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id)
			if len(pidsOf(sandboxDir, "qemu-system")) != 1 {
				t.Fatalf("pod %s: no QEMU", id)
			}
			if err := ce.cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			ce.cmd.Process.Wait()
			if err := syscall.Kill(shimPid, syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			var left []string
			_ = testenv.Wait(10*time.Second, func() (bool, error) {
				left = nil
				if pids := processesMentioning(sandboxDir); len(pids) > 0 {
					left = append(left, fmt.Sprintf("processes %v", pids))
				}
				if syscall.Kill(shimPid, 0) == nil {
					left = append(left, fmt.Sprintf("shim %d", shimPid))
				}
				for _, dir := range []string{sandboxDir, bundle} {
					if m := sharedMounts(os.Getpid(), dir); len(m) > 0 {
						left = append(left, "mounts "+strings.Join(m, "; "))
					}
				}
				if _, err := os.Stat(sandboxDir); err == nil {
					left = append(left, "sandbox directory "+sandboxDir)
				}
				return len(left) == 0, nil
			})
			if len(left) > 0 {
				t.Fatalf("10 s after SIGTERM to the shim of a dead containerd, left: %s\ncontainerd log:\n%s", strings.Join(left, "\n"), ce.logTail(6000))
			}
		})
	}
}
