package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// exportRaw writes the fully materialized image to path: what a runtime
// without imagefs-blk would have to build and store for the same rootfs.
func exportRaw(ctx context.Context, img *ext4.Image, opener index.Opener, path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if err := ext4.Export(ctx, img, opener, f); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("export %s: %w", path, err)
	}
	return f.Close()
}

// storageDaemon is a running qemu-storage-daemon exporting one raw file
// over vhost-user-blk.
type storageDaemon struct {
	cmd    *exec.Cmd
	exited chan struct{}
	log    string
	Args   []string
}

// qsdEscape doubles commas, QEMU's option-value escape.
func qsdEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// startStorageDaemon starts qemu-storage-daemon on raw with the same host
// I/O settings as the virtio-blk drive (O_DIRECT, aio mode) and waits for
// its vhost-user socket.
func startStorageDaemon(ctx context.Context, bin, raw, sock, aio, logPath string) (*storageDaemon, error) {
	args := []string{
		"--blockdev", fmt.Sprintf("driver=file,node-name=file,filename=%s,cache.direct=on,aio=%s", qsdEscape(raw), aio),
		"--blockdev", "driver=raw,node-name=raw,file=file",
		"--export", fmt.Sprintf("type=vhost-user-blk,id=exp,node-name=raw,addr.type=unix,addr.path=%s,writable=on,num-queues=1", qsdEscape(sock)),
	}
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Die with the benchmark even if it is killed without a chance to clean up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start qemu-storage-daemon: %w", err)
	}
	d := &storageDaemon{cmd: cmd, exited: make(chan struct{}), log: logPath, Args: append([]string{bin}, args...)}
	go func() { cmd.Wait(); close(d.exited) }()
	deadline := time.NewTimer(15 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if fi, err := os.Stat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return d, nil
		}
		select {
		case <-d.exited:
			b, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("qemu-storage-daemon exited at start: %s: %s", cmd.ProcessState, strings.TrimSpace(string(b)))
		case <-ctx.Done():
			d.Stop()
			return nil, ctx.Err()
		case <-deadline.C:
			d.Stop()
			return nil, errors.New("qemu-storage-daemon did not create its socket within 15 s")
		case <-tick.C:
		}
	}
}

// Stop ends the daemon: SIGTERM, then SIGKILL after 5 s.
func (d *storageDaemon) Stop() {
	select {
	case <-d.exited:
		return
	default:
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(5 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.exited
	}
}

// versionLine is the first line of `bin --version`.
func versionLine(bin string, args ...string) string {
	if len(args) == 0 {
		args = []string{"--version"}
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("unknown (%v)", err)
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}
