package vsock

import (
	"net"
	"testing"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// TestGuestMemoryFault hands the device transmit, receive and event
// buffers in guest memory without backing: the packet is dropped (its
// connection reset), the buffers go back empty, and the shim lives on
// instead of dying of SIGBUS.
func TestGuestMemoryFault(t *testing.T) {
	opts := Options{GuestCID: testCID}
	if err := opts.fill(); err != nil {
		t.Fatal(err)
	}
	var logged []string
	opts.Logf = func(f string, a ...any) { logged = append(logged, f) }
	d := newDevice(testCID, &opts)
	host, peer := net.Pipe()
	defer peer.Close()
	c, ok := d.connect(host, 1024)
	if !ok {
		t.Fatal("connect refused")
	}
	conn := header{srcCID: testCID, dstCID: hostCID, srcPort: 1024, dstPort: c.hostPort, typ: typeStream, bufAlloc: 4096}
	resp := conn
	resp.op = opResponse
	d.mu.Lock()
	d.handlePacket(&resp, nil)
	d.mu.Unlock()
	if c.state != stateEstablished {
		t.Fatalf("RESPONSE left the connection in state %d", c.state)
	}

	bad := testdriver.FaultingPage(t)
	rw := conn
	rw.op, rw.len = opRW, 100
	hb := make([]byte, hdrSize)
	rw.encode(hb)
	d.handleChain(&virtq.Chain{Readable: [][]byte{hb, bad[:100]}, ReadLen: hdrSize + 100})
	if c.state != stateClosed {
		t.Errorf("connection whose payload faulted is in state %d, want closed (reset)", c.state)
	}

	var hbuf [hdrSize]byte
	d.mu.Lock()
	if !d.pending() {
		d.mu.Unlock()
		t.Fatal("no RST queued for the reset connection")
	}
	used := d.fillRX(&virtq.Chain{Writable: [][]byte{bad}, WriteLen: uint32(len(bad))}, &hbuf)
	d.mu.Unlock()
	if used != 0 {
		t.Errorf("rx buffer in faulting memory used %d bytes", used)
	}
	if d.putEvent(&virtq.Chain{Writable: [][]byte{bad[:eventSize]}, WriteLen: eventSize}, make([]byte, eventSize)) {
		t.Error("event written into faulting memory")
	}
	if len(logged) < 3 {
		t.Errorf("faults logged: %q", logged)
	}
}
