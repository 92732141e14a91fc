// Package blktest sends virtio-blk requests to an imagefs-blk server
// through vhostusertest's frontend, for the tests of the packages that
// serve or observe the device (blk, sandbox).
package blktest

import (
	"encoding/binary"

	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// Request sends one virtio-blk request of type typ at sector on q, with
// out as its device-readable payload and inLen device-writable bytes, waits
// for it to be used and returns its status byte.
func Request(q *vhostusertest.Queue, typ uint32, sector uint64, out []byte, inLen int) byte {
	hdr := binary.LittleEndian.AppendUint32(nil, typ)
	hdr = binary.LittleEndian.AppendUint32(hdr, 0)
	hdr = binary.LittleEndian.AppendUint64(hdr, sector)
	ha := q.Alloc(16, 16)
	q.Drv.Write(ha, hdr)
	bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
	if len(out) > 0 {
		a := q.Alloc(uint64(len(out)), 8)
		q.Drv.Write(a, out)
		bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(out))})
	}
	if inLen > 0 {
		bufs = append(bufs, testdriver.Buf{Addr: q.Alloc(uint64(inLen), 8), Len: uint32(inLen), Write: true})
	}
	sa := q.Alloc(1, 1)
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	q.Publish(bufs)
	q.Kick()
	q.WaitUsed()
	return q.Drv.Read(sa, 1)[0]
}
