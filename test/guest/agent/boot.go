package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// modulesList is written by build.sh: module paths in load order, with
// channelsMarker after the modules the agent channels need. The guest
// image (build-image.sh) has none: its kernel has every driver built in.
const (
	modulesList    = "/etc/modules.load"
	channelsMarker = "#channels-ready"
)

func agentMain() error {
	if os.Getpid() != 1 {
		return errors.New("must run as PID 1 (it is the guest's /init)")
	}
	return boot()
}

// boot mounts the basic filesystems, loads the channel modules, serves the
// agent API and loads the storage modules meanwhile. The same binary is
// /init of the initramfs (a writable root) and /sbin/init of the guest
// image (an ext4 root mounted read-only, no /dev/console before devtmpfs is
// mounted): it writes only to the filesystems it mounts here.
func boot() error {
	start := time.Now()
	openConsole()
	for _, m := range []struct{ src, dst, typ, data string }{
		{"proc", "/proc", "proc", ""},
		{"sysfs", "/sys", "sysfs", ""},
		{"devtmpfs", "/dev", "devtmpfs", "mode=0755"},
		{"tmpfs", "/tmp", "tmpfs", "mode=1777"},
		{"tmpfs", "/run", "tmpfs", "mode=0755"},
		{"devpts", "/dev/pts", "devpts", "newinstance,ptmxmode=0666"},
		{"tmpfs", "/dev/shm", "tmpfs", "mode=1777"},
	} {
		if err := mountIfNeeded(m.src, m.dst, m.typ, unix.MS_NOSUID, m.data); err != nil {
			return err
		}
		if m.dst == "/dev" {
			// A root without a /dev/console node (the image's) gave the
			// kernel no console to start us with: take it now.
			openConsole()
		}
	}
	logRoot()
	_, err := os.Stat(modulesList)
	haveModules := !errors.Is(err, fs.ErrNotExist)
	if !haveModules {
		log.Printf("no %s: the kernel has its drivers built in", modulesList)
	}
	a := newAgent()
	a.hostile = hostileFromCmdline()
	channels := make(chan struct{})
	go func() {
		err := loadModules(modulesList, func() {
			if haveModules {
				log.Printf("channel modules loaded %s after /init started", time.Since(start).Round(time.Millisecond))
			}
			close(channels)
		})
		if err == nil {
			if haveModules {
				log.Printf("all modules loaded %s after /init started", time.Since(start).Round(time.Millisecond))
			}
		} else {
			log.Printf("%v", err)
		}
		a.modulesErr = err
		close(a.modulesDone)
	}()
	select {
	case <-channels:
	case <-a.modulesDone:
		if a.modulesErr != nil {
			return a.modulesErr
		}
	}
	return a.serve(context.Background())
}

// mountIfNeeded creates dst and mounts there unless it already is a mount
// point. On a read-only root dst must exist already (the image has every
// mount point); MkdirAll of an existing directory writes nothing.
func mountIfNeeded(src, dst, typ string, flags uintptr, data string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("mount point %s: %w", dst, err)
	}
	if isMountPoint(dst) {
		return nil
	}
	if err := unix.Mount(src, dst, typ, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", typ, dst, err)
	}
	return nil
}

func isMountPoint(path string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(path, &st) != nil || unix.Lstat(filepath.Join(path, ".."), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev || st.Ino == parent.Ino
}

// logRoot logs what the guest booted from (the initramfs, or the image's
// device, filesystem and options), so a console log says which guest ran.
func logRoot() {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		log.Printf("guest root: %v", err)
		return
	}
	if src, fstype, opts, ok := rootMount(string(b)); ok {
		log.Printf("guest root: %s %s %s", src, fstype, opts)
	}
}

// rootMount finds the mount of "/" in a mountinfo text (the last one
// wins, as in the kernel's view) and returns its source, type and the
// mount and superblock options.
func rootMount(mountinfo string) (src, fstype, opts string, ok bool) {
	for _, line := range strings.Split(mountinfo, "\n") {
		pre, post, found := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !found || len(f) < 6 || len(g) < 3 || f[4] != "/" {
			continue
		}
		src, fstype, opts, ok = g[1], g[0], f[5]+" "+g[2], true
	}
	return src, fstype, opts, ok
}

// openConsole sends the log and stdio to /dev/console, which the host
// captures with -serial. It does nothing while /dev/console is missing.
func openConsole() {
	f, err := os.OpenFile("/dev/console", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return
	}
	_ = unix.Dup2(int(f.Fd()), 1)
	_ = unix.Dup2(int(f.Fd()), 2)
	log.SetOutput(os.Stderr)
	log.SetFlags(log.Lmicroseconds)
	log.SetPrefix("agent: ")
	f.Close()
}

// loadModules loads the kernel modules listed in path, in order, calling
// channelsReady once at the marker line (or at the end).
func loadModules(path string, channelsReady func()) error {
	var once sync.Once
	defer once.Do(channelsReady)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name := strings.TrimSpace(sc.Text())
		if name == channelsMarker {
			once.Do(channelsReady)
			continue
		}
		if name == "" || strings.HasPrefix(name, "#") {
			continue
		}
		if err := loadModule(name); err != nil {
			return err
		}
	}
	return sc.Err()
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("load module: %w", err)
	}
	defer f.Close()
	err = unix.FinitModule(int(f.Fd()), "", 0)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", path, err)
	}
	return nil
}

// powerOff syncs and turns the VM off; QEMU exits when the guest powers off.
func powerOff() {
	unix.Sync()
	if os.Getpid() == 1 {
		_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	}
}
