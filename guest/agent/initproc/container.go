// Package initproc is the agent binary's helper roles, chosen by argv[1]:
// the first process of a container (ContainerInit: the container's mounts,
// the rootfs, the hostname, the terminal) and an exec'd process
// (ExecInit), both ending in the OCI process's privileges (user,
// capabilities, rlimits, no_new_privs, seccomp) and its exec; and the
// agent side of that hand-over, resolving the privileges and the
// configuration the helpers read.
package initproc

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/guest/agent/pty"
	"github.com/kata-fsx/kata-fsx/mount"
)

const (
	// ContainerInitArg is argv[1] of the helper a container's first
	// process starts as.
	ContainerInitArg = "__container-init"
	// ConfigEnv is the environment variable a helper reads its
	// configuration (InitConfig or ExecConfig, as JSON) from.
	ConfigEnv = "KATA_FSX_INIT_CONFIG"
	// SyncFd is where the helper reports a failure before exec; the fd is
	// close-on-exec, so EOF without data means the exec happened.
	SyncFd = 3
)

// InitConfig is what the agent hands its container-init helper.
type InitConfig struct {
	Rootfs   string   `json:"rootfs"`
	Readonly bool     `json:"readonly"`
	Hostname string   `json:"hostname"`
	Mounts   []Mount  `json:"mounts"`
	Args     []string `json:"args"`
	Env      []string `json:"env"`
	Cwd      string   `json:"cwd"`
	// Terminal gives the process a pty of the container (see pty.go).
	Terminal bool      `json:"terminal"`
	Console  *pty.Size `json:"console,omitempty"`
	// Privileges are the user, capabilities, rlimits and no_new_privs
	// applied last, before the exec (privileges.go).
	Privileges Privileges `json:"privileges"`
	// Sysctl is the spec's linux.sysctl. The container shares the VM's
	// network and IPC namespaces with the pod's other containers, so a
	// value is the pod's, as CRI's pod-level sysctls are.
	Sysctl map[string]string `json:"sysctl,omitempty"`
	// MaskedPaths and ReadonlyPaths are the spec's linux.maskedPaths and
	// linux.readonlyPaths, paths in the container applied after the pivot.
	MaskedPaths   []string `json:"maskedPaths,omitempty"`
	ReadonlyPaths []string `json:"readonlyPaths,omitempty"`
}

// Mount is one of the container's mounts, as the spec gives it.
type Mount struct {
	Destination string   `json:"destination"`
	Source      string   `json:"source"`
	Type        string   `json:"type"`
	Options     []string `json:"options"`
}

// defaultMounts apply when the spec brings no mounts of its own.
var defaultMounts = []Mount{
	{Destination: "/proc", Source: "proc", Type: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
	{Destination: "/sys", Source: "sysfs", Type: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
	{Destination: "/dev", Source: "devtmpfs", Type: "devtmpfs", Options: []string{"nosuid", "mode=755"}},
	{Destination: "/dev/pts", Source: "devpts", Type: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666"}},
	{Destination: "/dev/shm", Source: "shm", Type: "tmpfs", Options: []string{"nosuid", "nodev", "noexec", "mode=1777"}},
}

// ContainerInit runs as the first process of a new container (new mount,
// PID and UTS namespaces), like runc's init: it builds the mounts, pivots
// into the rootfs, drops to the process user and execs the OCI process.
// Any failure is written to the sync fd and ends the helper with status 127.
func ContainerInit() {
	// Capabilities and no_new_privs are per thread: set them on the
	// thread that execs.
	runtime.LockOSThread()
	sync := os.NewFile(SyncFd, "sync")
	unix.CloseOnExec(SyncFd)
	err := setupAndExec()
	fmt.Fprint(sync, err.Error())
	os.Exit(127)
}

func setupAndExec() error {
	var cfg InitConfig
	if err := json.Unmarshal([]byte(os.Getenv(ConfigEnv)), &cfg); err != nil {
		return fmt.Errorf("container init: bad config: %w", err)
	}
	if len(cfg.Args) == 0 {
		return errors.New("container init: no process args")
	}
	// Before the pivot: /proc is still the guest's, writable, and a
	// value written to /proc/sys applies to the writer's namespaces.
	if err := applySysctls("/proc/sys", cfg.Sysctl); err != nil {
		return err
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

// applySysctls writes each of the spec's sysctls under dir (/proc/sys),
// in key order. A key is dotted (net.ipv4.ip_forward) or, as runc also
// takes it, slashed (net/ipv4/conf/eth0.100/rp_filter, for names with a
// dot); one that would leave dir is refused.
func applySysctls(dir string, sysctls map[string]string) error {
	keys := make([]string, 0, len(sysctls))
	for k := range sysctls {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		p, err := sysctlPath(k)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(filepath.Join(dir, p), os.O_WRONLY|os.O_TRUNC|unix.O_NOFOLLOW, 0)
		if err != nil {
			return fmt.Errorf("sysctl %s: %w", k, err)
		}
		_, err = f.WriteString(sysctls[k])
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("sysctl %s=%q: %w", k, sysctls[k], err)
		}
	}
	return nil
}

// sysctlPath is key's path under /proc/sys.
func sysctlPath(key string) (string, error) {
	p := key
	if !strings.Contains(key, "/") {
		p = strings.ReplaceAll(key, ".", "/")
	}
	for _, part := range strings.Split(p, "/") {
		if part == "" || part == "." || part == ".." || strings.ContainsRune(part, 0) {
			return "", fmt.Errorf("sysctl %q: not a sysctl name", key)
		}
	}
	return p, nil
}

// becomeProcess ends a helper stage, init's or an exec's: it takes the
// process's rlimits and privileges, enters its cwd and execs its command.
// An empty path is looked up in the process's PATH once in its cwd.
func becomeProcess(p Privileges, cwd, path string, args, env []string) error {
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
		if path, err = LookPath(args[0], env); err != nil {
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
func setupRootfs(cfg *InitConfig) error {
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
	for _, p := range cfg.ReadonlyPaths {
		if err := readonlyPath(p); err != nil {
			return err
		}
	}
	for _, p := range cfg.MaskedPaths {
		if err := maskPath(p); err != nil {
			return err
		}
	}
	if cfg.Readonly {
		if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
			return fmt.Errorf("remount rootfs read-only: %w", err)
		}
	}
	return nil
}

// readonlyPath makes path (in the container, after the pivot) a read-only
// bind of itself, as runc does for linux.readonlyPaths; a path the
// container does not have is left alone. Only the read-only flag is
// added, so the mount keeps its nosuid, nodev and noexec.
func readonlyPath(path string) error {
	if err := unix.Mount(path, path, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("readonly path %s: bind: %w", path, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
	if err := unix.MountSetattr(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, &attr); err != nil {
		return fmt.Errorf("readonly path %s: %w", path, err)
	}
	return nil
}

// maskPath hides path (in the container, after the pivot) as runc does for
// linux.maskedPaths: an empty read-only tmpfs over a directory, /dev/null
// over anything else; a path the container does not have is left alone.
func maskPath(path string) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("masked path %s: %w", path, err)
	}
	var err error
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		err = unix.Mount("tmpfs", path, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
	} else {
		err = unix.Mount("/dev/null", path, "", unix.MS_BIND, "")
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("masked path %s: %w", path, err)
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
func mountInRootfs(root string, m Mount) error {
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
	// The remount above reaches the bind's top mount only: rro asks for
	// its submounts too, which only mount_setattr can do in one step.
	if flags&unix.MS_BIND != 0 && mount.RecursiveReadOnly(m.Options) {
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		if err := unix.MountSetattr(-1, dest, unix.AT_RECURSIVE|unix.AT_SYMLINK_NOFOLLOW, &attr); err != nil {
			return fmt.Errorf("make %s recursively read-only (rro): %w", m.Destination, err)
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

// LookPath resolves a command like execvp, using PATH from the process env
// (not the agent's).
func LookPath(cmd string, env []string) (string, error) {
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

// ConsoleFd is where the container-init helper of a process with a
// terminal finds the socket it hands the pty master back on.
const ConsoleFd = 4

// setupConsole runs in the container-init helper of a process with a
// terminal, after the container's mounts and before it drops privileges:
// it opens the pty, sizes it, hands the master to the agent over
// ConsoleFd and makes the slave the process's terminal.
func setupConsole(cfg *InitConfig) error {
	sock := os.NewFile(ConsoleFd, "console socket")
	defer sock.Close()
	master, slave, err := pty.Open()
	if err != nil {
		return err
	}
	defer master.Close()
	defer slave.Close()
	if s := cfg.Console; s != nil {
		if err := pty.SetWinsize(master, s.Rows, s.Cols); err != nil {
			return fmt.Errorf("terminal: set size %dx%d: %w", s.Rows, s.Cols, err)
		}
	}
	// The process owns its terminal, as a login's user does.
	if err := unix.Fchown(int(slave.Fd()), int(cfg.Privileges.UID), -1); err != nil {
		return fmt.Errorf("terminal: chown %s to uid %d: %w", slave.Name(), cfg.Privileges.UID, err)
	}
	if err := pty.SendFile(sock, master); err != nil {
		return fmt.Errorf("terminal: hand the pty master to the agent: %w", err)
	}
	return pty.MakeControllingTerminal(slave)
}
