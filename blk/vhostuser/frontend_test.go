package vhostuser

// The test frontend plays QEMU's part over a real unix socket: memfd guest
// memory passed with SCM_RIGHTS, feature negotiation, rings laid out by
// testdriver in that shared memory, kick/call eventfds.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// Guest memory of the test frontend: two adjacent regions, the second at a
// nonzero mmap offset inside its memfd, with made-up front-end addresses.
const (
	feRegion0GPA = 0x0
	feRegion1GPA = 0x100000
	feRegionSize = 0x100000
	feRegion1Off = 0x10000
	feVA0        = 0x7f0000000000
	feVA1        = 0x7f0040000000
	feWait       = 20 * time.Second // hang guard, not a timing assertion
)

type frontRegion struct {
	fd            int
	gpa, size, va uint64
	off           uint64
	mapping       []byte
}

type testFrontend struct {
	t       testing.TB
	conn    *net.UnixConn
	regions []frontRegion
	mem     *virtq.Memory
	proto   uint64
	feat    uint64
}

func dialFrontend(t testing.TB, path string) *testFrontend {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	f := &testFrontend{t: t, conn: c}
	t.Cleanup(f.close)
	return f
}

func (f *testFrontend) close() {
	if f.conn != nil {
		f.conn.Close()
		f.conn = nil
	}
	for _, r := range f.regions {
		unix.Munmap(r.mapping)
		unix.Close(r.fd)
	}
	f.regions = nil
}

// sendRaw writes raw bytes with descriptors attached.
func (f *testFrontend) sendRaw(b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := f.conn.WriteMsgUnix(b, oob, nil)
	return err
}

func (f *testFrontend) send(req request, flags uint32, payload []byte, fds ...int) error {
	b := make([]byte, headerSize+len(payload))
	encodeHeader(b, header{req: req, flags: flags, size: uint32(len(payload))})
	copy(b[headerSize:], payload)
	return f.sendRaw(b, fds...)
}

func (f *testFrontend) readReply(req request) ([]byte, error) {
	f.conn.SetReadDeadline(time.Now().Add(feWait))
	var hb [headerSize]byte
	if _, err := io.ReadFull(f.conn, hb[:]); err != nil {
		return nil, err
	}
	h := decodeHeader(hb[:])
	if h.req != req || h.flags != flagVersion|flagReply || h.size > maxPayload {
		return nil, fmt.Errorf("bad reply header %+v to %v", h, req)
	}
	p := make([]byte, h.size)
	if _, err := io.ReadFull(f.conn, p); err != nil {
		return nil, err
	}
	return p, nil
}

// get sends a request that has its own reply and returns the reply payload.
func (f *testFrontend) get(req request, payload []byte) []byte {
	f.t.Helper()
	if err := f.send(req, flagVersion, payload); err != nil {
		f.t.Fatalf("send %v: %v", req, err)
	}
	p, err := f.readReply(req)
	if err != nil {
		f.t.Fatalf("%v reply: %v", req, err)
	}
	return p
}

// set sends a request without its own reply, asking for an ack when
// REPLY_ACK is negotiated; it returns the ack value (0 when not asked).
func (f *testFrontend) set(req request, payload []byte, fds ...int) uint64 {
	f.t.Helper()
	flags := uint32(flagVersion)
	ack := f.proto&(1<<protoReplyAck) != 0
	if ack {
		flags |= flagNeedReply
	}
	if err := f.send(req, flags, payload, fds...); err != nil {
		f.t.Fatalf("send %v: %v", req, err)
	}
	if !ack {
		return 0
	}
	p, err := f.readReply(req)
	if err != nil || len(p) != 8 {
		f.t.Fatalf("%v ack: %v (%d bytes)", req, err, len(p))
	}
	return binary.LittleEndian.Uint64(p)
}

func (f *testFrontend) mustSet(req request, payload []byte, fds ...int) {
	f.t.Helper()
	if v := f.set(req, payload, fds...); v != 0 {
		f.t.Fatalf("%v nacked (%d)", req, v)
	}
}

// expectClosed asserts the server dropped the connection.
func (f *testFrontend) expectClosed() {
	f.t.Helper()
	f.conn.SetReadDeadline(time.Now().Add(feWait))
	var b [64]byte
	for {
		_, err := f.conn.Read(b[:])
		if errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
			return
		}
		if err != nil {
			f.t.Fatalf("waiting for the server to close: %v", err)
		}
	}
}

func le64b(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func state(idx, num uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, idx)
	return binary.LittleEndian.AppendUint32(b, num)
}

// negotiate runs the feature handshake QEMU performs; extra are virtio
// feature bits to clear from what the device offers.
func (f *testFrontend) negotiate(clear uint64) uint64 {
	f.t.Helper()
	return f.negotiateProto(clear, 0)
}

// negotiateProto is negotiate acking extra protocol features too.
func (f *testFrontend) negotiateProto(clear, extraProto uint64) uint64 {
	f.t.Helper()
	offered := binary.LittleEndian.Uint64(f.get(reqGetFeatures, nil))
	if offered&(1<<featProtocol) == 0 {
		f.t.Fatal("VHOST_USER_F_PROTOCOL_FEATURES not offered")
	}
	proto := binary.LittleEndian.Uint64(f.get(reqGetProtocolFeatures, nil))
	want := uint64(1<<protoMQ|1<<protoReplyAck|1<<protoConfig) | extraProto
	if proto&want != want {
		f.t.Fatalf("protocol features %#x lack %#x", proto, want)
	}
	f.mustSet(reqSetProtocolFeatures, le64b(want))
	f.proto = want
	f.mustSet(reqSetOwner, nil)
	f.feat = offered &^ clear
	f.mustSet(reqSetFeatures, le64b(f.feat))
	return offered
}

// makeRegions creates the two memfd regions and maps them on the frontend
// side; it returns each region's VhostUserMemoryRegion encoding.
func (f *testFrontend) makeRegions() [][]byte {
	f.t.Helper()
	specs := []struct{ gpa, va, off uint64 }{{feRegion0GPA, feVA0, 0}, {feRegion1GPA, feVA1, feRegion1Off}}
	var vr []virtq.Region
	var enc [][]byte
	for i, s := range specs {
		fd, err := unix.MemfdCreate(fmt.Sprintf("guest%d", i), unix.MFD_CLOEXEC)
		if err != nil {
			f.t.Fatalf("memfd: %v", err)
		}
		total := s.off + feRegionSize
		if err := unix.Ftruncate(fd, int64(total)); err != nil {
			f.t.Fatal(err)
		}
		m, err := unix.Mmap(fd, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			f.t.Fatal(err)
		}
		f.regions = append(f.regions, frontRegion{fd: fd, gpa: s.gpa, size: feRegionSize, va: s.va, off: s.off, mapping: m})
		vr = append(vr, virtq.Region{GuestAddr: s.gpa, Size: feRegionSize, UserAddr: s.va, MmapOffset: s.off, Data: m[s.off:]})
		var e []byte
		for _, v := range []uint64{s.gpa, feRegionSize, s.va, s.off} {
			e = binary.LittleEndian.AppendUint64(e, v)
		}
		enc = append(enc, e)
	}
	mem, err := virtq.NewMemory(vr)
	if err != nil {
		f.t.Fatal(err)
	}
	f.mem = mem
	return enc
}

// setupMemory creates two memfd regions and sends SET_MEM_TABLE.
func (f *testFrontend) setupMemory() {
	f.t.Helper()
	enc := f.makeRegions()
	payload := binary.LittleEndian.AppendUint32(nil, uint32(len(enc)))
	payload = binary.LittleEndian.AppendUint32(payload, 0)
	var fds []int
	for i, e := range enc {
		payload = append(payload, e...)
		fds = append(fds, f.regions[i].fd)
	}
	f.mustSet(reqSetMemTable, payload, fds...)
}

func (f *testFrontend) va(gpa uint64) uint64 {
	for _, r := range f.regions {
		if gpa >= r.gpa && gpa < r.gpa+r.size {
			return r.va + gpa - r.gpa
		}
	}
	f.t.Fatalf("gpa %#x not in test memory", gpa)
	return 0
}

// testQueue is one queue driven by the frontend.
type testQueue struct {
	f        *testFrontend
	idx      int
	drv      *testdriver.Driver
	kick     int
	call     int
	errFd    int
	bufLo    uint64
	bufHi    uint64
	bufNext  uint64
	indirect bool
}

// startQueue lays out queue idx's rings, sends the vring messages in QEMU's
// order and enables it. Each queue gets its own buffer area; queue 0's
// straddles the boundary between the two regions.
func (f *testFrontend) startQueue(idx int, size uint16) *testQueue {
	f.t.Helper()
	desc, avail, used, _ := testdriver.Layout(uint64(idx)*0x10000, size)
	q := &testQueue{f: f, idx: idx, drv: testdriver.New(f.mem, size, desc, avail, used)}
	q.bufLo = 0xC0000 + uint64(idx)*0x80000
	q.bufHi = q.bufLo + 0x80000
	q.bufNext = q.bufLo
	var err error
	if q.kick, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	if q.call, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	if q.errFd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { unix.Close(q.kick); unix.Close(q.call); unix.Close(q.errFd) })
	f.mustSet(reqSetVringCall, le64b(uint64(idx)), q.call)
	f.mustSet(reqSetVringErr, le64b(uint64(idx)), q.errFd)
	f.mustSet(reqSetVringNum, state(uint32(idx), uint32(size)))
	f.mustSet(reqSetVringBase, state(uint32(idx), 0))
	addr := binary.LittleEndian.AppendUint32(nil, uint32(idx))
	addr = binary.LittleEndian.AppendUint32(addr, 0)
	for _, v := range []uint64{f.va(desc), f.va(used), f.va(avail), 0} {
		addr = binary.LittleEndian.AppendUint64(addr, v)
	}
	f.mustSet(reqSetVringAddr, addr)
	f.mustSet(reqSetVringKick, le64b(uint64(idx)), q.kick)
	f.mustSet(reqSetVringEnable, state(uint32(idx), 1))
	return q
}

// alloc returns n bytes of guest memory from the queue's buffer area.
func (q *testQueue) alloc(n uint64, align uint64) uint64 {
	a := (q.bufNext + align - 1) &^ (align - 1)
	if a+n > q.bufHi {
		a = q.bufLo
	}
	q.bufNext = a + n
	return a
}

func (q *testQueue) kickIt() {
	if _, err := unix.Write(q.kick, le64b(1)); err != nil {
		q.f.t.Fatal(err)
	}
}

// waitUsed waits for the next used element, watching the call eventfd but
// also re-checking the ring, since notifications may be suppressed.
func (q *testQueue) waitUsed() (uint32, uint32) {
	q.f.t.Helper()
	deadline := time.Now().Add(feWait)
	for {
		if id, n, ok := q.drv.Used(); ok {
			return id, n
		}
		if time.Now().After(deadline) {
			q.f.t.Fatalf("queue %d: no used element", q.idx)
		}
		// As a real driver does before sleeping: ask to be interrupted at the
		// next used element (EVENT_IDX), then re-check the ring.
		q.drv.SetUsedEvent(q.drv.LastUsed())
		if id, n, ok := q.drv.Used(); ok {
			return id, n
		}
		fds := []unix.PollFd{{Fd: int32(q.call), Events: unix.POLLIN}}
		unix.Poll(fds, 5)
		var b [8]byte
		unix.Read(q.call, b[:])
	}
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
	q.f.t.Helper()
	p := q.prepare(typ, sector, out, inLen)
	q.kickIt()
	id, n := q.waitUsed()
	if id != uint32(p.head) {
		q.f.t.Fatalf("used id %d, want head %d", id, p.head)
	}
	st, in := q.result(p)
	return st, in, n
}

// result reads a completed request's status byte and in data.
func (q *testQueue) result(p pendingReq) (byte, []byte) {
	var in []byte
	if p.inLen > 0 {
		in = q.drv.Read(p.inAddr, p.inLen)
	}
	return q.drv.Read(p.statusAddr, 1)[0], in
}

// prepare writes and publishes a request without kicking.
func (q *testQueue) prepare(typ uint32, sector uint64, out []byte, inLen int) pendingReq {
	q.f.t.Helper()
	hdr := make([]byte, 16)
	binary.LittleEndian.PutUint32(hdr[0:], typ)
	binary.LittleEndian.PutUint64(hdr[8:], sector)
	ha := q.alloc(16, 16)
	q.drv.Write(ha, hdr)
	bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
	if len(out) > 0 {
		a := q.alloc(uint64(len(out)), 8)
		q.drv.Write(a, out)
		bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(out))})
	}
	var inAddr uint64
	if inLen > 0 {
		inAddr = q.alloc(uint64(inLen), 8)
		q.drv.Write(inAddr, bytes.Repeat([]byte{0xEE}, inLen))
		bufs = append(bufs, testdriver.Buf{Addr: inAddr, Len: uint32(inLen), Write: true})
	}
	sa := q.alloc(1, 1)
	q.drv.Write(sa, []byte{0xFF})
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	return pendingReq{head: q.publish(bufs), inAddr: inAddr, inLen: inLen, statusAddr: sa}
}

// prepareWrite publishes a write whose data is split into segs, one
// descriptor each; with shareHeader the header and the first segment
// share one descriptor, as a driver may lay them out.
func (q *testQueue) prepareWrite(sector uint64, segs [][]byte, shareHeader bool) pendingReq {
	q.f.t.Helper()
	hdr := make([]byte, 16)
	binary.LittleEndian.PutUint32(hdr[0:], blkTypeOut)
	binary.LittleEndian.PutUint64(hdr[8:], sector)
	var bufs []testdriver.Buf
	for i, seg := range segs {
		if i == 0 && shareHeader {
			seg = append(bytes.Clone(hdr), seg...)
		}
		a := q.alloc(uint64(len(seg)), 8)
		q.drv.Write(a, seg)
		bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(seg))})
	}
	if !shareHeader || len(segs) == 0 {
		ha := q.alloc(16, 16)
		q.drv.Write(ha, hdr)
		bufs = append([]testdriver.Buf{{Addr: ha, Len: 16}}, bufs...)
	}
	sa := q.alloc(1, 1)
	q.drv.Write(sa, []byte{0xFF})
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	return pendingReq{head: q.publish(bufs), statusAddr: sa}
}

// publish writes bufs as a chain (indirect if the queue says so) and publishes it.
func (q *testQueue) publish(bufs []testdriver.Buf) uint16 {
	var head uint16
	if q.indirect {
		table := q.alloc(uint64(16*len(bufs)), 16)
		head = q.drv.IndirectChain(table, bufs...)
	} else {
		head = q.drv.Chain(bufs...)
	}
	q.drv.Publish(head)
	return head
}
