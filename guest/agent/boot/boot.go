// Package boot is the agent binary's program: PID 1 of the guest, which
// mounts the basic filesystems, takes the console, loads the kernel
// modules, serves the agent API on its channels until DestroySandbox and
// powers the VM off; started again by the agent with a helper role in
// argv[1], it runs that role instead (package initproc).
//
// The same binary is /init of the initramfs (a writable root) and
// /sbin/init of the guest image (an ext4 root mounted read-only, no
// /dev/console before devtmpfs is mounted): it writes only to the
// filesystems it mounts.
package boot

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
	"github.com/kata-fsx/kata-fsx/guest/agent/channel"
	"github.com/kata-fsx/kata-fsx/guest/agent/forward"
	"github.com/kata-fsx/kata-fsx/guest/agent/initproc"
	"github.com/kata-fsx/kata-fsx/guest/agent/modules"
	"github.com/kata-fsx/kata-fsx/guest/agent/service"
)

// channelTimeout bounds the wait for an agent channel to appear.
const channelTimeout = 30 * time.Second

// Main runs the agent binary: a helper role when argv[1] names one, else
// the guest's init serving the agent API with serverOpts (a test build
// adds an interceptor). It does not return as the guest's init.
func Main(serverOpts ...ttrpc.ServerOpt) {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case initproc.ContainerInitArg:
			initproc.ContainerInit()
			return
		case initproc.ExecInitArg:
			initproc.ExecInit()
			return
		}
	}
	if err := agentMain(serverOpts); err != nil {
		fmt.Fprintf(os.Stderr, "kata-fsx agent: %v\n", err)
		powerOff()
		os.Exit(1)
	}
	log.Printf("powering off")
	powerOff()
	select {}
}

func agentMain(serverOpts []ttrpc.ServerOpt) error {
	if os.Getpid() != 1 {
		return errors.New("must run as PID 1 (it is the guest's /init)")
	}
	return boot(serverOpts)
}

// boot mounts the basic filesystems, loads the channel modules, serves the
// agent API and loads the storage modules meanwhile; it returns nil once
// DestroySandbox asks for the power-off.
func boot(serverOpts []ttrpc.ServerOpt) error {
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
	_, err := os.Stat(modules.List)
	haveModules := !errors.Is(err, fs.ErrNotExist)
	if !haveModules {
		log.Printf("no %s: the kernel has its drivers built in", modules.List)
	}
	channels := make(chan struct{})
	mods := modules.Start(modules.List, func() {
		if haveModules {
			log.Printf("channel modules loaded %s after /init started", time.Since(start).Round(time.Millisecond))
		}
		close(channels)
	})
	go func() {
		<-mods.Done()
		if err := mods.Err(); err != nil {
			log.Printf("%v", err)
		} else if haveModules {
			log.Printf("all modules loaded %s after /init started", time.Since(start).Round(time.Millisecond))
		}
	}()
	select {
	case <-channels:
	case <-mods.Done():
		if err := mods.Err(); err != nil {
			return err
		}
	}
	ls := channel.Wait(channelTimeout)
	if len(ls) == 0 {
		return errors.New("no agent channel: neither virtio-serial port " + channel.SerialPortName + " nor a vsock device appeared")
	}
	if fl, err := channel.ListenForward(); err != nil {
		log.Printf("port-forward: %v", err)
	} else {
		log.Printf("port-forward on vsock port %d", portfwd.VsockPort)
		go func() {
			if err := (&forward.Server{}).Serve(context.Background(), fl); err != nil {
				log.Printf("%v", err)
			}
		}()
	}
	a := service.New(mods)
	return a.Serve(context.Background(), ls, serverOpts...)
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

// powerOff syncs and turns the VM off; QEMU exits when the guest powers off.
func powerOff() {
	unix.Sync()
	if os.Getpid() == 1 {
		_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	}
}
