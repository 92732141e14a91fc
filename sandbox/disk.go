package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/log"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// hotUnplugTimeout bounds the wait for the guest to let go of a
// hot-plugged disk (ACPI eject, then DEVICE_DELETED); a TCG guest takes
// seconds where KVM takes milliseconds.
const hotUnplugTimeout = 60 * time.Second

// podDisk is an imagefs-blk disk of one container and its QEMU device.
type podDisk struct {
	*blk.Disk
	deviceID string
	path     hypervisor.PCIPath // where the guest finds it
	// stopServing ends the context the disk is served with.
	stopServing context.CancelFunc

	// slot is set for a disk hot-plugged after boot; chardevAdded and
	// deviceAdded record how far the plug got, so unplug undoes just that.
	slot         *hypervisor.HotplugSlot
	chardevAdded bool
	deviceAdded  bool

	// lazy is the lazy image store a hot-plugged disk reads its file data
	// through; the disk owns it and closes it once it no longer serves.
	lazy LazyRootfs
}

func (d *podDisk) chardevID() string { return "char-" + d.deviceID }

// blkOptions maps the [kata_fsx.imagefs_blk] table to disk options.
func blkOptions(c *config.Config) blk.Options {
	b := c.KataFSX.ImagefsBlk
	entries, layer, meta, mem := b.Budgets()
	return blk.Options{
		Budgets:      blk.Budgets{MaxEntries: entries, MaxLayerBytes: layer, MaxMetadataBytes: meta, MaxBuildMemory: mem},
		CacheDir:     node.LayoutOf(c).BlkCache(),
		WritableSize: int64(b.WritableSizeMB) << 20,
		BlockSize:    int(b.BlockSize),
		Journal:      b.Journal,
		JournalSize:  int64(b.JournalSizeMB) << 20,
		NumQueues:    int(b.NumQueues),
		QueueSize:    int(b.QueueSize),
	}
}

// layerKeys vouches for the layers whose index may be cached: an
// overlay's lowerdirs are committed snapshots, which containerd never
// changes; its upperdir and a directory rootfs are written to, so they are
// walked on every build.
func layerKeys(rootfs config.Rootfs) []string {
	if rootfs.Kind != config.RootfsOverlay {
		return nil
	}
	keys := make([]string, len(rootfs.Layers))
	for i, l := range rootfs.Layers {
		if l != rootfs.UpperDir {
			keys[i] = "committed-snapshot"
		}
	}
	return keys
}

// createDisk indexes and synthesizes a container's rootfs and serves it
// from the sandbox directory (0700), so only this pod's QEMU reaches it.
// ctx bounds the build; the disk is then served until it is removed or
// the sandbox stops, whatever becomes of ctx.
func (b *imagefsBackend) createDisk(ctx context.Context, cid string, rootfs config.Rootfs, idx *index.Index, opener index.Opener) (*podDisk, error) {
	s := b.s
	if err := ValidID(cid); err != nil {
		return nil, err
	}
	if idx == nil && !rootfs.Indexable() {
		return nil, fmt.Errorf("container %s: imagefs-blk cannot index this rootfs: %s", cid, rootfs.Why)
	}
	s.mu.Lock()
	if err := s.requireLocked("add a disk for container "+cid, StateBooting, StateReady); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	if _, ok := b.disks[cid]; ok {
		s.mu.Unlock()
		return nil, fmt.Errorf("container %s already has an imagefs-blk disk", cid)
	}
	// Numbers are never reused, so a disk being unplugged cannot collide
	// with its successor's socket or QEMU ids.
	seq := b.diskSeq
	b.diskSeq++
	s.mu.Unlock()

	dir := filepath.Join(s.Dir, "blk", cid)
	opts := blkOptions(s.cfg)
	opts.LayerKeys = layerKeys(rootfs)
	opts.Opener = opener
	// Sockets sit right in the sandbox directory: container ids can be
	// 64 bytes and unix socket paths only 107.
	opts.Socket = filepath.Join(s.Dir, fmt.Sprintf("blk%d.sock", seq))
	serveCtx, stopServing := context.WithCancel(s.life)
	// A request cancelled while the disk is built cancels the build.
	stopAbort := context.AfterFunc(ctx, stopServing)
	var (
		d   *blk.Disk
		err error
	)
	if idx != nil {
		d, err = blk.CreateFromIndex(serveCtx, idx, dir, opts)
	} else {
		d, err = blk.Create(serveCtx, rootfs.Layers, dir, opts)
	}
	if !stopAbort() && err == nil {
		err = errors.Join(fmt.Errorf("disk creation cancelled: %w", context.Cause(ctx)), d.Remove())
	}
	if err != nil {
		stopServing()
		// A failed build may have left part of the disk behind.
		if rerr := os.RemoveAll(dir); rerr != nil {
			err = errors.Join(err, rerr)
		}
		if rerr := os.Remove(opts.Socket); rerr != nil && !os.IsNotExist(rerr) {
			err = errors.Join(err, rerr)
		}
		return nil, fmt.Errorf("container %s: %w", cid, err)
	}
	// Said per pod so an operator (and the stress suite) can tell which
	// pod of a new image paid for its metadata and which found it built.
	if opts.CacheDir == "" {
		log.G(ctx).WithField("sandbox", s.ID).Infof("container %s: imagefs-blk metadata synthesized privately in %s", cid, d.Build.Synthesis)
	} else if d.Build.Shared {
		log.G(ctx).WithField("sandbox", s.ID).Infof("container %s: imagefs-blk metadata found in the node's image store", cid)
	} else {
		log.G(ctx).WithField("sandbox", s.ID).Infof("container %s: imagefs-blk metadata built into the node's image store in %s", cid, d.Build.Synthesis)
	}
	s.diskBuilt(serveCtx, d, opts) // node caches: hold its blobs, prune in the background
	pd := &podDisk{Disk: d, deviceID: fmt.Sprintf("imagefs-blk-%d", seq), stopServing: stopServing}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.requireLocked("add a disk for container "+cid, StateBooting, StateReady); err != nil {
		// Stop may already have collected the disks: this one would outlive the pod.
		stopServing()
		return nil, errors.Join(err, d.Remove())
	}
	b.disks[cid] = pd
	return pd, nil
}

// remove stops serving the disk and deletes its files; the caller has
// taken it out of b.disks and QEMU no longer uses it.
func (d *podDisk) remove() error {
	err := d.Remove()
	d.stopServing()
	if d.lazy != nil {
		if cerr := d.lazy.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close the lazy image store: %w", cerr))
		}
	}
	return err
}

// hotplugDisk builds and serves a disk for a container created after the
// VM booted and plugs it into a free slot of the hot-plug bridge. On error
// everything it did is undone. With idx and lazy set (a lazy image's tree
// and store) the disk is built from idx and reads through lazy; the disk
// owns lazy (closes it when removed) once it is plugged, the caller until
// then.
func (b *imagefsBackend) hotplugDisk(ctx context.Context, cid string, rootfs config.Rootfs, idx *index.Index, lazy LazyRootfs) (_ *podDisk, err error) {
	s := b.s
	slot, err := s.vm.NextHotplugSlot()
	if err != nil {
		return nil, fmt.Errorf("container %s: disk hot-plug: %w", cid, err)
	}
	var opener index.Opener
	if lazy != nil {
		opener = lazy.Opener()
	}
	d, err := b.createDisk(ctx, cid, rootfs, idx, opener)
	if err != nil {
		if rerr := s.vm.ReleaseHotplugSlot(slot); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	d.slot, d.path = &slot, slot.Path
	defer func() {
		if err != nil {
			if uerr := b.unplugDisk(cid); uerr != nil {
				err = errors.Join(err, fmt.Errorf("undo hot-plug: %w", uerr))
			}
		}
	}()
	q := s.vm.QMP()
	// QEMU connects to our server as soon as the chardev exists.
	if err := q.ChardevAddSocket(ctx, d.chardevID(), d.Socket); err != nil {
		return nil, s.Explain(fmt.Errorf("container %s: chardev-add %s: %w", cid, d.chardevID(), err))
	}
	d.chardevAdded = true
	c := s.cfg.KataFSX.ImagefsBlk
	props := slot.Props()
	props["chardev"] = d.chardevID()
	props["num-queues"] = c.NumQueues
	props["queue-size"] = c.QueueSize
	if err := q.DeviceAdd(ctx, "vhost-user-blk-pci", d.deviceID, props); err != nil {
		return nil, s.Explain(fmt.Errorf("container %s: device_add vhost-user-blk-pci %s: %w", cid, d.deviceID, err))
	}
	d.deviceAdded = true
	// The allocator's idea of the path must be QEMU's, or the agent waits
	// for a disk at the wrong address.
	got, err := s.vm.DevicePCIPath(ctx, d.deviceID)
	if err != nil {
		return nil, s.Explain(fmt.Errorf("container %s: %w", cid, err))
	}
	if got != slot.Path {
		return nil, fmt.Errorf("container %s: device %s is at PCI path %s, expected %s", cid, d.deviceID, got, slot.Path)
	}
	d.lazy = lazy
	log.G(ctx).WithField("sandbox", s.ID).Infof("container %s: disk %s hot-plugged at PCI path %s", cid, d.deviceID, got)
	return d, nil
}

// unplugDisk removes a hot-plugged disk: device_del (waiting for the
// guest to release it), chardev-remove, the slot, then the disk files. A
// step that fails leaves the disk registered for Stop to remove. A
// cold-plugged disk (the first container's) cannot leave the root bus and
// stays until Stop.
func (b *imagefsBackend) unplugDisk(cid string) error {
	s := b.s
	s.mu.Lock()
	d, ok := b.disks[cid]
	if ok && d.slot != nil {
		delete(b.disks, cid)
	}
	s.mu.Unlock()
	if !ok || d.slot == nil {
		return nil
	}
	err := b.unplug(d)
	if err != nil {
		s.mu.Lock()
		if s.state == StateStopping || s.state == StateStopped {
			// Stop has quit QEMU or is about to: the disk can go now.
			s.mu.Unlock()
			return errors.Join(err, d.remove())
		}
		b.disks[cid] = d
		s.mu.Unlock()
		return fmt.Errorf("container %s: disk %s stays until the sandbox stops: %w", cid, d.deviceID, err)
	}
	log.G(s.life).WithField("sandbox", s.ID).Infof("container %s: disk %s unplugged and removed", cid, d.deviceID)
	return nil
}

func (b *imagefsBackend) unplug(d *podDisk) error {
	s := b.s
	// Cleanup must run to the end even when the caller's request was cancelled.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(s.life), hotUnplugTimeout)
	defer cancel()
	q := s.vm.QMP()
	if d.deviceAdded {
		if err := q.DeviceDel(ctx, d.deviceID); err != nil {
			return s.Explain(fmt.Errorf("device_del %s: %w", d.deviceID, err))
		}
		d.deviceAdded = false
	}
	if d.chardevAdded {
		if err := q.ChardevRemove(ctx, d.chardevID()); err != nil {
			return s.Explain(fmt.Errorf("chardev-remove %s: %w", d.chardevID(), err))
		}
		d.chardevAdded = false
	}
	if d.slot != nil {
		if err := s.vm.ReleaseHotplugSlot(*d.slot); err != nil {
			return err
		}
		d.slot = nil
	}
	return d.remove()
}

// blkStorage is the storage the agent mounts a container's disk from, as
// Kata describes a block rootfs; the OCI root is its mount point.
func (b *imagefsBackend) blkStorage(d *podDisk, cid string) (*pb.Storage, string) {
	mp := virtiofs.GuestSharedMount + cid
	return &pb.Storage{Driver: "blk", Source: string(d.path), Fstype: "ext4", MountPoint: mp}, mp
}

// containerDisk returns the container's disk: the one cold-plugged at
// boot for the sandbox's first container, or a new one hot-plugged now.
func (b *imagefsBackend) containerDisk(ctx context.Context, cid string, rootfs config.Rootfs, idx *index.Index, lazy LazyRootfs) (*podDisk, error) {
	s := b.s
	s.mu.Lock()
	d, ok := b.disks[cid]
	s.mu.Unlock()
	if !ok {
		return b.hotplugDisk(ctx, cid, rootfs, idx, lazy)
	}
	if d.path == "" {
		p, ok := s.vm.Plan().PCIPaths[d.deviceID]
		if !ok {
			return nil, fmt.Errorf("container %s: device %s has no PCI path", cid, d.deviceID)
		}
		d.path = p
	}
	return d, nil
}
