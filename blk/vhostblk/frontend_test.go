package vhostblk

// Virtio-blk requests on top of the core's test frontend (package
// vhostusertest), which plays QEMU's part over a real unix socket.

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// feWait bounds the tests' waits: a hang guard, not a timing assertion.
const feWait = vhostusertest.Wait

// testQueue is a frontend queue that speaks virtio-blk.
type testQueue struct {
	*vhostusertest.Queue
	t testing.TB
}

// startQueue starts queue idx on f and wraps it for virtio-blk requests.
func startQueue(t testing.TB, f *vhostusertest.Frontend, idx int, size uint16) *testQueue {
	t.Helper()
	return &testQueue{Queue: f.StartQueue(idx, size), t: t}
}

// pendingReq is a published request not yet completed.
type pendingReq struct {
	head       uint16
	inAddr     uint64
	inLen      int
	statusAddr uint64
}

// blkReq submits one virtio-blk request: header, out data, in space and a
// status byte, and returns the status, the in data and the used length.
func (q *testQueue) blkReq(typ uint32, sector uint64, out []byte, inLen int) (byte, []byte, uint32) {
	q.t.Helper()
	p := q.prepare(typ, sector, out, inLen)
	q.Kick()
	id, n := q.WaitUsed()
	if id != uint32(p.head) {
		q.t.Fatalf("used id %d, want head %d", id, p.head)
	}
	st, in := q.result(p)
	return st, in, n
}

// result reads a completed request's status byte and in data.
func (q *testQueue) result(p pendingReq) (byte, []byte) {
	var in []byte
	if p.inLen > 0 {
		in = q.Drv.Read(p.inAddr, p.inLen)
	}
	return q.Drv.Read(p.statusAddr, 1)[0], in
}

// prepare writes and publishes a request without kicking.
func (q *testQueue) prepare(typ uint32, sector uint64, out []byte, inLen int) pendingReq {
	q.t.Helper()
	hdr := make([]byte, 16)
	binary.LittleEndian.PutUint32(hdr[0:], typ)
	binary.LittleEndian.PutUint64(hdr[8:], sector)
	ha := q.Alloc(16, 16)
	q.Drv.Write(ha, hdr)
	bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
	if len(out) > 0 {
		a := q.Alloc(uint64(len(out)), 8)
		q.Drv.Write(a, out)
		bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(out))})
	}
	var inAddr uint64
	if inLen > 0 {
		inAddr = q.Alloc(uint64(inLen), 8)
		q.Drv.Write(inAddr, bytes.Repeat([]byte{0xEE}, inLen))
		bufs = append(bufs, testdriver.Buf{Addr: inAddr, Len: uint32(inLen), Write: true})
	}
	sa := q.Alloc(1, 1)
	q.Drv.Write(sa, []byte{0xFF})
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	return pendingReq{head: q.Publish(bufs), inAddr: inAddr, inLen: inLen, statusAddr: sa}
}

// prepareWrite publishes a write whose data is split into segs, one
// descriptor each; with shareHeader the header and the first segment
// share one descriptor, as a driver may lay them out.
func (q *testQueue) prepareWrite(sector uint64, segs [][]byte, shareHeader bool) pendingReq {
	q.t.Helper()
	hdr := make([]byte, 16)
	binary.LittleEndian.PutUint32(hdr[0:], blkTypeOut)
	binary.LittleEndian.PutUint64(hdr[8:], sector)
	var bufs []testdriver.Buf
	for i, seg := range segs {
		if i == 0 && shareHeader {
			seg = append(bytes.Clone(hdr), seg...)
		}
		a := q.Alloc(uint64(len(seg)), 8)
		q.Drv.Write(a, seg)
		bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(seg))})
	}
	if !shareHeader || len(segs) == 0 {
		ha := q.Alloc(16, 16)
		q.Drv.Write(ha, hdr)
		bufs = append([]testdriver.Buf{{Addr: ha, Len: 16}}, bufs...)
	}
	sa := q.Alloc(1, 1)
	q.Drv.Write(sa, []byte{0xFF})
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	return pendingReq{head: q.Publish(bufs), statusAddr: sa}
}
