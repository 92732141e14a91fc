package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
)

// CleanupDir kills what still runs off the directory of a sandbox whose
// shim died (QEMU, virtiofsd), unmounts what is mounted below it and
// removes it.
func CleanupDir(dir string) error {
	dir = filepath.Clean(dir)
	if !filepath.IsAbs(dir) || dir == "/" {
		return fmt.Errorf("refusing to clean sandbox directory %q", dir)
	}
	for _, pid := range processesUsing(dir) {
		// A process that exited meanwhile is what we want.
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("kill process %d using %s: %w", pid, dir, err)
		}
	}
	// Give the kernel a moment to release the killed processes' sockets
	// and mounts before unmounting.
	for i := 0; i < 50 && len(processesUsing(dir)) > 0; i++ {
		time.Sleep(100 * time.Millisecond)
	}
	// Only what the mount table shows below the directory, each reached
	// beneath it without a symlink and checked to be that mount: the
	// guest wrote below it while the pod ran.
	t, err := mount.OpenTree(dir)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	err = t.UnmountAll(".")
	t.Close()
	if err != nil {
		return err
	}
	if err := mount.RemoveUnmounted(dir); err != nil {
		return err
	}
	return nil
}

// processesUsing lists the processes whose command line names a path at
// or below dir: a pod's QEMU and virtiofsd do.
func processesUsing(dir string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, en := range ents {
		var pid int
		if _, err := fmt.Sscanf(en.Name(), "%d", &pid); err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", en.Name(), "cmdline"))
		if err != nil {
			continue
		}
		for _, a := range strings.Split(string(b), "\x00") {
			if strings.Contains(a, dir+"/") || strings.HasSuffix(a, dir) {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}
