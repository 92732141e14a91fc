package shim

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	pb "github.com/kata-fsx/kata-fsx/shim/agent/protocols"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// podDisk is an imagefs-blk disk of one container and its QEMU device.
type podDisk struct {
	*blk.Disk
	deviceID string
}

// blkOptions maps the [kata_fsx.imagefs_blk] table to disk options.
func blkOptions(c *config.Config) blk.Options {
	b := c.KataFSX.ImagefsBlk
	return blk.Options{
		CacheDir:     filepath.Join(b.StateDir, "cache"),
		WritableSize: int64(b.WritableSizeMB) << 20,
		BlockSize:    int(b.BlockSize),
		Journal:      b.Journal,
		JournalSize:  int64(b.JournalSizeMB) << 20,
		NumQueues:    int(b.NumQueues),
	}
}

// createDisk indexes and synthesizes a container's rootfs and serves it
// from the sandbox directory (0700), so only this pod's QEMU reaches it.
func (s *Sandbox) createDisk(ctx context.Context, cid string, rootfs config.Rootfs, idx *index.Index) (*podDisk, error) {
	if err := validSandboxID(cid); err != nil {
		return nil, err
	}
	if idx == nil && !rootfs.Indexable() {
		return nil, fmt.Errorf("container %s: imagefs-blk cannot index this rootfs: %s", cid, rootfs.Why)
	}
	dir := filepath.Join(s.Dir, "blk", cid)
	opts := blkOptions(s.cfg)
	// Sockets sit right in the sandbox directory: container ids can be
	// 64 bytes and unix socket paths only 107.
	opts.Socket = filepath.Join(s.Dir, fmt.Sprintf("blk%d.sock", len(s.disks)))
	var (
		d   *blk.Disk
		err error
	)
	if idx != nil {
		d, err = blk.CreateFromIndex(ctx, idx, dir, opts)
	} else {
		d, err = blk.Create(ctx, rootfs.Layers, dir, opts)
	}
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", cid, err)
	}
	pd := &podDisk{Disk: d, deviceID: fmt.Sprintf("imagefs-blk-%d", len(s.disks))}
	s.disks[cid] = pd
	return pd, nil
}

// blkStorage is the storage the agent mounts a container's disk from, as
// Kata describes a block rootfs; the OCI root is its mount point.
func (s *Sandbox) blkStorage(cid string) (*pb.Storage, string, error) {
	d, ok := s.disks[cid]
	if !ok {
		return nil, "", fmt.Errorf("container %s: no imagefs-blk disk: containers created after the sandbox need disk hot-plug, which the shim issue delivers", cid)
	}
	path, ok := s.vm.Plan().PCIPaths[d.deviceID]
	if !ok {
		return nil, "", fmt.Errorf("container %s: device %s has no PCI path", cid, d.deviceID)
	}
	mp := virtiofs.GuestSharedMount + cid
	return &pb.Storage{Driver: "blk", Source: string(path), Fstype: "ext4", MountPoint: mp}, mp, nil
}
