package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

// ErrNoForward is wrapped by the port-forward calls when the agent's
// channel cannot reach another guest port (virtio-serial).
var ErrNoForward = errors.New("port forwarding needs a vsock agent channel (vhost-vsock or hybrid vsock), not virtio-serial")

// watchFirstWait bounds WatchPorts' dial and first reply.
const watchFirstWait = 10 * time.Second

// forwardTransport is t dialling the guest's port-forward service.
func forwardTransport(t Transport) (Transport, error) {
	switch t := t.(type) {
	case VsockTransport:
		t.Port = portfwd.VsockPort
		return t, nil
	case HybridVsockTransport:
		t.Port = portfwd.VsockPort
		return t, nil
	}
	return nil, fmt.Errorf("%s: %w", t, ErrNoForward)
}

// forwardRequest dials the service, sends req and reads the reply line,
// both bounded by ctx; on success the connection is left open after the
// reply, for a stream.
func (c *Client) forwardRequest(ctx context.Context, req portfwd.Request) (net.Conn, []uint16, error) {
	t, err := forwardTransport(c.transport)
	if err != nil {
		return nil, nil, err
	}
	conn, err := t.DialContext(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("port-forward %s: %w", req, err)
	}
	// The end of ctx unblocks the exchange through a past deadline.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	ports, err := exchangeForward(conn, req)
	if !stop() || ctx.Err() != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("port-forward %s: %w", req, ctx.Err())
	}
	if err == nil {
		err = conn.SetDeadline(time.Time{})
	}
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("port-forward %s: %w", req, err)
	}
	return conn, ports, nil
}

func exchangeForward(conn net.Conn, req portfwd.Request) ([]uint16, error) {
	if _, err := conn.Write(req.Marshal()); err != nil {
		return nil, err
	}
	return portfwd.ReadReply(conn)
}

// WatchPorts follows the TCP ports something in the pod listens on: it
// calls fn with them (ascending, at most portfwd.MaxPorts) at once and then
// each time they change, until ctx ends or the connection fails, and
// returns why it stopped. The dial and the first reply must come within
// watchFirstWait; after that a quiet guest is a pod whose ports do not
// change.
func (c *Client) WatchPorts(ctx context.Context, fn func(ports []uint16)) error {
	fctx, cancel := context.WithTimeout(ctx, watchFirstWait)
	conn, ports, err := c.forwardRequest(fctx, portfwd.Request{Watch: true})
	cancel()
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	for {
		fn(ports)
		ports, err = portfwd.ReadReply(conn)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("port-forward watch: %w", err)
		}
	}
}

// DialPort opens a stream to TCP port in the guest, as a client on the
// pod's loopback would reach it; ctx bounds the dial only.
func (c *Client) DialPort(ctx context.Context, port uint16) (net.Conn, error) {
	if port == 0 {
		return nil, errors.New("port-forward: port 0")
	}
	conn, _, err := c.forwardRequest(ctx, portfwd.Request{Port: port})
	return conn, err
}
