// Package storage mounts the storages of Kata's protocol in the guest
// (virtio-fs, 9p, virtio-blk disks found by PCI path, tmpfs, binds) and
// counts their users, so a storage the containers of a pod share is
// unmounted when its last user goes.
package storage

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/pci"
	"github.com/kata-fsx/kata-fsx/mount"
)

// blkWaitTimeout bounds the wait for a (possibly hot-plugged) block device.
const blkWaitTimeout = pci.HotplugTimeout

// Set is the agent's mounted storages by mount point, with the number of
// users of each: the containers of a pod share a storage (the volumes'
// share, an emptyDir's tmpfs) by naming its mount point, as with Kata's
// agent, and it is unmounted when its last user goes. The zero Set is
// empty and ready.
type Set struct {
	// mu is held across the mounts and unmounts it counts (the agent's mu
	// may be held); those wait for the kernel and for a hot-plugged disk's
	// device (within the request's context), nothing that takes a lock of
	// the agent.
	mu   sync.Mutex
	refs map[string]int
}

// Add mounts a storage, or counts one more user of the one already
// mounted at its mount point, and returns the mount point.
func (ss *Set) Add(ctx context.Context, s *pb.Storage) (string, error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.refs == nil {
		ss.refs = map[string]int{}
	}
	mp := filepath.Clean(s.GetMountPoint())
	if ss.refs[mp] > 0 {
		ss.refs[mp]++
		return mp, nil
	}
	mp, err := mountStorage(ctx, s)
	if err != nil {
		return "", err
	}
	ss.refs[mp] = 1
	return mp, nil
}

// Release drops one user of each mount point, in reverse order, and
// unmounts those that have none left.
func (ss *Set) Release(mps []string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	var unused []string
	for i := len(mps) - 1; i >= 0; i-- {
		if ss.refs[mps[i]]--; ss.refs[mps[i]] <= 0 {
			delete(ss.refs, mps[i])
			unused = append(unused, mps[i])
		}
	}
	// unmountAll takes mount order and unmounts from the end.
	for i, j := 0, len(unused)-1; i < j; i, j = i+1, j-1 {
		unused[i], unused[j] = unused[j], unused[i]
	}
	unmountAll(unused)
}

// mountStorage mounts one Kata Storage and returns its mount point.
func mountStorage(ctx context.Context, s *pb.Storage) (string, error) {
	mp := s.GetMountPoint()
	if !filepath.IsAbs(mp) {
		return "", fmt.Errorf("storage %q: mount point %q is not absolute", s.GetDriver(), mp)
	}
	mp = filepath.Clean(mp)
	if err := os.MkdirAll(mp, 0o755); err != nil {
		return "", fmt.Errorf("storage %q: %w", s.GetDriver(), err)
	}
	opts, fsGID, err := takeFSGroup(s.GetOptions())
	if err != nil {
		return "", fmt.Errorf("storage %q on %s: %w", s.GetDriver(), mp, err)
	}
	flags, data := mount.ParseOptions(opts)
	source, fstype := s.GetSource(), s.GetFstype()
	switch s.GetDriver() {
	case "virtio-fs":
		if fstype == "" {
			fstype = "virtiofs"
		}
	case "9p":
		if fstype == "" {
			fstype = "9p"
		}
		data = addDefault(data, "trans", "virtio")
		data = addDefault(data, "version", "9p2000.L")
	case "blk", "virtio-blk", "virtio-blk-pci":
		dev, err := findBlockDevice(ctx, source)
		if err != nil {
			return "", fmt.Errorf("storage blk %q: %w", source, err)
		}
		source = dev
	case "ephemeral":
		if fstype == "" {
			fstype = "tmpfs"
		}
		source = "tmpfs"
	case "local", "bind":
		// A guest directory, bound as is.
		flags |= unix.MS_BIND
	default:
		return "", fmt.Errorf("storage driver %q is not supported by the kata-fsx agent", s.GetDriver())
	}
	if err := mountRetryingNewDisk(ctx, source, mp, fstype, flags, data, blkDriver(s.GetDriver())); err != nil {
		return "", fmt.Errorf("mount %s (%s, %s, %q) on %s: %w", source, s.GetDriver(), fstype, data, mp, err)
	}
	if fsGID >= 0 {
		// Kata's fsGroup of a volume: the pod's group owns its root.
		if err := os.Lchown(mp, -1, fsGID); err != nil {
			unix.Unmount(mp, unix.MNT_DETACH)
			return "", fmt.Errorf("storage %q on %s: chown to fsGroup %d: %w", s.GetDriver(), mp, fsGID, err)
		}
	}
	return mp, nil
}

func blkDriver(d string) bool {
	return d == "blk" || d == "virtio-blk" || d == "virtio-blk-pci"
}

// mountRetryingNewDisk mounts, and for a disk retries ENXIO for a while:
// the kernel creates a hot-plugged disk's /dev node before the disk can be
// opened (device_add comes before bdev_add), so a mount in that window
// fails with "no such device or address".
func mountRetryingNewDisk(ctx context.Context, source, mp, fstype string, flags uintptr, data string, disk bool) error {
	ctx, cancel := context.WithTimeout(ctx, blkWaitTimeout)
	defer cancel()
	for {
		err := unix.Mount(source, mp, fstype, flags, data)
		if err == nil || !disk || !errors.Is(err, unix.ENXIO) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// takeFSGroup removes Kata's fsgid=N option (the pod's fsGroup, which is
// no mount option) from a storage's options; the group is -1 without one.
func takeFSGroup(opts []string) ([]string, int, error) {
	gid := -1
	var out []string
	for _, o := range opts {
		v, ok := strings.CutPrefix(o, "fsgid=")
		if !ok {
			out = append(out, o)
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return nil, 0, fmt.Errorf("bad option %q: want fsgid=<group id>", o)
		}
		gid = n
	}
	return out, gid, nil
}

func addDefault(data, key, value string) string {
	for _, kv := range strings.Split(data, ",") {
		if kv == key || strings.HasPrefix(kv, key+"=") {
			return data
		}
	}
	if data == "" {
		return key + "=" + value
	}
	return data + "," + key + "=" + value
}

// findBlockDevice resolves a storage source (a PCI path, or a /dev path) to
// the /dev node of its disk, waiting for hot-plugged devices to appear.
func findBlockDevice(ctx context.Context, source string) (string, error) {
	if strings.HasPrefix(source, "/dev/") {
		return source, nil
	}
	slots, err := pci.ParsePath(source)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, blkWaitTimeout)
	defer cancel()
	var lastErr error
	for {
		dev, err := blockNodeAt("/sys/devices", slots)
		if err == nil {
			if _, serr := os.Stat(dev); serr == nil {
				return dev, nil
			}
			err = fmt.Errorf("%s not yet in /dev", dev)
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("waiting for block device: %w (last: %w)", ctx.Err(), lastErr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// blockNodeAt names the /dev node of the virtio disk at a PCI path.
func blockNodeAt(sysDevices string, slots []uint8) (string, error) {
	dir, err := pci.DeviceDir(sysDevices, slots)
	if err != nil {
		return "", err
	}
	matches, _ := filepath.Glob(filepath.Join(dir, "virtio*", "block", "*"))
	if len(matches) == 0 {
		return "", fmt.Errorf("no virtio block disk under %s", dir)
	}
	return filepath.Join("/dev", filepath.Base(matches[0])), nil
}

// unmountAll unmounts mount points in reverse order, detaching busy ones.
func unmountAll(mps []string) {
	for i := len(mps) - 1; i >= 0; i-- {
		if err := unix.Unmount(mps[i], 0); err != nil {
			if err2 := unix.Unmount(mps[i], unix.MNT_DETACH); err2 != nil {
				log.Printf("unmount %s: %v", mps[i], err)
			}
		}
	}
}
