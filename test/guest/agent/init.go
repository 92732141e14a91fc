package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/mount"
)

const (
	containerInitArg = "__container-init"
	initConfigEnv    = "KATA_FSX_INIT_CONFIG"
	// initSyncFd is where the helper reports a failure before exec; the fd is
	// close-on-exec, so EOF without data means the exec happened.
	initSyncFd = 3
)

// initConfig is what the agent hands its container-init helper.
type initConfig struct {
	Rootfs   string       `json:"rootfs"`
	Readonly bool         `json:"readonly"`
	Hostname string       `json:"hostname"`
	Mounts   []mountEntry `json:"mounts"`
	Args     []string     `json:"args"`
	Env      []string     `json:"env"`
	Cwd      string       `json:"cwd"`
	// Terminal gives the process a pty of the container (see pty.go).
	Terminal bool         `json:"terminal"`
	Console  *consoleSize `json:"console,omitempty"`
	// Privileges are the user, capabilities, rlimits and no_new_privs
	// applied last, before the exec (privileges.go).
	Privileges privileges `json:"privileges"`
}

type mountEntry struct {
	Destination string   `json:"destination"`
	Source      string   `json:"source"`
	Type        string   `json:"type"`
	Options     []string `json:"options"`
}

// defaultMounts apply when the spec brings no mounts of its own.
var defaultMounts = []mountEntry{
	{Destination: "/proc", Source: "proc", Type: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
	{Destination: "/sys", Source: "sysfs", Type: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
	{Destination: "/dev", Source: "devtmpfs", Type: "devtmpfs", Options: []string{"nosuid", "mode=755"}},
	{Destination: "/dev/pts", Source: "devpts", Type: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666"}},
	{Destination: "/dev/shm", Source: "shm", Type: "tmpfs", Options: []string{"nosuid", "nodev", "noexec", "mode=1777"}},
}

// containerInit runs as the first process of a new container (new mount,
// PID and UTS namespaces), like runc's init: it builds the mounts, pivots
// into the rootfs, drops to the process user and execs the OCI process.
// Any failure is written to the sync fd and ends the helper with status 127.
func containerInit() {
	// Capabilities and no_new_privs are per thread: set them on the
	// thread that execs.
	runtime.LockOSThread()
	sync := os.NewFile(initSyncFd, "sync")
	unix.CloseOnExec(initSyncFd)
	err := setupAndExec()
	fmt.Fprint(sync, err.Error())
	os.Exit(127)
}

func setupAndExec() error {
	var cfg initConfig
	if err := json.Unmarshal([]byte(os.Getenv(initConfigEnv)), &cfg); err != nil {
		return fmt.Errorf("container init: bad config: %w", err)
	}
	if len(cfg.Args) == 0 {
		return errors.New("container init: no process args")
	}
	if err := setupRootfs(&cfg); err != nil {
		return err
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	if cfg.Terminal {
		if err := setupConsole(&cfg); err != nil {
			return err
		}
	}
	return becomeProcess(cfg.Privileges, cfg.Cwd, "", cfg.Args, cfg.Env)
}

// becomeProcess ends a helper stage, init's or an exec's: it takes the
// process's rlimits and privileges, enters its cwd and execs its command.
// An empty path is looked up in the process's PATH once in its cwd.
func becomeProcess(p privileges, cwd, path string, args, env []string) error {
	if err := applyRlimits(p.Rlimits); err != nil {
		return err
	}
	if err := applyPrivileges(p); err != nil {
		return err
	}
	if cwd == "" {
		cwd = "/"
	}
	if err := unix.Chdir(cwd); err != nil {
		return fmt.Errorf("chdir to cwd %q: %w", cwd, err)
	}
	if path == "" {
		var err error
		if path, err = lookPath(args[0], env); err != nil {
			return err
		}
	}
	if err := unix.Exec(path, args, env); err != nil {
		return fmt.Errorf("exec %q: %w", args[0], err)
	}
	return nil
}

// setupRootfs makes the mounts of the container and pivots into its rootfs,
// so that the rootfs is "/" in the container's /proc/mounts.
func setupRootfs(cfg *initConfig) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	root := cfg.Rootfs
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind rootfs %s: %w", root, err)
	}
	mounts := cfg.Mounts
	if len(mounts) == 0 {
		mounts = defaultMounts
	}
	devTmpfs := false
	for _, m := range mounts {
		if err := mountInRootfs(root, m); err != nil {
			return err
		}
		devTmpfs = devTmpfs || filepath.Clean(m.Destination) == "/dev" && m.Type == "tmpfs"
	}
	if devTmpfs {
		if err := createDefaultDevices(filepath.Join(root, "dev")); err != nil {
			return err
		}
	}
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("chdir rootfs: %w", err)
	}
	if err := enterRootfs(root); err != nil {
		return err
	}
	if cfg.Readonly {
		if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
			return fmt.Errorf("remount rootfs read-only: %w", err)
		}
	}
	return nil
}

// defaultDevices are the nodes the OCI runtime spec requires in a
// container's /dev, which runc creates when /dev is a tmpfs (as CRI asks).
var defaultDevices = []struct {
	name         string
	major, minor uint32
}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}}

// createDefaultDevices fills a tmpfs /dev with the OCI default devices and links.
func createDefaultDevices(dev string) error {
	for _, d := range defaultDevices {
		p := filepath.Join(dev, d.name)
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("create /dev/%s: %w", d.name, err)
		}
		// mknod is subject to the umask; the spec wants 0666.
		if err := unix.Chmod(p, 0o666); err != nil {
			return fmt.Errorf("chmod /dev/%s: %w", d.name, err)
		}
	}
	for link, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"} {
		if err := os.Symlink(target, filepath.Join(dev, link)); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create /dev/%s: %w", link, err)
		}
	}
	return nil
}

// enterRootfs makes the current directory (the rootfs) the root. It uses
// pivot_root(".", ".") and detaches the old root below it; when the guest
// root is the initramfs, which pivot_root refuses (EINVAL), it moves the
// rootfs over "/" and chroots instead, as Kata does for initrd guests
// (no_pivot_root). Either way the rootfs is "/" in /proc/mounts, and setns
// into the namespace lands on it.
func enterRootfs(root string) error {
	err := unix.PivotRoot(".", ".")
	switch {
	case err == nil:
		if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
			return fmt.Errorf("detach old root: %w", err)
		}
	case errors.Is(err, unix.EINVAL):
		if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move rootfs %s to /: %w", root, err)
		}
		if err := unix.Chroot("."); err != nil {
			return fmt.Errorf("chroot into %s: %w", root, err)
		}
	default:
		return fmt.Errorf("pivot_root into %s: %w", root, err)
	}
	return unix.Chdir("/")
}

// mountInRootfs mounts m under root; the destination must stay inside root.
func mountInRootfs(root string, m mountEntry) error {
	if !filepath.IsAbs(m.Destination) {
		return fmt.Errorf("mount destination %q is not absolute", m.Destination)
	}
	dest := filepath.Join(root, filepath.Clean(m.Destination))
	flags, data := mount.ParseOptions(m.Options)
	typ := m.Type
	if typ == "bind" {
		typ = ""
		flags |= unix.MS_BIND
	}
	// A file can only be bound over a file (/etc/hosts, a single-file
	// volume), a directory only over a directory.
	fileBind := false
	if flags&unix.MS_BIND != 0 {
		fi, err := os.Stat(m.Source)
		if err != nil {
			return fmt.Errorf("mount %s: bind source: %w", m.Destination, err)
		}
		fileBind = !fi.IsDir()
	}
	// Refuse symlinks on the way: they could point outside the rootfs.
	if fileBind {
		if err := mkdirNoSymlinks(root, filepath.Dir(dest)); err != nil {
			return fmt.Errorf("mount %s: %w", m.Destination, err)
		}
		if err := makeFileNoSymlink(dest); err != nil {
			return fmt.Errorf("mount %s: %w", m.Destination, err)
		}
	} else if err := mkdirNoSymlinks(root, dest); err != nil {
		return fmt.Errorf("mount %s: %w", m.Destination, err)
	}
	propagation := flags & (unix.MS_PRIVATE | unix.MS_SHARED | unix.MS_SLAVE | unix.MS_UNBINDABLE)
	flags &^= propagation
	mflags := flags
	if flags&unix.MS_BIND != 0 {
		mflags &^= unix.MS_RDONLY
	}
	if err := unix.Mount(m.Source, dest, typ, mflags, data); err != nil {
		return fmt.Errorf("mount %s (%s) on %s: %w", m.Source, m.Type, m.Destination, err)
	}
	// A bind mount ignores MS_RDONLY until remounted.
	if flags&unix.MS_BIND != 0 && flags&unix.MS_RDONLY != 0 {
		if err := unix.Mount("", dest, "", flags|unix.MS_REMOUNT, ""); err != nil {
			return fmt.Errorf("remount %s read-only: %w", m.Destination, err)
		}
	}
	if propagation != 0 {
		if err := unix.Mount("", dest, "", propagation|flags&unix.MS_REC, ""); err != nil {
			return fmt.Errorf("set propagation of %s: %w", m.Destination, err)
		}
	}
	return nil
}

// makeFileNoSymlink makes sure path is a file to bind a file over,
// creating an empty one if need be; a symlink or a directory is refused.
func makeFileNoSymlink(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o644)
		if err != nil {
			return err
		}
		return f.Close()
	case err != nil:
		return err
	case fi.Mode()&fs.ModeSymlink != 0:
		return fmt.Errorf("%s is a symlink", path)
	case fi.IsDir():
		return fmt.Errorf("%s is a directory: a file cannot be bound over it", path)
	}
	return nil
}

// mkdirNoSymlinks creates dest (a path inside root) refusing symlinks.
func mkdirNoSymlinks(root, dest string) error {
	rel, err := filepath.Rel(root, dest)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("%s escapes the rootfs", dest)
	}
	cur := root
	for _, part := range strings.Split(rel, "/") {
		if part == "" || part == "." {
			continue
		}
		cur = filepath.Join(cur, part)
		fi, err := os.Lstat(cur)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			if err := os.Mkdir(cur, 0o755); err != nil {
				return err
			}
		case err != nil:
			return err
		case fi.Mode()&fs.ModeSymlink != 0:
			return fmt.Errorf("%s is a symlink", cur)
		}
	}
	return nil
}

// lookPath resolves a command like execvp, using PATH from the process env
// (not the agent's).
func lookPath(cmd string, env []string) (string, error) {
	if strings.Contains(cmd, "/") {
		if err := checkExecutable(cmd); err != nil {
			return "", fmt.Errorf("exec %q: %w", cmd, err)
		}
		return cmd, nil
	}
	pathEnv := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	for _, dir := range filepath.SplitList(pathEnv) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, cmd)
		if checkExecutable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("exec %q: %w in $PATH", cmd, exec.ErrNotFound)
}

func checkExecutable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fs.ErrPermission
	}
	return nil
}
