package vsock

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
	vu "github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// connect runs the whole handshake: the client's CONNECT, the guest's
// RESPONSE and the client's OK line.
func (e *testEnv) connect(t *testing.T, g *testGuest, port uint32) (net.Conn, *guestConn) {
	t.Helper()
	client := e.dialHybrid(t, port)
	gc := g.accept(port)
	if got, want := readOK(t, client), "OK "+strconv.FormatUint(uint64(gc.hostPort), 10); got != want {
		t.Fatalf("hybrid reply %q, want %q", got, want)
	}
	return client, gc
}

func TestConfigAndFeatures(t *testing.T) {
	e := newEnv(t, Options{GuestCID: 0x1234_5678})
	f := vhostusertest.Dial(t, e.vhost)
	offered := f.Negotiate(0)
	const want = 1<<32 | 1<<28 | 1<<29 | 1<<30 // VERSION_1, INDIRECT_DESC, EVENT_IDX, PROTOCOL_FEATURES
	if offered != want {
		t.Errorf("features %#x, want %#x (no SEQPACKET)", offered, uint64(want))
	}
	cfg := append(binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, 0), 8), make([]byte, 4+8)...)
	p := f.Get(vu.ReqGetConfig, cfg)
	if got := binary.LittleEndian.Uint64(p[12:]); got != 0x1234_5678 {
		t.Errorf("guest_cid %#x", got)
	}
}

func TestServeOptions(t *testing.T) {
	dir := t.TempDir()
	for _, o := range []Options{{}, {GuestCID: 2}, {GuestCID: 0xffffffff}, {GuestCID: 3, BufferSize: 100}, {GuestCID: 3, MaxConnections: -1}} {
		if s, err := Serve(t.Context(), dir+"/v.sock", dir+"/h.sock", o); err == nil {
			s.Close()
			t.Errorf("options %+v accepted", o)
		}
	}
}

// TestStream: a hybrid client reaches a guest port; data flows both ways;
// the client's close becomes SHUTDOWN, the guest's close RST.
func TestStream(t *testing.T) {
	e := newEnv(t, Options{})
	g := e.boot(t, false)
	client, gc := e.connect(t, g, 1024)
	if gc.peerBuf != DefaultBufferSize || gc.peerFwdCnt != 0 {
		t.Errorf("REQUEST advertised buf_alloc %d fwd_cnt %d", gc.peerBuf, gc.peerFwdCnt)
	}

	// Host to guest.
	if _, err := client.Write([]byte("hello guest")); err != nil {
		t.Fatal(err)
	}
	h, p := g.recvOp(gc)
	if h.op != opRW || string(p) != "hello guest" || h.dstPort != 1024 || h.srcPort != gc.hostPort {
		t.Fatalf("got %v %q", &h, p)
	}
	// Guest to host.
	gc.send(opRW, 0, []byte("hello host"))
	buf := make([]byte, 64)
	client.SetReadDeadline(time.Now().Add(vhostusertest.Wait))
	if n, err := client.Read(buf); err != nil || string(buf[:n]) != "hello host" {
		t.Fatalf("client read %q, %v", buf[:n], err)
	}

	// The client closes: the guest hears SHUTDOWN(SEND); the guest closes
	// both ways; the device answers RST.
	client.Close()
	h, _ = g.recvOp(gc)
	if h.op != opShutdown || h.flags != shutdownSend {
		t.Fatalf("after the client's close: %v", &h)
	}
	gc.send(opShutdown, shutdownRcv|shutdownSend, nil)
	h, _ = g.recvOp(gc)
	if h.op != opRST || h.dstPort != 1024 {
		t.Fatalf("after the guest's close: %v", &h)
	}
	// The port is gone: a late packet gets RST.
	gc.send(opRW, 0, []byte("late"))
	if h, _ = g.recvOp(nil); h.op != opRST {
		t.Fatalf("packet to a closed connection: %v", &h)
	}
}

// TestGuestRSTClosesClient: an RST from the guest closes the client's socket.
func TestGuestRSTClosesClient(t *testing.T) {
	e := newEnv(t, Options{})
	g := e.boot(t, false)
	client, gc := e.connect(t, g, 1024)
	gc.send(opRST, 0, nil)
	expectEOF(t, client)
	if _, _, ok := g.tryRecv(100 * time.Millisecond); ok {
		t.Error("the device answered the guest's RST")
	}
}

// TestRefusedAndUnanswered: a guest port that answers RST, and one that
// never answers, close the client without an OK line.
func TestRefusedAndUnanswered(t *testing.T) {
	e := newEnv(t, Options{ConnectTimeout: 300 * time.Millisecond})
	g := e.boot(t, false)
	client := e.dialHybrid(t, 99)
	h, _ := g.recvOp(nil)
	if h.op != opRequest || h.dstPort != 99 {
		t.Fatalf("want REQUEST, got %v", &h)
	}
	g.send(header{srcCID: testCID, dstCID: hostCID, srcPort: 99, dstPort: h.srcPort, typ: typeStream, op: opRST}, nil)
	expectEOF(t, client)

	client = e.dialHybrid(t, 100)
	h, _ = g.recvOp(nil)
	if h.op != opRequest || h.dstPort != 100 {
		t.Fatalf("want REQUEST, got %v", &h)
	}
	expectEOF(t, client)
	// The guest is told the request is withdrawn.
	if h, _ = g.recvOp(nil); h.op != opRST || h.dstPort != 100 {
		t.Fatalf("after the connect timeout: %v", &h)
	}
}

// TestBadHandshake: malformed CONNECT lines are closed, never hang.
func TestBadHandshake(t *testing.T) {
	e := newEnv(t, Options{HandshakeTimeout: 300 * time.Millisecond})
	for _, line := range []string{"CONNECT abc\n", "HELLO 1024\n", "CONNECT 99999999999\n", "CONNECT -1\n", "CONNECT  1024\n", "CONNECT 4294967295\n",
		strings.Repeat("C", 200), "CONNECT 1024", ""} {
		c, err := net.Dial("unix", e.hybrid)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(line))
		expectEOF(t, c)
		c.Close()
	}
}

// TestMalformedPackets: what the guest sends is checked; nothing wedges
// the device.
func TestMalformedPackets(t *testing.T) {
	e := newEnv(t, Options{})
	g := e.boot(t, false)
	client, gc := e.connect(t, g, 1024)

	rst := func(what string, wantPort uint32) {
		t.Helper()
		h, _ := g.recvOp(nil)
		if h.op != opRST || h.dstPort != wantPort {
			t.Fatalf("%s: got %v, want RST to port %d", what, &h, wantPort)
		}
	}
	std := header{srcCID: testCID, dstCID: hostCID, srcPort: 5000, dstPort: 77, typ: typeStream}

	// A short packet is dropped silently (no header to answer).
	g.sendRaw(make([]byte, 20))
	if h, _, ok := g.tryRecv(100 * time.Millisecond); ok {
		t.Fatalf("short packet answered with %v", &h)
	}
	// A guest REQUEST to the host: nothing listens.
	h := std
	h.op = opRequest
	g.send(h, nil)
	rst("guest REQUEST", 5000)
	// RW to an unknown port.
	h.op = opRW
	g.send(h, []byte("x"))
	rst("RW to an unknown port", 5000)
	// Wrong source CID, wrong destination CID: RST from the addressed side.
	h = std
	h.op, h.srcCID = opRW, 9
	g.send(h, []byte("x"))
	if r, _ := g.recvOp(nil); r.op != opRST || r.dstCID != 9 || r.srcCID != hostCID {
		t.Fatalf("wrong src_cid: %v", &r)
	}
	h = std
	h.op, h.dstCID = opRequest, 42
	g.send(h, nil)
	if r, _ := g.recvOp(nil); r.op != opRST || r.srcCID != 42 || r.dstCID != testCID {
		t.Fatalf("wrong dst_cid: %v", &r)
	}
	// SEQPACKET is not offered.
	h = std
	h.op, h.typ = opRequest, 2
	g.send(h, nil)
	rst("SEQPACKET request", 5000)
	// An RST is never answered.
	h = std
	h.op = opRST
	g.send(h, nil)
	if r, _, ok := g.tryRecv(100 * time.Millisecond); ok {
		t.Fatalf("RST answered with %v", &r)
	}
	// A len that does not match the buffer, a len over 64 KiB, a
	// writable buffer in a tx chain: dropped and RST.
	var hb [hdrSize]byte
	h = std
	h.op, h.len = opRW, 10
	h.encode(hb[:])
	g.sendRaw(hb[:], []byte("short"))
	rst("len mismatch", 5000)
	h.len = maxPayload + 1
	h.encode(hb[:])
	g.sendRaw(hb[:], make([]byte, maxPayload+1))
	rst("len over the limit", 5000)
	a := g.tx.Alloc(hdrSize, 8)
	h.len = 0
	h.encode(hb[:])
	g.tx.Drv.Write(a, hb[:])
	head := g.tx.Publish([]testdriver.Buf{{Addr: a, Len: hdrSize}, {Addr: g.tx.Alloc(16, 8), Len: 16, Write: true}})
	g.tx.Kick()
	if id, n := g.tx.WaitUsed(); id != uint32(head) || n != 0 {
		t.Fatalf("tx chain with a writable buffer: used %d/%d", id, n)
	}
	rst("writable buffer in a tx chain", 5000)
	// A descriptor outside guest memory, a looping chain: returned
	// unused, the queue goes on.
	head = g.tx.Publish([]testdriver.Buf{{Addr: 0x7000000000, Len: hdrSize}})
	g.tx.Kick()
	if id, n := g.tx.WaitUsed(); id != uint32(head) || n != 0 {
		t.Fatalf("out-of-memory descriptor: used %d/%d", id, n)
	}
	g.tx.Drv.SetDesc(g.tx.Drv.DescAddr, 60, a, hdrSize, 1, 61)
	g.tx.Drv.SetDesc(g.tx.Drv.DescAddr, 61, a, hdrSize, 1, 60)
	g.tx.Drv.Publish(60)
	g.tx.Kick()
	if id, _ := g.tx.WaitUsed(); id != 60 {
		t.Fatalf("looping chain: used %d", id)
	}
	// The established connection still works, both ways.
	gc.send(opRW, 0, []byte("still here"))
	buf := make([]byte, 32)
	client.SetReadDeadline(time.Now().Add(vhostusertest.Wait))
	if n, err := client.Read(buf); err != nil || string(buf[:n]) != "still here" {
		t.Fatalf("after malformed packets: %q %v", buf[:n], err)
	}
	// A malformed packet of an established connection resets it.
	h = gc.hdr(opRW, 0)
	h.len = 3
	h.encode(hb[:])
	g.sendRaw(hb[:], []byte("toolong"))
	rst("len mismatch on a connection", 1024)
	expectEOF(t, client)
}

// TestFlowControl: a client that writes fast to a guest with a small
// buffer, and a guest that writes fast to a slow client: the device keeps
// within each side's credit, never buffers more than BufferSize, and the
// data arrives intact both ways.
func TestFlowControl(t *testing.T) {
	const bufSize = 16 << 10
	e := newEnv(t, Options{BufferSize: bufSize})
	g := e.boot(t, false)
	client, gc := e.connect(t, g, 1024)
	if gc.peerBuf != bufSize {
		t.Fatalf("device buf_alloc %d, want %d", gc.peerBuf, bufSize)
	}

	// Host to guest: 1 MiB against the guest's 64 KiB buffer. The guest
	// "reads" everything at once but tells the device only every 48 KiB.
	down := randomBytes(1, 1<<20)
	go func() { client.Write(down) }()
	var got []byte
	inFlightMax := uint32(0)
	for len(got) < len(down) {
		h, p := g.recvOp(gc)
		if h.op != opRW {
			t.Fatalf("host to guest: %v", &h)
		}
		got = append(got, p...)
		gc.rxCnt += uint32(len(p))
		inFlightMax = max(inFlightMax, gc.rxCnt-gc.fwdCnt)
		if gc.rxCnt-gc.fwdCnt > guestBufLen {
			t.Fatalf("device sent %d bytes beyond the guest's fwd_cnt, buf_alloc %d", gc.rxCnt-gc.fwdCnt, guestBufLen)
		}
		if gc.rxCnt-gc.fwdCnt >= 48<<10 || len(got) == len(down) {
			gc.fwdCnt = gc.rxCnt
			gc.send(opCreditUpdate, 0, nil)
		}
	}
	if !bytes.Equal(got, down) {
		t.Fatal("host to guest data differs")
	}
	t.Logf("host to guest: at most %d bytes in flight", inFlightMax)

	// Guest to host: 512 KiB to a client reading 1 KiB per millisecond.
	up := randomBytes(2, 512<<10)
	readDone := make(chan []byte)
	go func() {
		var b []byte
		chunk := make([]byte, 1024)
		client.SetReadDeadline(time.Now().Add(2 * vhostusertest.Wait))
		for len(b) < len(up) {
			n, err := client.Read(chunk)
			b = append(b, chunk[:n]...)
			if err != nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		readDone <- b
	}()
	sent := 0
	maxBuffered := 0
	for sent < len(up) {
		credit := gc.deviceCredit()
		if credit == 0 {
			// Wait for the device's CREDIT_UPDATE as the client drains.
			h, _ := g.recv()
			if h.op != opCreditUpdate && h.op != opCreditRequest {
				t.Fatalf("waiting for credit: %v", &h)
			}
			gc.credit(&h)
			e.srv.dev.mu.Lock()
			for _, c := range e.srv.dev.conns {
				maxBuffered = max(maxBuffered, c.in.filled())
			}
			e.srv.dev.mu.Unlock()
			continue
		}
		n := min(int(credit), rxBufSize, len(up)-sent)
		gc.send(opRW, 0, up[sent:sent+n])
		sent += n
	}
	if b := <-readDone; !bytes.Equal(b, up) {
		t.Fatalf("guest to host data differs (%d of %d bytes)", len(b), len(up))
	}
	if maxBuffered > bufSize {
		t.Fatalf("device buffered %d bytes, BufferSize %d", maxBuffered, bufSize)
	}
	t.Logf("guest to host: at most %d bytes buffered", maxBuffered)

	// A guest that ignores the credit is reset, not buffered: one packet
	// of twice the device's buffer.
	gc.send(opRW, 0, make([]byte, 2*bufSize))
	for {
		h, _ := g.recv()
		if h.op == opRST {
			break
		}
		if h.op != opCreditUpdate && h.op != opCreditRequest {
			t.Fatalf("credit overrun answered with %v", &h)
		}
	}
	expectEOF(t, client)
}

// TestTransportReset: a front-end that goes away with connections open
// closes their clients, and the next front-end's event queue carries
// TRANSPORT_RESET.
func TestTransportReset(t *testing.T) {
	e := newEnv(t, Options{})
	g := e.boot(t, true)
	client, _ := e.connect(t, g, 1024)
	if _, _, ok := g.ev.Drv.Used(); ok {
		t.Fatal("event before any reset")
	}
	g.f.Close()
	expectEOF(t, client)
	if _, err := e.srv.VhostServer().WaitStats(t.Context(), func(s vu.Stats) bool { return s.Disconnects == 1 }); err != nil {
		t.Fatal(err)
	}
	g2 := e.boot(t, true)
	id, n := g2.ev.WaitUsed()
	a, ok := g2.evBufs[id]
	if !ok || n != eventSize {
		t.Fatalf("event used %d/%d", id, n)
	}
	if ev := binary.LittleEndian.Uint32(g2.ev.Drv.Read(a, 4)); ev != eventTransportReset {
		t.Fatalf("event id %d", ev)
	}
	// One reset only; the new session works.
	client2, gc2 := e.connect(t, g2, 1024)
	gc2.send(opRW, 0, []byte("again"))
	buf := make([]byte, 8)
	client2.SetReadDeadline(time.Now().Add(vhostusertest.Wait))
	if n, err := io.ReadFull(client2, buf[:5]); err != nil || string(buf[:n]) != "again" {
		t.Fatalf("new session: %q %v", buf[:n], err)
	}
	if _, _, ok := g2.ev.Drv.Used(); ok {
		t.Fatal("a second transport reset")
	}
}

// TestCloseResetsConnections: Close tells the guest (RST), closes the
// client and a client still in its handshake at once, and is idempotent.
func TestCloseResetsConnections(t *testing.T) {
	e := newEnv(t, Options{HandshakeTimeout: time.Hour})
	g := e.boot(t, false)
	client, _ := e.connect(t, g, 1024)
	silent, err := net.Dial("unix", e.hybrid)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	closed := make(chan error, 1)
	go func() { closed <- e.srv.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(vhostusertest.Wait):
		t.Fatal("Close waits for a client's handshake")
	}
	expectEOF(t, client)
	expectEOF(t, silent)
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := net.Dial("unix", e.hybrid); err == nil {
		t.Fatal("hybrid socket still accepts")
	}
}

// TestConnectionLimit: clients past MaxConnections are closed.
func TestConnectionLimit(t *testing.T) {
	e := newEnv(t, Options{MaxConnections: 1})
	g := e.boot(t, false)
	client, _ := e.connect(t, g, 1024)
	second := e.dialHybrid(t, 1025)
	expectEOF(t, second)
	_ = client
}

// TestMalformedRxBuffers: receive buffers the device cannot use (a
// device-readable part, no room for a header, outside guest memory) are
// returned with length 0, and the next good one carries the packet.
func TestMalformedRxBuffers(t *testing.T) {
	e := newEnv(t, Options{})
	f := vhostusertest.Dial(t, e.vhost)
	f.Negotiate(0)
	f.SetupMemory()
	rx := f.StartQueue(queueRX, queueSize)
	tx := f.StartQueue(queueTX, queueSize)
	g := &testGuest{t: t, f: f, rx: rx, tx: tx, rxBufs: map[uint32]uint64{}}
	a := rx.Alloc(4096, 8)
	bad := []uint16{
		rx.Publish([]testdriver.Buf{{Addr: a, Len: 16}, {Addr: a + 16, Len: 100, Write: true}}),
		rx.Publish([]testdriver.Buf{{Addr: a + 200, Len: hdrSize - 1, Write: true}}),
		rx.Publish([]testdriver.Buf{{Addr: 0x7000000000, Len: 4096, Write: true}}),
	}
	g.postRx(rx.Alloc(hdrSize+rxBufSize, 8))
	rx.Kick()
	g.send(header{srcCID: testCID, dstCID: hostCID, srcPort: 7, dstPort: 8, typ: typeStream, op: opRequest}, nil)
	for _, head := range bad {
		if id, n := rx.WaitUsed(); id != uint32(head) || n != 0 {
			t.Fatalf("bad rx buffer %d: used %d/%d", head, id, n)
		}
	}
	if h, _ := g.recv(); h.op != opRST || h.dstPort != 7 {
		t.Fatalf("got %v, want RST", &h)
	}
}

// TestReplyBacklog: a guest that sends packets needing replies but gives
// no receive buffers stops being read at maxReplies pending replies
// (bounded memory), and resumes once it takes them.
func TestReplyBacklog(t *testing.T) {
	e := newEnv(t, Options{Logf: func(string, ...any) {}})
	f := vhostusertest.Dial(t, e.vhost)
	f.Negotiate(0)
	f.SetupMemory()
	rx := f.StartQueue(queueRX, queueSize)
	tx := f.StartQueue(queueTX, queueSize)
	g := &testGuest{t: t, f: f, rx: rx, tx: tx, rxBufs: map[uint32]uint64{}}
	var hb [hdrSize]byte
	h := header{srcCID: testCID, dstCID: hostCID, srcPort: 7, dstPort: 8, typ: typeStream, op: opRequest}
	h.encode(hb[:])
	pkt := tx.Alloc(hdrSize, 8)
	tx.Drv.Write(pkt, hb[:])
	const total = maxReplies + 40
	published, used := 0, 0
	testenv.Eventually(t, vhostusertest.Wait, func() (bool, error) {
		for published < total && published-used < queueSize-4 {
			tx.Publish([]testdriver.Buf{{Addr: pkt, Len: hdrSize}})
			published++
		}
		tx.Kick()
		for {
			if _, _, ok := tx.Drv.Used(); !ok {
				break
			}
			used++
		}
		return used >= maxReplies, fmt.Errorf("only %d of %d packets consumed", used, maxReplies)
	})
	// Nothing more may be consumed with no receive buffer: give the
	// device time to take one too many, then count.
	time.Sleep(200 * time.Millisecond)
	for {
		if _, _, ok := tx.Drv.Used(); !ok {
			break
		}
		used++
	}
	if used != maxReplies {
		t.Fatalf("%d packets consumed with no receive buffer, want the limit %d", used, maxReplies)
	}
	// Receive buffers: the replies flow and the rest is read.
	for range rxBuffers {
		g.postRx(rx.Alloc(hdrSize+rxBufSize, 8))
	}
	rx.Kick()
	for got := 0; got < total; got++ {
		if h, _ := g.recv(); h.op != opRST {
			t.Fatalf("reply %d: %v", got, &h)
		}
		for {
			if _, _, ok := tx.Drv.Used(); !ok {
				break
			}
			used++
		}
		for published < total && published-used < queueSize-4 {
			tx.Publish([]testdriver.Buf{{Addr: pkt, Len: hdrSize}})
			published++
			tx.Kick()
		}
	}
	// The last used entries may follow their replies.
	testenv.Eventually(t, vhostusertest.Wait, func() (bool, error) {
		for {
			if _, _, ok := tx.Drv.Used(); !ok {
				break
			}
			used++
		}
		return used >= total, fmt.Errorf("%d of %d packets consumed", used, total)
	})
	if used != total {
		t.Fatalf("%d of %d packets consumed", used, total)
	}
}
