package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultVsockPort is the vsock port the Kata agent listens on.
const DefaultVsockPort = 1024

// Transport is a way to reach the guest agent's ttrpc stream.
type Transport interface {
	// DialContext opens one connection attempt to the agent.
	DialContext(ctx context.Context) (net.Conn, error)
	// String names the transport in errors and logs.
	String() string
}

// VsockTransport reaches the agent over AF_VSOCK (needs vhost-vsock on the host).
type VsockTransport struct {
	// CID is the guest context id given to QEMU's vhost-vsock-pci device.
	CID uint32
	// Port is the agent's vsock port; zero means DefaultVsockPort.
	Port uint32
}

// String implements Transport.
func (t VsockTransport) String() string {
	return fmt.Sprintf("vsock://%d:%d", t.CID, t.port())
}

func (t VsockTransport) port() uint32 {
	if t.Port == 0 {
		return DefaultVsockPort
	}
	return t.Port
}

// DialContext implements Transport. The connect runs on a non-blocking socket
// so that ctx bounds it: vsock connects to a guest that is still booting can
// otherwise block for the kernel's connect timeout.
func (t VsockTransport) DialContext(ctx context.Context) (net.Conn, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket: %w", err)
	}
	err = unix.Connect(fd, &unix.SockaddrVM{CID: t.CID, Port: t.port()})
	if err != nil && !errors.Is(err, unix.EINPROGRESS) {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock connect: %w", err)
	}
	if err != nil {
		if err := waitConnected(ctx, fd); err != nil {
			unix.Close(fd)
			return nil, err
		}
	}
	f := os.NewFile(uintptr(fd), t.String())
	return &fileConn{File: f, addr: vsockAddr(t.String())}, nil
}

// waitConnected polls a non-blocking connect until it completes or ctx ends.
func waitConnected(ctx context.Context, fd int) error {
	for {
		timeout := 100
		if dl, ok := ctx.Deadline(); ok {
			left := time.Until(dl)
			if left <= 0 {
				return fmt.Errorf("vsock connect: %w", context.DeadlineExceeded)
			}
			if ms := int(left / time.Millisecond); ms < timeout {
				timeout = max(ms, 1)
			}
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(fds, timeout)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("vsock connect poll: %w", err)
		}
		if n > 0 {
			soErr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
			if err != nil {
				return fmt.Errorf("vsock connect: %w", err)
			}
			if soErr != 0 {
				return fmt.Errorf("vsock connect: %w", unix.Errno(soErr))
			}
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("vsock connect: %w", err)
		}
	}
}

// SerialTransport reaches the agent through a virtio-serial port whose host
// side is a QEMU `-chardev socket,server=on` unix socket.
type SerialTransport struct {
	// Path is the unix socket QEMU listens on for the agent.channel.0 port.
	Path string
}

// String implements Transport.
func (t SerialTransport) String() string { return "virtio-serial:" + t.Path }

// DialContext implements Transport.
func (t SerialTransport) DialContext(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", t.Path)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// maxHybridReply bounds the handshake reply: "OK 4294967295\n" is 14
// bytes, so a longer line is not a hybrid vsock speaking.
const maxHybridReply = 32

// HybridVsockTransport reaches the agent through a hybrid vsock: a unix
// socket in front of the guest's vsock device (Kata's scheme for Cloud
// Hypervisor and Firecracker, and kata-fsx's in-process vhost-user-vsock
// device). After "CONNECT <port>\n" and the reply "OK <hostport>\n" the
// unix connection is the guest stream.
type HybridVsockTransport struct {
	// Path is the hybrid vsock's unix socket.
	Path string
	// Port is the agent's vsock port; zero means DefaultVsockPort.
	Port uint32
}

// String implements Transport.
func (t HybridVsockTransport) String() string {
	return fmt.Sprintf("hybrid-vsock:%s:%d", t.Path, t.port())
}

func (t HybridVsockTransport) port() uint32 {
	if t.Port == 0 {
		return DefaultVsockPort
	}
	return t.Port
}

// DialContext implements Transport: it connects and runs the handshake,
// both bounded by ctx.
func (t HybridVsockTransport) DialContext(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", t.Path)
	if err != nil {
		return nil, fmt.Errorf("hybrid vsock %s: %w", t.Path, err)
	}
	if err := t.handshake(ctx, c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// handshake sends CONNECT and reads the reply one byte at a time: the
// bytes after the newline are the guest's, and a buffered reader would
// swallow them.
func (t HybridVsockTransport) handshake(ctx context.Context, c net.Conn) error {
	// The end of ctx (cancel or deadline) unblocks the write and the reads
	// through a past deadline; ctx.Err is set by then, so the error is the
	// context's rather than a bare i/o timeout.
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	reply, err := t.exchange(c)
	if !stop() || ctx.Err() != nil {
		return fmt.Errorf("hybrid vsock %s: CONNECT %d: %w (reply so far %q)", t.Path, t.port(), ctx.Err(), reply)
	}
	if err != nil {
		return err
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		return fmt.Errorf("hybrid vsock %s: %w", t.Path, err)
	}
	return nil
}

// exchange writes CONNECT and reads and checks the reply line; it returns
// what was read, for errors.
func (t HybridVsockTransport) exchange(c net.Conn) (string, error) {
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", t.port()); err != nil {
		return "", fmt.Errorf("hybrid vsock %s: send CONNECT %d: %w", t.Path, t.port(), err)
	}
	var line []byte
	b := make([]byte, 1)
	for {
		n, err := c.Read(b)
		if n == 1 {
			if b[0] == '\n' {
				break
			}
			line = append(line, b[0])
			if len(line) >= maxHybridReply {
				return string(line), fmt.Errorf("hybrid vsock %s: CONNECT %d: reply line longer than %d bytes: %q", t.Path, t.port(), maxHybridReply, line)
			}
			continue
		}
		if errors.Is(err, io.EOF) {
			return string(line), fmt.Errorf("hybrid vsock %s: CONNECT %d refused: the connection closed after %q (is the agent listening on vsock port %d?)", t.Path, t.port(), line, t.port())
		}
		if err != nil {
			return string(line), fmt.Errorf("hybrid vsock %s: CONNECT %d: read reply after %q: %w", t.Path, t.port(), line, err)
		}
	}
	rest, ok := strings.CutPrefix(string(line), "OK ")
	if _, err := strconv.ParseUint(rest, 10, 32); !ok || err != nil {
		return string(line), fmt.Errorf("hybrid vsock %s: CONNECT %d: want \"OK <port>\", got %q", t.Path, t.port(), line)
	}
	return string(line), nil
}

type vsockAddr string

func (a vsockAddr) Network() string { return "vsock" }
func (a vsockAddr) String() string  { return string(a) }

// fileConn adapts a pollable socket file to net.Conn for ttrpc.
type fileConn struct {
	*os.File
	addr net.Addr
}

func (c *fileConn) LocalAddr() net.Addr  { return c.addr }
func (c *fileConn) RemoteAddr() net.Addr { return c.addr }
