package e2e

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestShimRefusesDaemonLooseningAnnotation: with virtio_fs_extra_args
// enabled, as in the shipped configuration, a pod asking virtiofsd to drop
// its sandbox or seccomp filter, or to serve / , fails Create through
// containerd with an error naming the argument, no virtiofsd ever runs
// with it, and the shim leaves nothing behind.
func TestShimRefusesDaemonLooseningAnnotation(t *testing.T) {
	ce := newContainerdEnvFor(t, func() *env {
		return newEnv(t, `enable_annotations = ["^shared_fs$", "^virtio_fs_cache$", "^virtio_fs_extra_args$"]`)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for i, bad := range []struct{ value, named string }{
		{`["--sandbox=none"]`, `--sandbox=none`},
		{`["-o", "xattr,modcaps=+sys_admin"]`, `modcaps=+sys_admin`},
		{`["--thread-pool-size", "--shared-dir=/"]`, `--shared-dir=/`},
	} {
		id := "loosen" + string(rune('a'+i))
		r := ce.ctr(ctx, ce.runArgs("--rm",
			"--annotation", "io.katacontainers.config.hypervisor.shared_fs=virtio-fs",
			"--annotation", "io.katacontainers.config.hypervisor.virtio_fs_extra_args="+bad.value,
			ce.image, id, "/bin/true")...)
		want := `annotation io.katacontainers.config.hypervisor.virtio_fs_extra_args = "` + bad.named + `"`
		if r.code == 0 || !strings.Contains(r.stderr, want) {
			t.Fatalf("ctr run with %s: exit %d, stderr %q does not contain %q", bad.value, r.code, r.stderr, want)
		}
		if pids := processesMentioning(bad.named); len(pids) > 0 {
			t.Fatalf("processes run with %s: %v", bad.named, pids)
		}
		ce.ctr(ctx, "containers", "delete", id)
	}
	if left := lingering(ctx, ce.sock); len(left) > 0 {
		t.Fatalf("shim still running after refused creates: %v", left)
	}
}
