package workload

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrNotRoot is returned by RunOnHost when the caller is not root: the
// overlay mount and the chroot need it.
var ErrNotRoot = errors.New("the host reference run needs root (overlayfs mount, chroot)")

// ErrNotBenchImage is returned by RunOnHost when rootfs lacks the bench
// image's /bench tree or its bash.
var ErrNotBenchImage = errors.New("not a bench image (see test/fixtures/bench-image.sh)")

// hostPath is the PATH given to the script when env has none.
const hostPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// RunOnHost runs Script as the host reference row: chrooted into an overlayfs
// whose lower layer is rootfs (read-only, never modified) and whose upper layer
// is a fresh temporary directory under os.TempDir (set TMPDIR to pick the
// disk), with /proc, /sys and /dev bound in and a private tmpfs on /dev/shm.
// The script in the overlay is this package's Script, so the host row runs
// the same script the guests get even when rootfs carries an older copy.
// env is the script's whole environment (PATH is added when absent). Every
// mount lives in a private mount namespace and is unmounted, and the
// temporary directory removed, before RunOnHost returns, also on error or
// when ctx is cancelled (which kills the script's whole process group).
func RunOnHost(ctx context.Context, rootfs string, env []string, stdout, stderr io.Writer) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("bench host run: %w", ErrNotRoot)
	}
	root, err := filepath.Abs(rootfs)
	if err != nil {
		return fmt.Errorf("bench host run: rootfs %q: %w", rootfs, err)
	}
	// overlayfs splits its options on ',' and lowerdir on ':'.
	if strings.ContainsAny(root, ",:\\") {
		return fmt.Errorf("bench host run: rootfs %q: ',', ':' and '\\' cannot be passed to overlayfs", root)
	}
	for _, p := range []string{"bench", "usr/bin/bash"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			return fmt.Errorf("bench host run: rootfs %q: %w: %w", root, ErrNotBenchImage, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("bench host run: %w", err)
	}
	// The namespace belongs to one OS thread that is never handed back to the
	// scheduler: when the goroutine returns, the runtime ends the thread and
	// the kernel drops the namespace with anything still mounted in it.
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		done <- runInPrivateNamespace(ctx, root, env, stdout, stderr)
	}()
	return <-done
}

// runInPrivateNamespace must run on a locked OS thread that is never unlocked.
func runInPrivateNamespace(ctx context.Context, root string, env []string, stdout, stderr io.Writer) (err error) {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("bench host run: unshare mount namespace: %w", err)
	}
	// Without this our mounts would propagate to the host's shared mounts.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("bench host run: make mounts private: %w", err)
	}
	tmp, err := os.MkdirTemp("", "kata-fsx-bench-host-")
	if err != nil {
		return fmt.Errorf("bench host run: temp dir: %w", err)
	}
	m := &mounts{}
	defer func() {
		err = errors.Join(err, m.teardown(tmp))
	}()

	upper, work, merged := filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), filepath.Join(tmp, "merged")
	for _, d := range []string{upper, work, merged, filepath.Join(upper, "bench")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("bench host run: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(upper, "bench", "workloads.sh"), []byte(Script), 0o755); err != nil {
		return fmt.Errorf("bench host run: write workloads.sh: %w", err)
	}
	opts := "lowerdir=" + root + ",upperdir=" + upper + ",workdir=" + work
	// metacopy makes chown copy up only metadata, as a chown on a plain host
	// filesystem costs; older kernels refuse the option.
	if err := m.mount("overlay", merged, "overlay", 0, opts+",metacopy=on"); err != nil {
		if err := m.mount("overlay", merged, "overlay", 0, opts); err != nil {
			return fmt.Errorf("bench host run: %w", err)
		}
	}
	for _, d := range []string{"proc", "sys", "dev"} {
		target := filepath.Join(merged, d)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("bench host run: %w", err)
		}
		if err := m.mount("/"+d, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bench host run: %w", err)
		}
	}
	// A plain bind of /dev shows devtmpfs's own (host) shm directory; the
	// script's scratch files belong in a tmpfs that dies with the run.
	if err := m.mount("tmpfs", filepath.Join(merged, "dev", "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size=64m"); err != nil {
		return fmt.Errorf("bench host run: %w", err)
	}

	cmd := exec.CommandContext(ctx, "/bin/bash", "/bench/workloads.sh")
	cmd.Dir = "/"
	cmd.Env = withPath(env)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Chroot:  merged,
		Setpgid: true,
		// The parent is this locked thread, alive until teardown is done.
		Pdeathsig: syscall.SIGKILL,
	}
	// fio and dbench fork workers that would keep the overlay busy.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	runErr := cmd.Run()
	// Leftovers of a failed or cancelled run must not outlive it either.
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("bench host run: %w", ctxErr)
	}
	if runErr != nil {
		return fmt.Errorf("bench host run: /bench/workloads.sh: %w", runErr)
	}
	return nil
}

func withPath(env []string) []string {
	out := append([]string(nil), env...)
	for _, kv := range env {
		if strings.HasPrefix(kv, "PATH=") {
			return out
		}
	}
	return append(out, hostPath)
}

// mounts records what runInPrivateNamespace mounted, to undo it in reverse.
type mounts struct {
	targets []string
}

func (m *mounts) mount(source, target, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s (%s): %w", source, target, data, err)
	}
	m.targets = append(m.targets, target)
	return nil
}

// teardown unmounts in reverse order, lazily when a mount is still busy (a
// killed process not yet reaped), and removes tmp only when nothing is
// mounted below it any more: removing through a bind of /dev would delete
// the host's device nodes.
func (m *mounts) teardown(tmp string) error {
	var errs []error
	for i := len(m.targets) - 1; i >= 0; i-- {
		t := m.targets[i]
		if err := unix.Unmount(t, 0); err != nil {
			if lazyErr := unix.Unmount(t, unix.MNT_DETACH); lazyErr != nil {
				errs = append(errs, fmt.Errorf("unmount %s: %w (lazily: %w)", t, err, lazyErr))
			}
		}
	}
	m.targets = nil
	if len(errs) > 0 {
		errs = append(errs, fmt.Errorf("left %s in place because of the failed unmounts", tmp))
		return errors.Join(errs...)
	}
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("remove %s: %w", tmp, err)
	}
	return nil
}
