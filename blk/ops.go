package blk

import "github.com/kata-fsx/kata-fsx/blk/vhostblk"

// Ops returns the disk's virtio-blk request counters by operation
// (requests, bytes, errors, latency), since the disk started serving.
func (d *Disk) Ops() vhostblk.OpStats { return vhostblk.ServerOps(d.srv) }
