package vsock

// The test guest: the vhostusertest frontend plays QEMU, and testGuest
// plays the guest's virtio-vsock driver on its rings, as Linux lays them
// out (rx buffers of a 44-byte header descriptor and a 4 KiB payload one;
// tx packets of a header descriptor and a payload one).

import (
	"bufio"
	"context"
	"net"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

const (
	testCID     = 3
	rxBufSize   = 4096 // Linux's VIRTIO_VSOCK_DEFAULT_RX_BUF_SIZE
	rxBuffers   = 16
	queueSize   = 64
	guestBufLen = 64 << 10 // the guest's buf_alloc in these tests
)

type testEnv struct {
	srv    *Server
	vhost  string
	hybrid string
}

func newEnv(t *testing.T, opts Options) *testEnv {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "vsock")
	if opts.GuestCID == 0 {
		opts.GuestCID = testCID
	}
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	e := &testEnv{vhost: filepath.Join(dir, "vhost.sock"), hybrid: filepath.Join(dir, "hybrid.sock")}
	srv, err := Serve(context.Background(), e.vhost, e.hybrid, opts)
	if err != nil {
		t.Fatal(err)
	}
	e.srv = srv
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
	})
	return e
}

// testGuest is the guest driver's side of the rx, tx and event queues.
type testGuest struct {
	t      *testing.T
	f      *vhostusertest.Frontend
	rx, tx *vhostusertest.Queue
	ev     *vhostusertest.Queue // nil unless started
	rxBufs map[uint32]uint64    // rx chain head -> header buffer address
	evBufs map[uint32]uint64
}

// boot connects a frontend, shares memory and starts rx and tx (and the
// event queue with withEvent), posting rx buffers as Linux does.
func (e *testEnv) boot(t *testing.T, withEvent bool) *testGuest {
	t.Helper()
	f := vhostusertest.Dial(t, e.vhost)
	f.Negotiate(0)
	f.SetupMemory()
	g := &testGuest{t: t, f: f, rxBufs: map[uint32]uint64{}, evBufs: map[uint32]uint64{}}
	g.rx = f.StartQueue(queueRX, queueSize)
	g.tx = f.StartQueue(queueTX, queueSize)
	if withEvent {
		g.ev = f.StartQueue(queueEvent, 8)
		for range 4 {
			a := g.ev.Alloc(eventSize, 4)
			head := g.ev.Publish([]testdriver.Buf{{Addr: a, Len: eventSize, Write: true}})
			g.evBufs[uint32(head)] = a
		}
		g.ev.Kick()
	}
	for range rxBuffers {
		g.postRx(g.rx.Alloc(hdrSize+rxBufSize, 8))
	}
	g.rx.Kick()
	return g
}

func (g *testGuest) postRx(a uint64) {
	head := g.rx.Publish([]testdriver.Buf{{Addr: a, Len: hdrSize, Write: true}, {Addr: a + hdrSize, Len: rxBufSize, Write: true}})
	g.rxBufs[uint32(head)] = a
}

// recv returns the next packet the device put in an rx buffer, reposting
// the buffer.
func (g *testGuest) recv() (header, []byte) {
	g.t.Helper()
	id, n := g.rx.WaitUsed()
	return g.take(id, n)
}

func (g *testGuest) take(id, n uint32) (header, []byte) {
	g.t.Helper()
	a, ok := g.rxBufs[id]
	if !ok {
		g.t.Fatalf("rx used id %d was not posted", id)
	}
	delete(g.rxBufs, id)
	if n < hdrSize || n > hdrSize+rxBufSize {
		g.t.Fatalf("rx used length %d", n)
	}
	b := g.rx.Drv.Read(a, int(n))
	h := decodeHeader(b)
	if h.len != n-hdrSize {
		g.t.Fatalf("rx packet %v in %d bytes", &h, n)
	}
	g.postRx(a)
	g.rx.Kick()
	return h, b[hdrSize:]
}

// tryRecv is recv that gives up after d (for "nothing arrives" checks).
func (g *testGuest) tryRecv(d time.Duration) (header, []byte, bool) {
	g.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if id, n, ok := g.rx.Drv.Used(); ok {
			h, p := g.take(id, n)
			return h, p, true
		}
		time.Sleep(time.Millisecond)
	}
	return header{}, nil, false
}

// recvOp returns the next packet whose op is not a credit update or
// request (those are answered or recorded by the caller's c, if given).
func (g *testGuest) recvOp(c *guestConn) (header, []byte) {
	g.t.Helper()
	for {
		h, p := g.recv()
		if h.op == opCreditUpdate || h.op == opCreditRequest {
			if c != nil {
				c.credit(&h)
				if h.op == opCreditRequest {
					c.send(opCreditUpdate, 0, nil)
				}
			}
			continue
		}
		return h, p
	}
}

// sendRaw transmits readable buffers as one chain and waits until the
// device has consumed it.
func (g *testGuest) sendRaw(bufs ...[]byte) {
	g.t.Helper()
	var descs []testdriver.Buf
	for _, b := range bufs {
		a := g.tx.Alloc(uint64(len(b)), 8)
		g.tx.Drv.Write(a, b)
		descs = append(descs, testdriver.Buf{Addr: a, Len: uint32(len(b))})
	}
	head := g.tx.Publish(descs)
	g.tx.Kick()
	if id, _ := g.tx.WaitUsed(); id != uint32(head) {
		g.t.Fatalf("tx used id %d, want %d", id, head)
	}
}

// send transmits a header (len set from payload) and its payload.
func (g *testGuest) send(h header, payload []byte) {
	g.t.Helper()
	h.len = uint32(len(payload))
	var hb [hdrSize]byte
	h.encode(hb[:])
	if len(payload) == 0 {
		g.sendRaw(hb[:])
		return
	}
	g.sendRaw(hb[:], payload)
}

// guestConn is the guest socket's side of one connection.
type guestConn struct {
	g                   *testGuest
	port, hostPort      uint32
	fwdCnt              uint32 // what the guest has consumed
	rxCnt               uint32
	txCnt               uint32 // what the guest has sent
	peerBuf, peerFwdCnt uint32 // the device's credit
}

func (c *guestConn) hdr(op uint16, flags uint32) header {
	return header{srcCID: testCID, dstCID: hostCID, srcPort: c.port, dstPort: c.hostPort, typ: typeStream, op: op, flags: flags,
		bufAlloc: guestBufLen, fwdCnt: c.fwdCnt}
}

func (c *guestConn) send(op uint16, flags uint32, payload []byte) {
	c.g.t.Helper()
	c.g.send(c.hdr(op, flags), payload)
	c.txCnt += uint32(len(payload))
}

func (c *guestConn) credit(h *header) { c.peerBuf, c.peerFwdCnt = h.bufAlloc, h.fwdCnt }

// deviceCredit is what the guest may still send.
func (c *guestConn) deviceCredit() uint32 { return c.peerBuf - (c.txCnt - c.peerFwdCnt) }

// accept takes the device's REQUEST for port and answers RESPONSE.
func (g *testGuest) accept(port uint32) *guestConn {
	g.t.Helper()
	h, _ := g.recvOp(nil)
	if h.op != opRequest || h.srcCID != hostCID || h.dstCID != testCID || h.dstPort != port || h.typ != typeStream {
		g.t.Fatalf("want a REQUEST to port %d, got %v", port, &h)
	}
	if h.srcPort < firstHostPort {
		g.t.Errorf("host port %d below 2^30", h.srcPort)
	}
	c := &guestConn{g: g, port: port, hostPort: h.srcPort}
	c.credit(&h)
	c.send(opResponse, 0, nil)
	return c
}

// dialHybrid connects to the hybrid socket and sends CONNECT port.
func (e *testEnv) dialHybrid(t *testing.T, port uint32) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", e.hybrid)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte("CONNECT " + strconv.FormatUint(uint64(port), 10) + "\n")); err != nil {
		t.Fatal(err)
	}
	return c
}

// readOK reads the hybrid reply line.
func readOK(t *testing.T, c net.Conn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(vhostusertest.Wait))
	defer c.SetReadDeadline(time.Time{})
	// Byte by byte: what follows the line is the connection's data.
	var line []byte
	var b [1]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			t.Fatalf("hybrid reply: %v (so far %q)", err, line)
		}
		if b[0] == '\n' {
			return string(line)
		}
		line = append(line, b[0])
	}
}

// expectEOF asserts the client's socket was closed by the device.
func expectEOF(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(vhostusertest.Wait))
	rd := bufio.NewReader(c)
	for {
		if _, err := rd.ReadByte(); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("client socket still open")
			}
			return
		}
	}
}
