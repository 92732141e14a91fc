package vsock

import (
	"encoding/binary"
	"errors"
	"net"
	"runtime/debug"
	"sync"
	"time"

	vu "github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// connState is where a connection is in its life.
type connState uint8

const (
	stateConnecting  connState = iota // REQUEST queued or sent, waiting for RESPONSE
	stateEstablished                  // RESPONSE seen: data flows
	stateClosed                       // reset or torn down; gone from the table
)

// conn is one host-initiated stream: a host client on the hybrid socket
// and a guest socket on guestPort. Fields are guarded by device.mu except
// where noted.
type conn struct {
	hostPort, guestPort uint32
	client              net.Conn // the hybrid client; closed by close
	state               connState

	established chan struct{} // closed when RESPONSE arrives
	done        chan struct{} // closed when the connection is closed
	timer       *time.Timer   // connect timeout, stopped once established

	// Host to guest: bytes read from the client, sent as RW packets within
	// the guest's credit. Both rings are allocated on RESPONSE.
	out          byteRing
	txCnt        uint32 // bytes sent to the guest
	peerBufAlloc uint32 // the guest's receive buffer
	peerFwdCnt   uint32 // bytes the guest has consumed
	hostEOF      bool   // the client stopped sending: SHUTDOWN(SEND) once out drains
	eofSent      bool
	creditAsked  bool          // CREDIT_REQUEST sent since the last credit change
	readWake     chan struct{} // room in out or the guest may receive again

	// Guest to host: RW payloads waiting for the client, within our
	// advertised buffer (buf_alloc = Options.BufferSize = len(in.buf)).
	in          byteRing
	rxCnt       uint32 // bytes received from the guest
	fwdCnt      uint32 // bytes written to the client
	lastFwdSent uint32 // fwd_cnt in the last packet we sent
	writeWake   chan struct{}

	peerNoRecv bool // guest sent SHUTDOWN(RCV)
	peerNoSend bool // guest sent SHUTDOWN(SEND)

	queued     bool // in device.sendQ
	creditDue  bool // a CREDIT_UPDATE is queued
	closeAfter bool // the guest closed both ways: RST once in drains
}

// peerCredit is how many more bytes the guest can take.
func (c *conn) peerCredit() uint32 {
	inFlight := c.txCnt - c.peerFwdCnt
	if inFlight >= c.peerBufAlloc {
		return 0
	}
	return c.peerBufAlloc - inFlight
}

// wantsSend reports whether the rx queue has something to send for c.
func (c *conn) wantsSend() bool {
	if c.state != stateEstablished {
		return false
	}
	if c.out.filled() > 0 && !c.peerNoRecv {
		return c.peerCredit() > 0
	}
	return c.hostEOF && !c.eofSent && (c.out.filled() == 0 || c.peerNoRecv)
}

func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// ctrlPacket is a packet without payload waiting for an rx buffer; conn,
// when set, supplies buf_alloc and fwd_cnt at send time.
type ctrlPacket struct {
	hdr  header
	conn *conn
}

// device is the virtio socket device: the vhost-user core runs its queues,
// the hybrid listener adds connections. mu guards everything below it. It
// is taken with no other lock held, and its holders copy guest memory,
// update the tables, close clients' sockets and poke channels with room
// (poke never waits); they never wait for a client, a channel or a kick:
// the pumps and the queues release mu before they read or write a client
// or wait for a wake, and a connect timer's callback takes mu like any
// other holder.
type device struct {
	guestCID uint64
	opts     *Options
	logf     func(format string, args ...any)

	rxWake    chan struct{} // something to send to the guest
	txWake    chan struct{} // the reply backlog shrank
	eventWake chan struct{} // a transport reset is due

	mu           sync.Mutex
	conns        map[uint32]*conn // by host port
	sendQ        []*conn          // connections with data or a SHUTDOWN to send, round robin
	ctrl         []ctrlPacket     // control packets in order
	nextPort     uint32
	resetPending bool // the guest may hold connections we lost: TRANSPORT_RESET due
	closed       bool
}

// maxReplies bounds control packets waiting for rx buffers; past it the tx
// queue stops being read until the guest takes some (vhost's backpressure).
const maxReplies = 256

// Host ports the device allocates for host-initiated connections, as
// Firecracker does: from 2^30 upward, wrapping below 2^31.
const (
	firstHostPort = 1 << 30
	lastHostPort  = 1<<31 - 1
)

func newDevice(guestCID uint64, opts *Options) *device {
	return &device{guestCID: guestCID, opts: opts, logf: opts.Logf,
		rxWake: make(chan struct{}, 1), txWake: make(chan struct{}, 1), eventWake: make(chan struct{}, 1),
		conns: make(map[uint32]*conn), nextPort: firstHostPort}
}

// Features implements vhostuser.Device: nothing beyond the core's
// VERSION_1, INDIRECT_DESC and EVENT_IDX (no SEQPACKET).
func (d *device) Features() uint64 { return 0 }

// NumQueues implements vhostuser.Device: rx, tx and event. QEMU's
// vhost-user-vsock keeps the event queue for itself and hands over rx and
// tx only.
func (d *device) NumQueues() int { return numQueues }

// ReadConfig implements vhostuser.Device: struct virtio_vsock_config is
// one le64, guest_cid.
func (d *device) ReadConfig(offset uint32, p []byte) {
	var cfg [8]byte
	binary.LittleEndian.PutUint64(cfg[:], d.guestCID)
	if offset < uint32(len(cfg)) {
		copy(p, cfg[offset:])
	}
}

// RunQueue implements vhostuser.Device.
func (d *device) RunQueue(q *vu.Queue) {
	switch q.Index() {
	case queueRX:
		d.runRX(q)
	case queueTX:
		d.runTX(q)
	case queueEvent:
		d.runEvent(q)
	}
}

// Disconnect implements vhostuser.Device: the front-end is gone and with
// it the guest's view of every connection. Host clients are closed; if
// any connection existed, the next session's event queue carries a
// TRANSPORT_RESET so a guest that survived (a front-end that reconnects)
// drops its side too.
func (d *device) Disconnect() {
	d.mu.Lock()
	lost := len(d.conns) > 0
	for _, c := range d.conns {
		d.closeLocked(c, false)
	}
	d.ctrl, d.sendQ = nil, nil
	d.repliesTaken()
	if lost {
		d.resetPending = true
	}
	d.mu.Unlock()
	if lost {
		d.logf("vsock: front-end gone; host connections closed, transport reset due")
	}
}

// shutdown closes every connection for good (Server.Close).
func (d *device) shutdown() {
	d.mu.Lock()
	d.closed = true
	for _, c := range d.conns {
		d.closeLocked(c, true)
	}
	d.mu.Unlock()
}

// closeLocked removes c, closes its client and, with rst, tells the guest.
func (d *device) closeLocked(c *conn, rst bool) {
	if c.state == stateClosed {
		return
	}
	wasConnecting := c.state == stateConnecting
	c.state = stateClosed
	delete(d.conns, c.hostPort)
	close(c.done)
	if c.timer != nil {
		c.timer.Stop()
	}
	c.client.Close()
	if rst && !(wasConnecting && d.dropUnsentRequest(c)) {
		d.queueCtrl(ctrlPacket{hdr: d.hostHeader(c, opRST, 0)})
	}
}

// dropUnsentRequest removes c's REQUEST from the control queue and reports
// whether it was still there (then the guest never heard of c).
func (d *device) dropUnsentRequest(c *conn) bool {
	for i, p := range d.ctrl {
		if p.conn == c && p.hdr.op == opRequest {
			d.ctrl = append(d.ctrl[:i], d.ctrl[i+1:]...)
			return true
		}
	}
	return false
}

// pending drops queue entries that lost their reason (closed connections,
// nothing left to send) and reports whether a packet is waiting, so the
// rx loop pops a guest buffer only when it can fill it.
func (d *device) pending() bool {
	for len(d.ctrl) > 0 && d.ctrl[0].conn != nil && d.ctrl[0].conn.state == stateClosed {
		d.ctrl[0] = ctrlPacket{}
		d.ctrl = d.ctrl[1:]
	}
	d.repliesTaken()
	if len(d.ctrl) > 0 {
		return true
	}
	for len(d.sendQ) > 0 && !d.sendQ[0].wantsSend() {
		d.sendQ[0].queued = false
		d.sendQ[0] = nil
		d.sendQ = d.sendQ[1:]
	}
	return len(d.sendQ) > 0
}

// hostHeader is a header from the host side of c to the guest.
func (d *device) hostHeader(c *conn, op uint16, flags uint32) header {
	return header{srcCID: hostCID, dstCID: d.guestCID, srcPort: c.hostPort, dstPort: c.guestPort,
		typ: typeStream, op: op, flags: flags}
}

// repliesTaken wakes the tx loop if it stopped for a full reply backlog
// that is no longer full.
func (d *device) repliesTaken() {
	if len(d.ctrl) < maxReplies {
		poke(d.txWake)
	}
}

func (d *device) queueCtrl(p ctrlPacket) {
	d.ctrl = append(d.ctrl, p)
	poke(d.rxWake)
}

// queueSend puts c in the send queue if it has something to send, or
// asks the guest for credit once if data waits for it.
func (d *device) queueSend(c *conn) {
	if !c.queued && c.wantsSend() {
		c.queued = true
		d.sendQ = append(d.sendQ, c)
		poke(d.rxWake)
		return
	}
	if c.state == stateEstablished && c.out.filled() > 0 && !c.peerNoRecv && c.peerCredit() == 0 && !c.creditAsked {
		// Linux sends CREDIT_UPDATE as it reads; asking once per stall
		// covers a guest that waits to be asked.
		c.creditAsked = true
		d.queueCtrl(ctrlPacket{hdr: d.hostHeader(c, opCreditRequest, 0), conn: c})
	}
}

// connect registers a host client wanting guest port port and queues the
// REQUEST; ok is false when the connection limit is reached.
func (d *device) connect(client net.Conn, port uint32) (*conn, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || len(d.conns) >= d.opts.MaxConnections {
		return nil, false
	}
	for d.conns[d.nextPort] != nil {
		d.advancePort()
	}
	c := &conn{hostPort: d.nextPort, guestPort: port, client: client,
		established: make(chan struct{}), done: make(chan struct{}),
		readWake: make(chan struct{}, 1), writeWake: make(chan struct{}, 1)}
	d.advancePort()
	d.conns[c.hostPort] = c
	d.queueCtrl(ctrlPacket{hdr: d.hostHeader(c, opRequest, 0), conn: c})
	c.timer = time.AfterFunc(d.opts.ConnectTimeout, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if c.state == stateConnecting {
			d.logf("vsock: guest port %d did not answer within %v", c.guestPort, d.opts.ConnectTimeout)
			d.closeLocked(c, true)
		}
	})
	return c, true
}

func (d *device) advancePort() {
	if d.nextPort == lastHostPort {
		d.nextPort = firstHostPort
	} else {
		d.nextPort++
	}
}

// nextPacket picks what to send next into an rx buffer with room bytes of
// payload space: control packets first, then data round robin. It fills
// hdr and returns the payload spans (nil for none); ok is false when
// nothing is waiting. Called with mu held.
func (d *device) nextPacket(room uint32) (hdr header, c *conn, p1, p2 []byte, ok bool) {
	for len(d.ctrl) > 0 {
		p := d.ctrl[0]
		d.ctrl[0] = ctrlPacket{}
		d.ctrl = d.ctrl[1:]
		d.repliesTaken()
		hdr = p.hdr
		if p.conn != nil {
			if p.conn.state == stateClosed {
				continue // its RST, if any, is queued on its own
			}
			if hdr.op == opCreditUpdate {
				p.conn.creditDue = false
			}
			d.stampCredit(&hdr, p.conn)
		}
		return hdr, nil, nil, nil, true
	}
	for len(d.sendQ) > 0 {
		c = d.sendQ[0]
		d.sendQ[0] = nil
		d.sendQ = d.sendQ[1:]
		c.queued = false
		if !c.wantsSend() {
			continue
		}
		if c.out.filled() > 0 && !c.peerNoRecv {
			n := min(uint32(c.out.filled()), c.peerCredit(), room, maxPayload)
			if n == 0 {
				continue
			}
			hdr = d.hostHeader(c, opRW, 0)
			hdr.len = n
			a, b := c.out.filledSpans()
			if uint32(len(a)) >= n {
				a, b = a[:n], nil
			} else {
				b = b[:n-uint32(len(a))]
			}
			d.stampCredit(&hdr, c)
			return hdr, c, a, b, true
		}
		c.eofSent = true
		hdr = d.hostHeader(c, opShutdown, shutdownSend)
		d.stampCredit(&hdr, c)
		return hdr, nil, nil, nil, true
	}
	return header{}, nil, nil, nil, false
}

// stampCredit fills in our buffer and forwarded count for c.
func (d *device) stampCredit(h *header, c *conn) {
	h.bufAlloc = uint32(d.opts.BufferSize)
	h.fwdCnt = c.fwdCnt
	c.lastFwdSent = c.fwdCnt
}

// sent accounts for n payload bytes of c that reached the guest.
func (d *device) sent(c *conn, n uint32) {
	c.out.consumed(int(n))
	c.txCnt += n
	poke(c.readWake)
	d.queueSend(c)
}

// runRX fills the guest's receive buffers with what is waiting.
func (d *device) runRX(q *vu.Queue) {
	vq := q.VQ()
	var chain virtq.Chain
	var hb [hdrSize]byte
	for {
		pushed := false
		for {
			vq.DisableNotification()
			ringEmpty := false
			for {
				d.mu.Lock()
				if !d.pending() {
					d.mu.Unlock()
					break
				}
				ok, err := vq.Pop(&chain)
				if errors.Is(err, virtq.ErrBroken) {
					d.mu.Unlock()
					d.logf("vsock: rx queue stopped: %v", err)
					q.NotifyError()
					return
				}
				if !ok {
					d.mu.Unlock()
					ringEmpty = true
					break
				}
				used := uint32(0)
				switch {
				case err != nil:
					d.logf("vsock: rx: %v", err)
				case chain.ReadLen != 0 || chain.WriteLen < hdrSize:
					d.logf("vsock: rx buffer with %d readable and %d writable bytes dropped", chain.ReadLen, chain.WriteLen)
				default:
					used = d.fillRX(&chain, &hb)
				}
				d.mu.Unlock()
				if vq.PushUsed(chain.Head, used) != nil {
					q.NotifyError()
					return
				}
				pushed = true
			}
			// Out of buffers: ask for a kick, and go on if buffers came
			// meanwhile. Out of packets: the next one wakes rxWake.
			if !vq.EnableNotification() || !ringEmpty {
				break
			}
		}
		if pushed && vq.NeedsNotification() {
			q.Notify()
		}
		select {
		case <-q.Kicks():
		case <-d.rxWake:
		case <-q.Done():
			return
		}
	}
}

// fillRX writes the next pending packet into an rx chain and returns the
// used length. Called with mu held. A fault on the chain's guest memory
// (virtq.ErrFault) returns it empty instead of killing the shim: a data
// packet stays queued (it is consumed only once copied), a control packet
// is lost, as on a guest that stopped reading.
func (d *device) fillRX(chain *virtq.Chain, hb *[hdrSize]byte) (used uint32) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			d.logf("vsock: rx buffer returned empty: %v", virtq.FaultError(r))
			used = 0
		}
	}()
	hdr, c, p1, p2, ok := d.nextPacket(chain.WriteLen - hdrSize)
	if !ok {
		return 0
	}
	hdr.encode(hb[:])
	scatter(chain.Writable, 0, hb[:])
	scatter(chain.Writable, hdrSize, p1)
	scatter(chain.Writable, hdrSize+uint32(len(p1)), p2)
	if c != nil {
		d.sent(c, hdr.len)
	}
	return hdrSize + hdr.len
}

// runTX handles the packets the guest sends.
func (d *device) runTX(q *vu.Queue) {
	vq := q.VQ()
	var chain virtq.Chain
	for {
		pushed := false
	drain:
		for {
			vq.DisableNotification()
			for {
				d.mu.Lock()
				full := len(d.ctrl) >= maxReplies
				d.mu.Unlock()
				if full {
					// Leave the rest on the ring until replies drain.
					break drain
				}
				ok, err := vq.Pop(&chain)
				if errors.Is(err, virtq.ErrBroken) {
					d.logf("vsock: tx queue stopped: %v", err)
					q.NotifyError()
					return
				}
				if !ok {
					break
				}
				if err != nil {
					d.logf("vsock: tx: %v", err)
				} else {
					d.handleChain(&chain)
				}
				if vq.PushUsed(chain.Head, 0) != nil {
					q.NotifyError()
					return
				}
				pushed = true
			}
			if !vq.EnableNotification() {
				break
			}
		}
		if pushed && vq.NeedsNotification() {
			q.Notify()
		}
		select {
		case <-q.Kicks():
		case <-d.txWake:
		case <-q.Done():
			return
		}
	}
}

// handleChain parses and handles one transmitted packet. A fault on the
// chain's guest memory (virtq.ErrFault) drops the packet and resets the
// connection it was for, instead of killing the shim.
func (d *device) handleChain(chain *virtq.Chain) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	var h header
	valid := false
	defer func() {
		// The deferred unlock below has run: mu is free here.
		if r := recover(); r != nil {
			d.logf("vsock: packet dropped: %v", virtq.FaultError(r))
			if valid {
				d.mu.Lock()
				d.refuse(&h)
				d.mu.Unlock()
			}
		}
	}()
	h, valid, err := parsePacket(chain.Readable, chain.ReadLen, chain.WriteLen)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err != nil {
		d.logf("vsock: malformed packet dropped: %v", err)
		if valid {
			d.refuse(&h)
		}
		return
	}
	d.handlePacket(&h, chain.Readable)
}

// refuse answers a packet with RST (never an RST: that would ping-pong)
// and closes the connection it belongs to, if any.
func (d *device) refuse(h *header) {
	if c := d.lookup(h); c != nil {
		d.closeLocked(c, true)
		return
	}
	if h.op == opRST {
		return
	}
	d.queueCtrl(ctrlPacket{hdr: header{srcCID: h.dstCID, dstCID: h.srcCID, srcPort: h.dstPort, dstPort: h.srcPort,
		typ: typeStream, op: opRST}})
}

// lookup finds the connection a correctly addressed packet belongs to.
func (d *device) lookup(h *header) *conn {
	if h.srcCID != d.guestCID || h.dstCID != hostCID || h.typ != typeStream {
		return nil
	}
	c := d.conns[h.dstPort]
	if c == nil || c.guestPort != h.srcPort {
		return nil
	}
	return c
}

// handlePacket applies one well-formed packet; payload holds it after the
// header. Called with mu held.
func (d *device) handlePacket(h *header, payload [][]byte) {
	if h.srcCID != d.guestCID || h.dstCID != hostCID || h.typ != typeStream {
		d.logf("vsock: misaddressed packet refused: %v", h)
		d.refuse(h)
		return
	}
	if h.op == opRequest {
		// Nothing on the host listens for guest-initiated connections.
		d.logf("vsock: guest connection to host port %d refused: no host listeners", h.dstPort)
		d.refuse(h)
		return
	}
	c := d.lookup(h)
	if c == nil {
		if h.op != opRST {
			d.logf("vsock: packet for no connection refused: %v", h)
			d.refuse(h)
		}
		return
	}
	// Every packet carries the guest's credit (space_update).
	c.peerBufAlloc, c.peerFwdCnt = h.bufAlloc, h.fwdCnt
	c.creditAsked = false
	switch h.op {
	case opResponse:
		if c.state != stateConnecting {
			d.closeLocked(c, true)
			return
		}
		c.state = stateEstablished
		c.timer.Stop()
		// The buffers exist only for established connections, so pending
		// ones cost no memory.
		c.in, c.out = newByteRing(d.opts.BufferSize), newByteRing(d.opts.BufferSize)
		close(c.established)
	case opRST:
		d.closeLocked(c, false)
		return
	case opShutdown:
		if c.state != stateEstablished || h.flags&^(shutdownRcv|shutdownSend) != 0 {
			d.closeLocked(c, true)
			return
		}
		if h.flags&shutdownRcv != 0 {
			c.peerNoRecv = true
			poke(c.readWake)
		}
		if h.flags&shutdownSend != 0 {
			c.peerNoSend = true
			poke(c.writeWake)
		}
		if c.peerNoRecv && c.peerNoSend {
			// The guest closed: flush what it sent, then RST.
			c.closeAfter = true
			if c.in.filled() == 0 {
				d.closeLocked(c, true)
				return
			}
		}
	case opRW:
		if c.state != stateEstablished || c.peerNoSend {
			d.closeLocked(c, true)
			return
		}
		if h.len > uint32(c.in.free()) {
			d.logf("vsock: guest port %d overran its credit (%d bytes, %d free)", c.guestPort, h.len, c.in.free())
			d.closeLocked(c, true)
			return
		}
		c.in.appendFrom(payload, hdrSize, int(h.len))
		c.rxCnt += h.len
		poke(c.writeWake)
	case opCreditUpdate:
	case opCreditRequest:
		d.queueCredit(c)
	default:
		d.closeLocked(c, true)
		return
	}
	d.queueSend(c)
}

// queueCredit queues one CREDIT_UPDATE for c.
func (d *device) queueCredit(c *conn) {
	if !c.creditDue {
		c.creditDue = true
		d.queueCtrl(ctrlPacket{hdr: d.hostHeader(c, opCreditUpdate, 0), conn: c})
	}
}

// forwarded accounts for n bytes written to the client and decides whether
// the guest must hear about the room it made: once the guest's view of
// our free space is below half the buffer.
func (d *device) forwarded(c *conn, n int) {
	c.in.consumed(n)
	c.fwdCnt += uint32(n)
	bufAlloc := uint32(d.opts.BufferSize)
	seenFree := bufAlloc - min(bufAlloc, c.rxCnt-c.lastFwdSent)
	if c.fwdCnt != c.lastFwdSent && seenFree < bufAlloc/2 {
		d.queueCredit(c)
	}
}

// runEvent delivers a pending TRANSPORT_RESET on the event queue.
func (d *device) runEvent(q *vu.Queue) {
	vq := q.VQ()
	var chain virtq.Chain
	var ev [eventSize]byte
	binary.LittleEndian.PutUint32(ev[:], eventTransportReset)
	for {
		d.mu.Lock()
		due := d.resetPending
		d.mu.Unlock()
		if due {
			vq.DisableNotification()
			ok, err := vq.Pop(&chain)
			if errors.Is(err, virtq.ErrBroken) {
				q.NotifyError()
				return
			}
			if ok {
				used := uint32(0)
				if err == nil && chain.ReadLen == 0 && chain.WriteLen >= eventSize && d.putEvent(&chain, ev[:]) {
					used = eventSize
					d.mu.Lock()
					d.resetPending = false
					d.mu.Unlock()
					d.logf("vsock: transport reset sent to the guest")
				} else {
					d.logf("vsock: event buffer with %d readable and %d writable bytes dropped", chain.ReadLen, chain.WriteLen)
				}
				if vq.PushUsed(chain.Head, used) != nil {
					q.NotifyError()
					return
				}
				if vq.NeedsNotification() {
					q.Notify()
				}
				continue
			}
			if vq.EnableNotification() {
				continue
			}
		}
		select {
		case <-q.Kicks():
		case <-d.eventWake:
		case <-q.Done():
			return
		}
	}
}

// putEvent writes ev into an event chain, reporting false when its guest
// memory faulted (virtq.ErrFault).
func (d *device) putEvent(chain *virtq.Chain, ev []byte) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			d.logf("vsock: event buffer returned empty: %v", virtq.FaultError(r))
			ok = false
		}
	}()
	scatter(chain.Writable, 0, ev)
	return true
}
