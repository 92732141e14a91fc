// Package vsock serves a virtio socket device (virtio device id 19, virtio
// 1.2 section 5.10) to QEMU over vhost-user, in process, and connects host
// clients to guest vsock ports through a unix socket: Kata's "hybrid
// vsock", as Cloud Hypervisor and Firecracker offer it, for hosts without
// /dev/vhost-vsock. QEMU 7.2 runs it with
//
//	-object memory-backend-memfd,id=mem,size=<RAM>,share=on -numa node,memdev=mem
//	-chardev socket,id=charvsock0,path=<vhostSocket>
//	-device vhost-user-vsock-pci,id=vsock0,chardev=charvsock0
//
// and a host client reaches guest port P by connecting to hybridSocket and
// writing "CONNECT P\n"; the device sends the guest a REQUEST from host CID
// 2 and a local port it allocates (from 2^30 up, as Firecracker does),
// and on the guest's RESPONSE answers "OK <hostport>\n". From then on the
// unix stream is the guest connection. A refused connection (the guest
// answers RST), no answer within Options.ConnectTimeout, the connection
// limit or a malformed handshake line (no newline within 64 bytes, not
// "CONNECT <decimal port>", or none within Options.HandshakeTimeout)
// close the client's socket without a reply line.
//
// Flow control is the spec's credit scheme in both directions: the device
// never sends the guest more than its buf_alloc minus what is in flight
// (tx_cnt - fwd_cnt), advertises Options.BufferSize as its own buf_alloc
// and sends CREDIT_UPDATE as the client drains what the guest sent. A
// client that reads slowly therefore stops the guest's sender instead of
// growing a buffer: each connection holds at most BufferSize bytes in
// each direction. The guest's packets are untrusted: one shorter than its
// header is dropped and logged; a len that differs from the bytes after
// the header or exceeds 64 KiB, a device-writable buffer in a transmit
// chain, a misaddressed packet (source CID not the guest's, destination
// not the host), a type other than STREAM or a packet for no known
// connection is dropped, logged and answered with RST (never an RST: that
// would ping-pong), and the connection it belongs to, if any, is closed.
// Nothing on the host listens for guest-initiated connections: a guest
// REQUEST is answered with RST. SEQPACKET is not offered. Connections
// survive the queues being stopped and restarted (QEMU does that when the
// VM is paused); after a guest reboot, a stale one is reset on its next
// packet, which the new guest answers with RST.
//
// QEMU's vhost-user-vsock keeps the event queue for itself (it sends the
// transport reset after migration) and hands the backend rx and tx only.
// The device still serves an event queue a front-end hands over: when a
// front-end connection ends while connections existed, their clients are
// closed and the next connection's event queue gets
// VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, so a guest that outlived the
// front-end resets its sockets too. Without an event queue, the guest's
// stale sockets get RST on their next packet.
package vsock

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	vu "github.com/kata-fsx/kata-fsx/vhostuser"
)

// Defaults for Options fields left zero.
const (
	DefaultMaxConnections   = 256
	DefaultBufferSize       = 256 << 10
	DefaultConnectTimeout   = 10 * time.Second
	DefaultHandshakeTimeout = 5 * time.Second

	// maxHandshakeLine bounds "CONNECT <port>\n".
	maxHandshakeLine = 64
	// vmaddrPortAny is no port a guest can listen on.
	vmaddrPortAny = 0xffffffff
)

// Options tune Serve; zero values pick defaults.
type Options struct {
	// GuestCID is the guest's context id (config space guest_cid); at
	// least 3, below 2^32-1. Required.
	GuestCID uint64
	// Logf receives diagnostics; nil discards them.
	Logf func(format string, args ...any)
	// MaxConnections bounds open and pending hybrid connections; clients
	// beyond it are closed. Default 256.
	MaxConnections int
	// BufferSize is what each connection buffers in each direction
	// (allocated once the guest accepts), and the buf_alloc the guest is
	// told (4 KiB..64 MiB). Default 256 KiB.
	BufferSize int
	// ConnectTimeout bounds the wait for the guest's RESPONSE. Default 10 s.
	ConnectTimeout time.Duration
	// HandshakeTimeout bounds reading the client's CONNECT line. Default 5 s.
	HandshakeTimeout time.Duration
}

// Server is a running vhost-user-vsock backend with its hybrid listener.
type Server struct {
	vhost  *vu.Server
	hybrid *net.UnixListener
	dev    *device

	// mu guards closed and clients; it is taken with no other lock held,
	// and Close closes the clients' sockets under it (which waits for
	// nothing) and waits for wg after releasing it.
	mu      sync.Mutex
	closed  bool
	clients map[net.Conn]struct{} // hybrid clients being served, closed by Close
	wg      sync.WaitGroup        // the accept loop and every client goroutine
	done    chan struct{}
}

// Serve starts a vhost-user-vsock backend listening on vhostSocket (QEMU connects:
//
//	-chardev socket,id=charvsock0,path=<vhostSocket> -device vhost-user-vsock-pci,id=vsock0,chardev=charvsock0)
//
// and a hybrid-vsock listener on hybridSocket. Both sockets get the
// vhostuser package's checks (a private directory, mode 0600). The
// server runs until ctx ends or Close is called.
func Serve(ctx context.Context, vhostSocket, hybridSocket string, opts Options) (*Server, error) {
	if err := opts.fill(); err != nil {
		return nil, err
	}
	dev := newDevice(opts.GuestCID, &opts)
	hl, err := vu.Listen(hybridSocket)
	if err != nil {
		return nil, fmt.Errorf("vsock: hybrid socket: %w", err)
	}
	vs, err := vu.Serve(ctx, vhostSocket, dev, vu.Options{Logf: opts.Logf})
	if err != nil {
		hl.Close()
		return nil, fmt.Errorf("vsock: %w", err)
	}
	s := &Server{vhost: vs, hybrid: hl, dev: dev, clients: make(map[net.Conn]struct{}), done: make(chan struct{})}
	s.wg.Add(1)
	go s.acceptLoop()
	go func() {
		select {
		case <-ctx.Done():
			s.Close()
		case <-s.done:
		}
	}()
	return s, nil
}

func (o *Options) fill() error {
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.MaxConnections == 0 {
		o.MaxConnections = DefaultMaxConnections
	}
	if o.BufferSize == 0 {
		o.BufferSize = DefaultBufferSize
	}
	if o.ConnectTimeout == 0 {
		o.ConnectTimeout = DefaultConnectTimeout
	}
	if o.HandshakeTimeout == 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	switch {
	case o.GuestCID < 3 || o.GuestCID >= 0xffffffff:
		return fmt.Errorf("vsock: guest CID %d, want 3..2^32-2", o.GuestCID)
	case o.MaxConnections < 1:
		return fmt.Errorf("vsock: max connections %d", o.MaxConnections)
	case o.BufferSize < 4<<10 || o.BufferSize > 64<<20:
		return fmt.Errorf("vsock: buffer size %d out of 4 KiB..64 MiB", o.BufferSize)
	case o.ConnectTimeout < 0 || o.HandshakeTimeout < 0:
		return errors.New("vsock: negative timeout")
	}
	return nil
}

// Close stops both listeners, resets every connection (the guest gets RST,
// the client a closed socket) and waits for the server's goroutines. It
// is idempotent.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return nil
	}
	s.closed = true
	for c := range s.clients {
		c.Close() // ends handshakes still reading or waiting
	}
	s.mu.Unlock()
	herr := s.hybrid.Close()
	s.dev.shutdown()
	verr := s.vhost.Close()
	s.wg.Wait()
	close(s.done)
	if herr != nil && !errors.Is(herr, net.ErrClosed) {
		return fmt.Errorf("vsock: close hybrid listener: %w", herr)
	}
	return verr
}

// VhostServer returns the vhost-user server (connection stats, request counts).
func (s *Server) VhostServer() *vu.Server { return s.vhost }

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.hybrid.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if !closed {
				s.dev.logf("vsock: hybrid accept: %v", err)
			}
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.clients[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveClient(c)
			s.mu.Lock()
			delete(s.clients, c)
			s.mu.Unlock()
		}()
	}
}

// serveClient runs one hybrid client: the handshake, the wait for the
// guest, then the copy loops until the connection closes.
func (s *Server) serveClient(client net.Conn) {
	d := s.dev
	port, err := readConnect(client, d.opts.HandshakeTimeout)
	if err != nil {
		d.logf("vsock: hybrid handshake: %v", err)
		client.Close()
		return
	}
	c, ok := d.connect(client, port)
	if !ok {
		d.logf("vsock: connection to guest port %d refused: limit of %d connections or server closing", port, d.opts.MaxConnections)
		client.Close()
		return
	}
	select {
	case <-c.established:
	case <-c.done:
		return
	}
	client.SetWriteDeadline(time.Now().Add(d.opts.HandshakeTimeout))
	if _, err := fmt.Fprintf(client, "OK %d\n", c.hostPort); err != nil {
		d.logf("vsock: hybrid reply: %v", err)
		d.close(c, true)
		return
	}
	client.SetWriteDeadline(time.Time{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.pumpToGuest(c)
	}()
	d.pumpToClient(c)
	<-done
}

// readConnect reads "CONNECT <port>\n" byte by byte (what follows the line
// is already the connection's data) within timeout.
func readConnect(c net.Conn, timeout time.Duration) (uint32, error) {
	c.SetReadDeadline(time.Now().Add(timeout))
	defer c.SetReadDeadline(time.Time{})
	var line []byte
	var b [1]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return 0, fmt.Errorf("read CONNECT line: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		if len(line) == maxHandshakeLine {
			return 0, fmt.Errorf("CONNECT line longer than %d bytes", maxHandshakeLine)
		}
		line = append(line, b[0])
	}
	rest, ok := bytes.CutPrefix(line, []byte("CONNECT "))
	if !ok {
		return 0, fmt.Errorf("handshake line %q is not CONNECT <port>", line)
	}
	port, err := strconv.ParseUint(string(rest), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("handshake line %q: bad port: %w", line, err)
	}
	if port == vmaddrPortAny {
		return 0, fmt.Errorf("handshake line %q: port %d is VMADDR_PORT_ANY", line, port)
	}
	return uint32(port), nil
}

// close closes c under the device lock.
func (d *device) close(c *conn, rst bool) {
	d.mu.Lock()
	d.closeLocked(c, rst)
	d.mu.Unlock()
}

// pumpToGuest reads the client into c.out while there is room; the rx
// queue sends it on. A client EOF becomes SHUTDOWN(SEND).
func (d *device) pumpToGuest(c *conn) {
	for {
		d.mu.Lock()
		for c.state == stateEstablished && (c.out.free() == 0 || c.peerNoRecv) {
			d.mu.Unlock()
			select {
			case <-c.readWake:
			case <-c.done:
			}
			d.mu.Lock()
		}
		if c.state != stateEstablished {
			d.mu.Unlock()
			return
		}
		span := c.out.freeSpan()
		d.mu.Unlock()
		n, err := c.client.Read(span)
		d.mu.Lock()
		if c.state != stateEstablished {
			d.mu.Unlock()
			return
		}
		if n > 0 {
			c.out.produced(n)
			d.queueSend(c)
		}
		if err != nil {
			c.hostEOF = true
			d.queueSend(c)
			d.mu.Unlock()
			return
		}
		d.mu.Unlock()
	}
}

// pumpToClient writes what the guest sent to the client, returning credit
// as it drains; a write error resets the connection.
func (d *device) pumpToClient(c *conn) {
	for {
		d.mu.Lock()
		for c.state == stateEstablished && c.in.filled() == 0 && !c.peerNoSend {
			d.mu.Unlock()
			select {
			case <-c.writeWake:
			case <-c.done:
			}
			d.mu.Lock()
		}
		if c.state != stateEstablished {
			d.mu.Unlock()
			return
		}
		if c.in.filled() == 0 {
			// The guest sends no more: pass the half-close on, or finish
			// the close it started.
			if c.closeAfter {
				d.closeLocked(c, true)
				d.mu.Unlock()
				return
			}
			d.mu.Unlock()
			if cw, ok := c.client.(interface{ CloseWrite() error }); ok {
				cw.CloseWrite()
			}
			select {
			case <-c.done:
				return
			case <-c.writeWake:
				continue
			}
		}
		a, _ := c.in.filledSpans()
		d.mu.Unlock()
		n, err := c.client.Write(a)
		d.mu.Lock()
		if c.state != stateEstablished {
			d.mu.Unlock()
			return
		}
		if n > 0 {
			d.forwarded(c, n)
		}
		if err != nil {
			d.logf("vsock: write to client of guest port %d: %v", c.guestPort, err)
			d.closeLocked(c, true)
			d.mu.Unlock()
			return
		}
		d.mu.Unlock()
	}
}
