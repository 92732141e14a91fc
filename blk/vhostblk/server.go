// Package vhostblk serves a virtio-blk device to QEMU over the vhost-user
// protocol (QEMU docs/interop/vhost-user.rst) on a unix socket: QEMU's
// `-chardev socket,path=SOCK -device vhost-user-blk-pci,chardev=...`
// connects, shares guest RAM (which must be share=on), and this backend
// processes the virtqueues in-process, one worker per started queue. The
// protocol itself (the session, message gate, memory table and vrings) is
// the device-generic core of package github.com/kata-fsx/kata-fsx/vhostuser;
// this package is the virtio-blk device on it.
//
// One front-end connection is served at a time; when it goes away (QEMU
// quits or reconnects) queues stop, guest memory is unmapped, descriptors
// are closed and the next connection is accepted.
//
// Typical use, with the copy-on-write overlay as the device:
//
//	dev, err := overlay.Open(base, size, "/var/lib/kata-fsx/<sandbox>/disk.overlay", overlay.Options{Serial: id})
//	srv, err := vhostblk.Serve(ctx, "/run/kata-fsx/<sandbox>/blk/disk.sock", dev, vhostblk.Options{NumQueues: vcpus})
//	// qemu ... -object memory-backend-memfd,...,share=on -numa node,memdev=...
//	//      -chardev socket,id=c,path=/run/kata-fsx/<sandbox>/blk/disk.sock
//	//      -device vhost-user-blk-pci,chardev=c,num-queues=<vcpus>
//	defer srv.Close()
//	defer dev.Close()
//
// Supported: VERSION_1, INDIRECT_DESC, EVENT_IDX (from the core),
// BLK_F_SEG_MAX, BLK_SIZE, FLUSH, MQ, DISCARD, WRITE_ZEROES (RO instead of
// the last two when the device is read-only); the core's protocol features.
package vhostblk

import (
	"context"
	"errors"
	"fmt"

	"github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// Defaults for Options fields left zero.
const (
	DefaultNumQueues        = 8
	DefaultSegMax           = 126
	DefaultLogicalBlockSize = 512
	DefaultMaxRequestBytes  = 32 << 20
	defaultMaxDiscard       = 1 << 21 // sectors (1 GiB)
	defaultMaxDiscardSeg    = 32
)

// Options tune Serve; zero values pick the defaults.
type Options struct {
	// NumQueues is the most queues the device offers (GET_QUEUE_NUM, config
	// num_queues); QEMU's num-queues must not exceed it. Default 8.
	NumQueues int
	// SegMax is the most data segments per request (config seg_max). Default 126.
	SegMax int
	// LogicalBlockSize is reported as blk_size (512 or a larger power of two). Default 512.
	LogicalBlockSize int
	// DiscardAlignment is the discard granularity in bytes (config
	// discard_sector_alignment); default 4096, the overlay's block size.
	DiscardAlignment int
	// MaxRequestBytes caps the data of one read or write request; larger
	// requests fail with IOERR. Default 32 MiB.
	MaxRequestBytes int
	// Logf receives diagnostics (protocol errors, broken queues); nil discards them.
	Logf func(format string, args ...any)
}

// Server is a running vhost-user-blk backend (the core's server).
type Server = vhostuser.Server

// Stats counts connections for monitoring and tests.
type Stats = vhostuser.Stats

// Serve listens on socketPath and serves dev until ctx ends or Close is
// called. The socket's directory is created mode 0700 if missing; if it
// exists it must be a directory owned by this user and not writable by
// group or others, because the socket itself grants full access to the
// disk and the directory is what keeps other users out. The socket is
// created mode 0600.
func Serve(ctx context.Context, socketPath string, dev BlockDevice, opts Options) (*Server, error) {
	d, err := newBlkDevice(dev, &opts)
	if err != nil {
		return nil, err
	}
	return vhostuser.Serve(ctx, socketPath, d, vhostuser.Options{Logf: opts.Logf})
}

// newBlkDevice applies the defaults to o and builds the device.
func newBlkDevice(dev BlockDevice, o *Options) (*blkDevice, error) {
	if dev == nil {
		return nil, errors.New("vhostblk: nil device")
	}
	cfg, err := buildConfig(dev, o)
	if err != nil {
		return nil, err
	}
	h := blkHandler{dev: dev, cfg: cfg, logf: o.Logf, shards: make([]counterShard, cfg.numQueues)}
	return &blkDevice{h: h, space: cfg.configSpace()}, nil
}

func buildConfig(dev BlockDevice, o *Options) (blkConfig, error) {
	if o.NumQueues == 0 {
		o.NumQueues = DefaultNumQueues
	}
	if o.SegMax == 0 {
		o.SegMax = DefaultSegMax
	}
	if o.LogicalBlockSize == 0 {
		o.LogicalBlockSize = DefaultLogicalBlockSize
	}
	if o.DiscardAlignment == 0 {
		o.DiscardAlignment = 4096
	}
	if o.MaxRequestBytes == 0 {
		o.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	switch {
	case o.NumQueues < 1 || o.NumQueues > 256:
		return blkConfig{}, fmt.Errorf("vhostblk: %d queues, want 1..256", o.NumQueues)
	case o.SegMax < 1 || o.SegMax > virtq.MaxSize:
		return blkConfig{}, fmt.Errorf("vhostblk: seg_max %d out of range", o.SegMax)
	case o.LogicalBlockSize < 512 || o.LogicalBlockSize&(o.LogicalBlockSize-1) != 0 || o.LogicalBlockSize > 1<<16:
		return blkConfig{}, fmt.Errorf("vhostblk: logical block size %d is not a power of two in 512..65536", o.LogicalBlockSize)
	case o.DiscardAlignment < 512 || o.DiscardAlignment%512 != 0:
		return blkConfig{}, fmt.Errorf("vhostblk: discard alignment %d is not a multiple of 512", o.DiscardAlignment)
	case o.MaxRequestBytes < 4096 || o.MaxRequestBytes > 1<<30:
		return blkConfig{}, fmt.Errorf("vhostblk: max request %d out of range", o.MaxRequestBytes)
	}
	size := dev.Size()
	if size <= 0 || size%int64(o.LogicalBlockSize) != 0 {
		return blkConfig{}, fmt.Errorf("vhostblk: device size %d is not a positive multiple of %d", size, o.LogicalBlockSize)
	}
	return blkConfig{
		capacity:          uint64(size) / sectorSize,
		segMax:            uint32(o.SegMax),
		blkSize:           uint32(o.LogicalBlockSize),
		numQueues:         uint16(o.NumQueues),
		maxDiscardSectors: defaultMaxDiscard,
		maxDiscardSeg:     defaultMaxDiscardSeg,
		discardAlign:      uint32(o.DiscardAlignment / sectorSize),
		maxWZSectors:      defaultMaxDiscard,
		maxWZSeg:          defaultMaxDiscardSeg,
		maxRequestBytes:   uint64(o.MaxRequestBytes),
		readOnly:          dev.ReadOnly(),
	}, nil
}

// Virtio-blk feature bits (virtio 1.2 section 5.2.3).
const (
	featBlkSegMax      = 2
	featBlkRO          = 5
	featBlkBlkSize     = 6
	featBlkFlush       = 9
	featBlkMQ          = 12
	featBlkDiscard     = 13
	featBlkWriteZeroes = 14
)

// blkDevice is the virtio-blk device the core serves.
type blkDevice struct {
	h     blkHandler
	space [blkConfigSize]byte
}

// Features implements vhostuser.Device.
func (d *blkDevice) Features() uint64 {
	f := uint64(1<<featBlkSegMax | 1<<featBlkBlkSize | 1<<featBlkFlush | 1<<featBlkMQ)
	if d.h.cfg.readOnly {
		f |= 1 << featBlkRO
	} else {
		f |= 1<<featBlkDiscard | 1<<featBlkWriteZeroes
	}
	return f
}

// NumQueues implements vhostuser.Device.
func (d *blkDevice) NumQueues() int { return int(d.h.cfg.numQueues) }

// ReadConfig implements vhostuser.Device.
func (d *blkDevice) ReadConfig(offset uint32, p []byte) {
	if offset < uint32(len(d.space)) {
		copy(p, d.space[offset:])
	}
}

// RunQueue implements vhostuser.Device.
func (d *blkDevice) RunQueue(q *vhostuser.Queue) {
	// The core starts no queue at or past NumQueues; the clamp keeps a
	// counter shard for every index all the same.
	runWorker(&d.h, q, &d.h.shards[min(max(q.Index(), 0), len(d.h.shards)-1)])
}

// Disconnect implements vhostuser.Device: virtio-blk keeps no per-connection state.
func (d *blkDevice) Disconnect() {}
