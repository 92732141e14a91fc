// Package vhostusertest plays QEMU's part of the vhost-user protocol in
// tests of devices built on package vhostuser: it dials the device's
// socket, negotiates features, shares memfd guest memory with SCM_RIGHTS,
// lays out rings with virtq/testdriver in that memory and drives them
// with kick and call eventfds. It is test support only: it trusts its
// caller and fails the test on any unexpected reply.
package vhostusertest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	vu "github.com/kata-fsx/kata-fsx/vhostuser"
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

	// Wait bounds every wait of the frontend: a hang guard, not a timing assertion.
	Wait = 20 * time.Second
)

// Region is one region of the frontend's guest memory: a memfd mapped on
// the frontend side too.
type Region struct {
	FD            int
	GPA, Size, VA uint64
	Off           uint64
	Mapping       []byte
}

// Frontend is one front-end connection to a device's socket.
type Frontend struct {
	t       testing.TB
	Conn    *net.UnixConn
	Regions []Region
	Mem     *virtq.Memory
	Proto   uint64
	Feat    uint64
}

// Dial connects to the device socket at path; the connection closes when the test ends.
func Dial(t testing.TB, path string) *Frontend {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	f := &Frontend{t: t, Conn: c}
	t.Cleanup(f.Close)
	return f
}

// Close hangs up and unmaps the frontend's guest memory.
func (f *Frontend) Close() {
	if f.Conn != nil {
		f.Conn.Close()
		f.Conn = nil
	}
	for _, r := range f.Regions {
		unix.Munmap(r.Mapping)
		unix.Close(r.FD)
	}
	f.Regions = nil
}

// SendRaw writes raw bytes with descriptors attached.
func (f *Frontend) SendRaw(b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := f.Conn.WriteMsgUnix(b, oob, nil)
	return err
}

// Send writes one message with descriptors attached.
func (f *Frontend) Send(req vu.Request, flags uint32, payload []byte, fds ...int) error {
	b := make([]byte, vu.HeaderSize+len(payload))
	vu.EncodeHeader(b, vu.Header{Req: req, Flags: flags, Size: uint32(len(payload))})
	copy(b[vu.HeaderSize:], payload)
	return f.SendRaw(b, fds...)
}

// ReadReply reads the reply to req and checks its header.
func (f *Frontend) ReadReply(req vu.Request) ([]byte, error) {
	f.Conn.SetReadDeadline(time.Now().Add(Wait))
	var hb [vu.HeaderSize]byte
	if _, err := io.ReadFull(f.Conn, hb[:]); err != nil {
		return nil, err
	}
	h := vu.DecodeHeader(hb[:])
	if h.Req != req || h.Flags != vu.FlagVersion|vu.FlagReply || h.Size > vu.MaxPayload {
		return nil, fmt.Errorf("bad reply header %+v to %v", h, req)
	}
	p := make([]byte, h.Size)
	if _, err := io.ReadFull(f.Conn, p); err != nil {
		return nil, err
	}
	return p, nil
}

// Get sends a request that has its own reply and returns the reply payload.
func (f *Frontend) Get(req vu.Request, payload []byte) []byte {
	f.t.Helper()
	if err := f.Send(req, vu.FlagVersion, payload); err != nil {
		f.t.Fatalf("send %v: %v", req, err)
	}
	p, err := f.ReadReply(req)
	if err != nil {
		f.t.Fatalf("%v reply: %v", req, err)
	}
	return p
}

// Set sends a request without its own reply, asking for an ack when
// REPLY_ACK is negotiated; it returns the ack value (0 when not asked).
func (f *Frontend) Set(req vu.Request, payload []byte, fds ...int) uint64 {
	f.t.Helper()
	flags := uint32(vu.FlagVersion)
	ack := f.Proto&(1<<vu.ProtoReplyAck) != 0
	if ack {
		flags |= vu.FlagNeedReply
	}
	if err := f.Send(req, flags, payload, fds...); err != nil {
		f.t.Fatalf("send %v: %v", req, err)
	}
	if !ack {
		return 0
	}
	p, err := f.ReadReply(req)
	if err != nil || len(p) != 8 {
		f.t.Fatalf("%v ack: %v (%d bytes)", req, err, len(p))
	}
	return binary.LittleEndian.Uint64(p)
}

// MustSet is Set failing the test on a nack.
func (f *Frontend) MustSet(req vu.Request, payload []byte, fds ...int) {
	f.t.Helper()
	if v := f.Set(req, payload, fds...); v != 0 {
		f.t.Fatalf("%v nacked (%d)", req, v)
	}
}

// ExpectClosed asserts the server dropped the connection.
func (f *Frontend) ExpectClosed() {
	f.t.Helper()
	f.Conn.SetReadDeadline(time.Now().Add(Wait))
	var b [64]byte
	for {
		_, err := f.Conn.Read(b[:])
		if errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
			return
		}
		if err != nil {
			f.t.Fatalf("waiting for the server to close: %v", err)
		}
	}
}

// Le64 encodes v as a little-endian u64 payload.
func Le64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

// State encodes a vhost_vring_state payload.
func State(idx, num uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, idx)
	return binary.LittleEndian.AppendUint32(b, num)
}

// Negotiate runs the feature handshake QEMU performs; clear holds virtio
// feature bits to clear from what the device offers. It returns the offer.
func (f *Frontend) Negotiate(clear uint64) uint64 {
	f.t.Helper()
	return f.NegotiateProto(clear, 0)
}

// NegotiateProto is Negotiate acking extra protocol features too.
func (f *Frontend) NegotiateProto(clear, extraProto uint64) uint64 {
	f.t.Helper()
	offered := binary.LittleEndian.Uint64(f.Get(vu.ReqGetFeatures, nil))
	if offered&(1<<vu.FeatProtocolFeatures) == 0 {
		f.t.Fatal("VHOST_USER_F_PROTOCOL_FEATURES not offered")
	}
	proto := binary.LittleEndian.Uint64(f.Get(vu.ReqGetProtocolFeatures, nil))
	want := uint64(1<<vu.ProtoMQ|1<<vu.ProtoReplyAck|1<<vu.ProtoConfig) | extraProto
	if proto&want != want {
		f.t.Fatalf("protocol features %#x lack %#x", proto, want)
	}
	f.MustSet(vu.ReqSetProtocolFeatures, Le64(want))
	f.Proto = want
	f.MustSet(vu.ReqSetOwner, nil)
	f.Feat = offered &^ clear
	f.MustSet(vu.ReqSetFeatures, Le64(f.Feat))
	return offered
}

// MakeRegions creates the two memfd regions and maps them on the frontend
// side; it returns each region's VhostUserMemoryRegion encoding.
func (f *Frontend) MakeRegions() [][]byte {
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
		f.Regions = append(f.Regions, Region{FD: fd, GPA: s.gpa, Size: feRegionSize, VA: s.va, Off: s.off, Mapping: m})
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
	f.Mem = mem
	return enc
}

// SetupMemory creates two memfd regions and sends SET_MEM_TABLE.
func (f *Frontend) SetupMemory() {
	f.t.Helper()
	enc := f.MakeRegions()
	payload := binary.LittleEndian.AppendUint32(nil, uint32(len(enc)))
	payload = binary.LittleEndian.AppendUint32(payload, 0)
	var fds []int
	for i, e := range enc {
		payload = append(payload, e...)
		fds = append(fds, f.Regions[i].FD)
	}
	f.MustSet(vu.ReqSetMemTable, payload, fds...)
}

// VA translates a guest address of the test memory to the made-up front-end address.
func (f *Frontend) VA(gpa uint64) uint64 {
	for _, r := range f.Regions {
		if gpa >= r.GPA && gpa < r.GPA+r.Size {
			return r.VA + gpa - r.GPA
		}
	}
	f.t.Fatalf("gpa %#x not in test memory", gpa)
	return 0
}

// Queue is one queue driven by the frontend.
type Queue struct {
	F        *Frontend
	Idx      int
	Drv      *testdriver.Driver
	KickFd   int
	CallFd   int
	ErrFd    int
	bufLo    uint64
	bufHi    uint64
	bufNext  uint64
	Indirect bool
}

// StartQueue lays out queue idx's rings, sends the vring messages in QEMU's
// order and enables it. Each queue gets its own buffer area; queue 0's
// straddles the boundary between the two regions. Queues 0..3 fit; queue
// sizes up to 1024.
func (f *Frontend) StartQueue(idx int, size uint16) *Queue {
	f.t.Helper()
	desc, avail, used, _ := testdriver.Layout(uint64(idx)*0x10000, size)
	q := &Queue{F: f, Idx: idx, Drv: testdriver.New(f.Mem, size, desc, avail, used)}
	if idx > 3 || size > 1024 {
		f.t.Fatalf("vhostusertest: queue %d of size %d does not fit the test memory", idx, size)
	}
	q.bufLo = 0xC0000 + uint64(idx)*0x80000
	q.bufHi = q.bufLo + 0x80000
	if idx >= 2 {
		q.bufLo = 0x40000 + uint64(idx-2)*0x40000
		q.bufHi = q.bufLo + 0x40000
	}
	q.bufNext = q.bufLo
	var err error
	if q.KickFd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	if q.CallFd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	if q.ErrFd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { unix.Close(q.KickFd); unix.Close(q.CallFd); unix.Close(q.ErrFd) })
	f.MustSet(vu.ReqSetVringCall, Le64(uint64(idx)), q.CallFd)
	f.MustSet(vu.ReqSetVringErr, Le64(uint64(idx)), q.ErrFd)
	f.MustSet(vu.ReqSetVringNum, State(uint32(idx), uint32(size)))
	f.MustSet(vu.ReqSetVringBase, State(uint32(idx), 0))
	addr := binary.LittleEndian.AppendUint32(nil, uint32(idx))
	addr = binary.LittleEndian.AppendUint32(addr, 0)
	for _, v := range []uint64{f.VA(desc), f.VA(used), f.VA(avail), 0} {
		addr = binary.LittleEndian.AppendUint64(addr, v)
	}
	f.MustSet(vu.ReqSetVringAddr, addr)
	f.MustSet(vu.ReqSetVringKick, Le64(uint64(idx)), q.KickFd)
	f.MustSet(vu.ReqSetVringEnable, State(uint32(idx), 1))
	return q
}

// Alloc returns n bytes of guest memory from the queue's buffer area.
func (q *Queue) Alloc(n uint64, align uint64) uint64 {
	a := (q.bufNext + align - 1) &^ (align - 1)
	if a+n > q.bufHi {
		a = q.bufLo
	}
	q.bufNext = a + n
	return a
}

// Kick notifies the device (writes the kick eventfd).
func (q *Queue) Kick() {
	if _, err := unix.Write(q.KickFd, Le64(1)); err != nil {
		q.F.t.Fatal(err)
	}
}

// WaitUsed waits for the next used element, watching the call eventfd but
// also re-checking the ring, since notifications may be suppressed.
func (q *Queue) WaitUsed() (uint32, uint32) {
	q.F.t.Helper()
	deadline := time.Now().Add(Wait)
	for {
		if id, n, ok := q.Drv.Used(); ok {
			return id, n
		}
		if time.Now().After(deadline) {
			q.F.t.Fatalf("queue %d: no used element", q.Idx)
		}
		// As a real driver does before sleeping: ask to be interrupted at the
		// next used element (EVENT_IDX), then re-check the ring.
		q.Drv.SetUsedEvent(q.Drv.LastUsed())
		if id, n, ok := q.Drv.Used(); ok {
			return id, n
		}
		fds := []unix.PollFd{{Fd: int32(q.CallFd), Events: unix.POLLIN}}
		unix.Poll(fds, 5)
		var b [8]byte
		unix.Read(q.CallFd, b[:])
	}
}

// Publish writes bufs as a chain (indirect if the queue says so) and publishes it.
func (q *Queue) Publish(bufs []testdriver.Buf) uint16 {
	var head uint16
	if q.Indirect {
		table := q.Alloc(uint64(16*len(bufs)), 16)
		head = q.Drv.IndirectChain(table, bufs...)
	} else {
		head = q.Drv.Chain(bufs...)
	}
	q.Drv.Publish(head)
	return head
}
