package vsock

import (
	"net"
	"testing"
)

// FuzzPacket feeds arbitrary transmit chains to the parser and, when they
// parse, to the connection state machine of a device holding one
// established connection (host port 2^30, guest port 1024). Nothing may
// panic, a connection never buffers more than its BufferSize, and the
// replies stay bounded.
func FuzzPacket(f *testing.F) {
	mk := func(h header, payload []byte) []byte {
		b := make([]byte, hdrSize)
		h.len = uint32(len(payload))
		h.encode(b)
		return append(b, payload...)
	}
	conn := header{srcCID: testCID, dstCID: hostCID, srcPort: 1024, dstPort: firstHostPort, typ: typeStream, bufAlloc: 4096}
	for _, op := range []uint16{opRequest, opResponse, opRST, opShutdown, opRW, opCreditUpdate, opCreditRequest, 99} {
		h := conn
		h.op = op
		f.Add(mk(h, nil), uint8(0))
		f.Add(mk(h, []byte("data")), uint8(3))
	}
	h := conn
	h.op, h.flags = opShutdown, shutdownRcv|shutdownSend
	f.Add(mk(h, nil), uint8(7))
	h = conn
	h.op = opRW
	f.Add(mk(h, make([]byte, 5000)), uint8(44))
	h.len = 1 << 20
	f.Add(mk(h, nil)[:hdrSize], uint8(0))
	f.Add(make([]byte, 43), uint8(1))
	h = conn
	h.op, h.srcCID, h.typ = opRequest, 99, 2
	f.Add(mk(h, nil), uint8(0))

	f.Fuzz(func(t *testing.T, data []byte, split uint8) {
		// Split the packet into descriptors of split+1 bytes, as a driver may.
		var bufs [][]byte
		step := int(split) + 1
		for rest := data; len(rest) > 0; {
			n := min(step, len(rest))
			bufs = append(bufs, rest[:n])
			rest = rest[n:]
		}
		h, valid, err := parsePacket(bufs, uint32(len(data)), 0)
		if err == nil && (!valid || int(h.len) != len(data)-hdrSize || h.len > maxPayload) {
			t.Fatalf("accepted %v from %d bytes", &h, len(data))
		}
		if len(data) < hdrSize && (valid || err == nil) {
			t.Fatalf("%d bytes parsed as a header", len(data))
		}

		opts := Options{GuestCID: testCID}
		if err := opts.fill(); err != nil {
			t.Fatal(err)
		}
		opts.BufferSize = 4096
		d := newDevice(testCID, &opts)
		host, peer := net.Pipe()
		defer peer.Close()
		c, ok := d.connect(host, 1024)
		if !ok {
			t.Fatal("connect refused")
		}
		d.mu.Lock()
		defer d.mu.Unlock()
		resp := conn
		resp.op = opResponse
		d.handlePacket(&resp, nil)
		if c.state != stateEstablished {
			t.Fatalf("RESPONSE left the connection %d", c.state)
		}
		if err != nil {
			if valid {
				d.refuse(&h)
			}
		} else {
			d.handlePacket(&h, bufs)
		}
		if c.in.filled() > 4096 || c.out.filled() > 4096 {
			t.Fatalf("connection buffers %d/%d bytes", c.in.filled(), c.out.filled())
		}
		if len(d.ctrl) > 4 {
			t.Fatalf("%d control packets queued for one packet", len(d.ctrl))
		}
		for _, p := range d.ctrl {
			if err == nil && h.op == opRST && p.hdr.op == opRST {
				t.Fatalf("a well-formed RST answered with RST: %v", &p.hdr)
			}
		}
		if c.state == stateClosed {
			if _, ok := d.conns[c.hostPort]; ok {
				t.Fatal("closed connection still in the table")
			}
		}
	})
}
