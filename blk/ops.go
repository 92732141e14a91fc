package blk

import "github.com/kata-fsx/kata-fsx/blk/vhostuser"

// Ops returns the disk's virtio-blk request counters by operation
// (requests, bytes, errors, latency), since the disk started serving.
func (d *Disk) Ops() vhostuser.OpStats { return vhostuser.ServerOps(d.srv) }
