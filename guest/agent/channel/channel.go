// Package channel serves the agent's channels to the host: the
// virtio-serial port agent.channel.0 (one stream that outlives host
// connections, split into a session per connection) and vsock port 1024,
// as listeners for the ttrpc server; and the port-forward service's vsock
// port.
package channel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

const (
	// SerialPortName is the virtio-serial port the host connects to.
	SerialPortName = "agent.channel.0"
	vsockPort      = 1024
	// virtioIDVsock is the virtio device id of virtio-vsock.
	virtioIDVsock = "0x0013"
)

// findSerialPort returns the /dev node of the virtio-serial port named name.
func findSerialPort(name string) (string, bool) {
	entries, err := os.ReadDir("/sys/class/virtio-ports")
	if err != nil {
		return "", false
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			return filepath.Join("/dev", e.Name()), true
		}
	}
	return "", false
}

// hasVsockDevice reports whether a virtio-vsock device is present (an
// AF_VSOCK socket can be bound without one, but nobody could reach it).
func hasVsockDevice() bool {
	entries, err := os.ReadDir("/sys/bus/virtio/devices")
	if err != nil {
		return false
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/sys/bus/virtio/devices", e.Name(), "device"))
		if err == nil && strings.TrimSpace(string(b)) == virtioIDVsock {
			return true
		}
	}
	return false
}

// The virtio-serial port is one byte stream for every host connection in
// turn, and it is kept open for the agent's whole life: closing it would make
// the guest kernel discard whatever the next host connection has already
// sent, and a host that reconnects quickly (a restarted shim, a retried dial)
// would then wait for replies to requests the agent never saw.
//
// Host connections are told apart in the stream itself. A read that returns
// 0 means the host side is disconnected (the kernel reports EOF only then,
// and QEMU forwards nothing while it is), so it ends the session. The guest
// can miss that window when the host hangs up and reconnects before the agent
// reads again, so sessions are also split at ttrpc framing: a ttrpc client
// numbers its requests 1, 3, 5, ... from each new connection, so a request
// whose stream id does not increase starts a new session.
//
// A session that ends any other way (a protocol error, a write to a host that
// has gone) may leave the rest of its connection's bytes in the port, so the
// next session skips frames until EOF or a request with stream id 1.

const (
	ttrpcHeaderLen   = 10
	ttrpcTypeRequest = 0x1
	// portPoll bounds each blocking poll so that a closed session's
	// goroutine notices the close.
	portPoll = 100 // ms
	// hostWait is how often a disconnected port is checked for the host's
	// return: poll reports the hangup at once, not its end.
	hostWait = 50 * time.Millisecond
)

// serialListener hands out sessions of the virtio-serial port, one at a time.
type serialListener struct {
	path   string
	free   chan struct{} // holds a token while no session is open
	closed chan struct{}
	once   sync.Once

	// open opens the port once: reads and writes go to rfd and wfd, the
	// same descriptor for a real port (tests split them).
	open     func() (rfd, wfd int, err error)
	openOnce sync.Once
	rfd, wfd int
	openErr  error

	// readMu guards the read state below; a closed session's reader may
	// still be inside read when the next session starts. Its holder polls
	// the port for at most portPoll at a time and checks between polls
	// whether its session closed, so the next session's reader (and a
	// closing session, which takes readMu before it frees the port) waits
	// no longer than one poll for a closed session's reader.
	readMu   sync.Mutex
	pending  []byte // read from the port, not yet handed to a session
	frameEnd int    // bytes of the current frame still to hand over; 0 = at a frame start
	hostGone bool   // the last read saw the host disconnected
	skip     bool   // drop frames until a new host connection starts

	// writeMu keeps replies whole; its holder polls the port as a reader
	// does, and gives up when its session closes or the host goes.
	writeMu sync.Mutex
}

func newSerialListener(path string) *serialListener {
	l := &serialListener{path: path, free: make(chan struct{}, 1), closed: make(chan struct{}), hostGone: true}
	l.open = func() (int, int, error) {
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		return fd, fd, err
	}
	l.free <- struct{}{}
	return l
}

// Accept returns the next session once the previous one is closed.
func (l *serialListener) Accept() (net.Conn, error) {
	select {
	case <-l.free:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	l.openOnce.Do(func() {
		l.rfd, l.wfd, l.openErr = l.open()
	})
	if l.openErr != nil {
		l.free <- struct{}{}
		return nil, fmt.Errorf("open %s: %w", l.path, l.openErr)
	}
	return &serialConn{l: l, done: make(chan struct{})}, nil
}

func (l *serialListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *serialListener) Addr() net.Addr { return fileAddr(l.path) }

// serialConn is one session: the ttrpc connection of one host connection.
type serialConn struct {
	l       *serialListener
	done    chan struct{} // closed by Close
	once    sync.Once
	ended   atomic.Bool // the host connection is over: reads give EOF, writes fail
	clean   atomic.Bool // ended at a connection boundary, nothing of it left in the port
	lastReq uint32      // stream id of the last request handed over
}

func (c *serialConn) isClosed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// end marks the host connection over; clean says the port is at the start
// of the next connection.
func (c *serialConn) end(clean bool) {
	if clean {
		c.clean.Store(true)
	}
	c.ended.Store(true)
}

func (c *serialConn) Read(p []byte) (int, error) {
	l := c.l
	l.readMu.Lock()
	defer l.readMu.Unlock()
	for {
		if c.isClosed() {
			return 0, net.ErrClosed
		}
		if c.ended.Load() {
			return 0, io.EOF
		}
		if l.frameEnd > 0 && len(l.pending) > 0 {
			n := copy(p, l.pending[:min(len(l.pending), l.frameEnd)])
			if l.skip {
				n = min(len(l.pending), l.frameEnd)
			}
			l.pending = l.pending[n:]
			l.frameEnd -= n
			if l.skip {
				continue
			}
			return n, nil
		}
		if l.frameEnd == 0 && len(l.pending) >= ttrpcHeaderLen {
			length := binary.BigEndian.Uint32(l.pending[0:4])
			sid := binary.BigEndian.Uint32(l.pending[4:8])
			isReq := l.pending[8] == ttrpcTypeRequest
			if l.skip {
				if isReq && sid == 1 {
					l.skip = false
				} else {
					l.frameEnd = ttrpcHeaderLen + int(length)
					continue
				}
			}
			if isReq {
				if c.lastReq != 0 && sid <= c.lastReq {
					// A new host connection, whose hangup was missed.
					log.Printf("virtio-serial: new host connection (request stream %d after %d)", sid, c.lastReq)
					c.end(true)
					return 0, io.EOF
				}
				c.lastReq = sid
			}
			// ttrpc reads (and discards) an oversized frame the same way.
			l.frameEnd = ttrpcHeaderLen + int(length)
			continue
		}
		if err := c.fill(); err != nil {
			return 0, err
		}
	}
}

// fill reads more of the port into pending; io.EOF when the host hung up.
func (c *serialConn) fill() error {
	l := c.l
	buf := make([]byte, 32<<10)
	for {
		if c.isClosed() {
			return net.ErrClosed
		}
		n, err := unix.Read(l.rfd, buf)
		switch {
		case n > 0:
			l.hostGone = false
			l.pending = append(l.pending, buf[:n]...)
			return nil
		case errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.EAGAIN):
			l.hostGone = false
			fds := []unix.PollFd{{Fd: int32(l.rfd), Events: unix.POLLIN}}
			if _, err := unix.Poll(fds, portPoll); err != nil && !errors.Is(err, unix.EINTR) {
				return fmt.Errorf("poll %s: %w", l.path, err)
			}
		case err == nil: // n == 0: the host side is disconnected
			if !l.hostGone {
				l.hostGone = true
				// Whatever is left of a frame died with its connection.
				l.pending = l.pending[:0]
				l.frameEnd = 0
				l.skip = false
				c.end(true)
				return io.EOF
			}
			time.Sleep(hostWait)
		default:
			return fmt.Errorf("read %s: %w", l.path, err)
		}
	}
}

func (c *serialConn) Write(p []byte) (int, error) {
	l := c.l
	l.writeMu.Lock()
	defer l.writeMu.Unlock()
	written := 0
	for written < len(p) {
		if c.isClosed() {
			return written, net.ErrClosed
		}
		if c.ended.Load() {
			// Replies of a finished connection must not reach the next one.
			return written, fmt.Errorf("write %s: %w", l.path, unix.EPIPE)
		}
		n, err := unix.Write(l.wfd, p[written:])
		if n > 0 {
			written += n
			continue
		}
		switch {
		case errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.EAGAIN):
			fds := []unix.PollFd{{Fd: int32(l.wfd), Events: unix.POLLOUT}}
			if _, err := unix.Poll(fds, portPoll); err != nil && !errors.Is(err, unix.EINTR) {
				return written, fmt.Errorf("poll %s: %w", l.path, err)
			}
			if fds[0].Revents&unix.POLLHUP != 0 {
				// The host is gone; what this session still has to say
				// would go to whoever connects next.
				c.end(false)
			}
		case err == nil:
			return written, io.ErrShortWrite
		default:
			return written, fmt.Errorf("write %s: %w", l.path, err)
		}
	}
	return written, nil
}

// Close ends the session; the port stays open for the next one.
func (c *serialConn) Close() error {
	c.once.Do(func() {
		close(c.done)
		go func() {
			// Wait for a reader still inside Read before the next session
			// may start, and leave the read state as the next one needs it.
			c.l.readMu.Lock()
			if !c.clean.Load() || c.l.frameEnd > 0 {
				c.l.skip = true
			}
			c.l.readMu.Unlock()
			log.Printf("virtio-serial session closed (at a host connection boundary: %t)", !c.l.skip)
			c.l.free <- struct{}{}
		}()
	})
	return nil
}

func (c *serialConn) LocalAddr() net.Addr              { return fileAddr(c.l.path) }
func (c *serialConn) RemoteAddr() net.Addr             { return fileAddr("host") }
func (c *serialConn) SetDeadline(time.Time) error      { return errors.ErrUnsupported }
func (c *serialConn) SetReadDeadline(time.Time) error  { return errors.ErrUnsupported }
func (c *serialConn) SetWriteDeadline(time.Time) error { return errors.ErrUnsupported }

type fileAddr string

func (a fileAddr) Network() string { return "virtio-serial" }
func (a fileAddr) String() string  { return string(a) }

// vsockListener accepts AF_VSOCK connections through the runtime poller.
type vsockListener struct {
	f    *os.File
	port uint32
}

func listenVsock(port uint32) (*vsockListener, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock bind port %d: %w", port, err)
	}
	if err := unix.Listen(fd, 16); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock listen: %w", err)
	}
	return &vsockListener{f: os.NewFile(uintptr(fd), "vsock"), port: port}, nil
}

func (l *vsockListener) Accept() (net.Conn, error) {
	rc, err := l.f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var nfd int
	var aerr error
	err = rc.Read(func(fd uintptr) bool {
		nfd, _, aerr = unix.Accept4(int(fd), unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
		return !errors.Is(aerr, unix.EAGAIN)
	})
	if err != nil {
		return nil, err
	}
	if aerr != nil {
		return nil, fmt.Errorf("vsock accept: %w", aerr)
	}
	return &vsockConn{File: os.NewFile(uintptr(nfd), "vsock-conn")}, nil
}

func (l *vsockListener) Close() error   { return l.f.Close() }
func (l *vsockListener) Addr() net.Addr { return vsockAddr(fmt.Sprintf("vsock://-1:%d", l.port)) }

type vsockConn struct{ *os.File }

// CloseWrite shuts the sending half down, so the host reads the end of a
// forwarded stream while it may still send.
func (c *vsockConn) CloseWrite() error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Shutdown(int(fd), unix.SHUT_WR) }); err != nil {
		return err
	}
	return serr
}

func (c *vsockConn) LocalAddr() net.Addr  { return vsockAddr("vsock-local") }
func (c *vsockConn) RemoteAddr() net.Addr { return vsockAddr("vsock-host") }

type vsockAddr string

func (a vsockAddr) Network() string { return "vsock" }
func (a vsockAddr) String() string  { return string(a) }

// ListenForward listens on the port-forward service's vsock port
// (agent/portfwd); it needs a vsock device, as the service has no
// virtio-serial form.
func ListenForward() (net.Listener, error) {
	if !hasVsockDevice() {
		return nil, errors.New("no vsock device: port forwarding needs a vsock agent channel")
	}
	return listenVsock(portfwd.VsockPort)
}

// Wait waits for the agent channels to appear (virtio devices probe
// asynchronously after their modules load, and virtio-serial ports arrive
// later still) and returns the listeners. A vsock device alone is served once
// a short grace period for a serial port has passed.
func Wait(timeout time.Duration) []net.Listener {
	start := time.Now()
	for {
		port, serial := findSerialPort(SerialPortName)
		vsock := hasVsockDevice()
		waited := time.Since(start)
		if serial || (vsock && waited > 2*time.Second) || waited > timeout {
			var ls []net.Listener
			if vsock {
				if l, err := listenVsock(vsockPort); err != nil {
					log.Printf("vsock: %v", err)
				} else {
					log.Printf("listening on vsock port %d", vsockPort)
					ls = append(ls, l)
				}
			}
			if serial {
				log.Printf("serving on virtio-serial port %s (%s)", SerialPortName, port)
				ls = append(ls, newSerialListener(port))
			}
			return ls
		}
		time.Sleep(10 * time.Millisecond)
	}
}
