package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
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
