// Package agent is the host-side client of the Kata guest agent protocol
// (ttrpc services grpc.AgentService and grpc.Health), spoken over vsock
// (vhost-vsock), a hybrid vsock's unix socket, or a virtio-serial port.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"syscall"
	"time"

	"github.com/containerd/ttrpc"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// DefaultDialTimeout applies when Dial is given a zero timeout.
const DefaultDialTimeout = 30 * time.Second

// ErrUnreachable is wrapped by Dial's error when the agent did not answer a
// health check before the dial timeout.
var ErrUnreachable = errors.New("guest agent unreachable")

// ErrNotServing is returned when the agent answers the health check with a
// status other than SERVING.
var ErrNotServing = errors.New("guest agent not serving")

const (
	// attemptMax bounds one connection's health check, so that a request
	// lost with an earlier connection of the same port (see dialOnce) costs
	// one attempt, not the whole dial timeout.
	attemptMax = 10 * time.Second
	attemptMin = time.Second
	retryFirst = 10 * time.Millisecond
	retryMax   = 500 * time.Millisecond
	// maxChunk keeps each stream request and reply well below ttrpc's 4 MiB
	// message limit.
	maxChunk = 1 << 20
)

// Client is a connected guest agent; its methods are safe for concurrent use.
type Client struct {
	transport Transport
	ttrpc     *ttrpc.Client
	agent     pb.AgentServiceService
	health    pb.HealthService
}

// Dial connects to the agent over t, retrying until timeout (the
// `[agent.kata] dial_timeout` of the configuration) has passed, and returns
// once the agent has answered grpc.Health/Check with SERVING. A zero timeout
// means DefaultDialTimeout. On failure the error names the transport and wraps
// both ErrUnreachable and the last attempt's error.
func Dial(ctx context.Context, t Transport, timeout time.Duration) (*Client, error) {
	if t == nil {
		return nil, errors.New("dial agent: no transport")
	}
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	wait := retryFirst
	perAttempt := min(attemptMax, max(attemptMin, timeout/4))
	var lastErr error
	for attempt := 1; ; attempt++ {
		actx, acancel := context.WithTimeout(dctx, perAttempt)
		c, err := dialOnce(actx, t)
		acancel()
		if err == nil {
			return c, nil
		}
		// An attempt cut short by the dial deadline says less than the
		// failure before it (a refused or missing socket): keep that one.
		if lastErr == nil || dctx.Err() == nil {
			lastErr = err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("dial agent over %s: %w (last error: %w)", t, ctx.Err(), lastErr)
		}
		timer := time.NewTimer(wait)
		select {
		case <-dctx.Done():
			timer.Stop()
			if ctx.Err() != nil {
				return nil, fmt.Errorf("dial agent over %s: %w (last error: %w)", t, ctx.Err(), lastErr)
			}
			return nil, fmt.Errorf("dial agent over %s: %w after %s and %d attempts (last error: %w)",
				t, ErrUnreachable, timeout, attempt, lastErr)
		case <-timer.C:
		}
		wait = min(2*wait, retryMax)
	}
}

// dialOnce connects and health-checks once, on a fresh connection that it
// closes again on failure. On a virtio-serial port the connect succeeds
// before the guest has opened its side; QEMU then holds our bytes until it
// does, so the check waits, bounded by ctx. A check can also go unanswered
// when the request reached a guest that was just dropping an earlier host
// connection; the next attempt's fresh connection recovers from that.
func dialOnce(ctx context.Context, t Transport) (*Client, error) {
	conn, err := t.DialContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	c := NewClient(t, ttrpc.NewClient(conn))
	if err := c.Check(ctx); err != nil {
		c.Close() // closes conn too: the next attempt starts afresh
		return nil, err
	}
	return c, nil
}

// NewClient wraps an established ttrpc client; Dial is the usual way in.
func NewClient(t Transport, tc *ttrpc.Client) *Client {
	return &Client{
		transport: t,
		ttrpc:     tc,
		agent:     pb.NewAgentServiceClient(tc),
		health:    pb.NewHealthClient(tc),
	}
}

// Transport returns the transport the client was dialed over.
func (c *Client) Transport() Transport { return c.transport }

// Close closes the connection to the agent.
func (c *Client) Close() error { return c.ttrpc.Close() }

// Check calls grpc.Health/Check and fails unless the agent is SERVING.
func (c *Client) Check(ctx context.Context) error {
	resp, err := c.health.Check(ctx, &pb.CheckRequest{})
	if err != nil {
		return fmt.Errorf("agent health check: %w", err)
	}
	if resp.GetStatus() != pb.HealthCheckResponse_SERVING {
		return fmt.Errorf("agent health check: %w: status %s", ErrNotServing, resp.GetStatus())
	}
	return nil
}

// CreateSandbox asks the agent to set up the sandbox and mount its storages.
func (c *Client) CreateSandbox(ctx context.Context, req *pb.CreateSandboxRequest) error {
	if _, err := c.agent.CreateSandbox(ctx, req); err != nil {
		return fmt.Errorf("agent CreateSandbox %q: %w", req.GetSandboxId(), err)
	}
	return nil
}

// DestroySandbox asks the agent to unmount everything and power the VM off.
func (c *Client) DestroySandbox(ctx context.Context) error {
	if _, err := c.agent.DestroySandbox(ctx, &pb.DestroySandboxRequest{}); err != nil {
		return fmt.Errorf("agent DestroySandbox: %w", err)
	}
	return nil
}

// CreateContainer creates a container (storages mounted, process not yet run).
func (c *Client) CreateContainer(ctx context.Context, req *pb.CreateContainerRequest) error {
	if _, err := c.agent.CreateContainer(ctx, req); err != nil {
		return fmt.Errorf("agent CreateContainer %q: %w", req.GetContainerId(), err)
	}
	return nil
}

// StartContainer runs the container's init process.
func (c *Client) StartContainer(ctx context.Context, containerID string) error {
	if _, err := c.agent.StartContainer(ctx, &pb.StartContainerRequest{ContainerId: containerID}); err != nil {
		return fmt.Errorf("agent StartContainer %q: %w", containerID, err)
	}
	return nil
}

// RemoveContainer kills what is left of a container and releases it; a zero
// timeout lets the agent wait for ever.
func (c *Client) RemoveContainer(ctx context.Context, containerID string, timeout time.Duration) error {
	secs := timeout.Seconds()
	if secs > math.MaxUint32 {
		secs = math.MaxUint32
	}
	req := &pb.RemoveContainerRequest{ContainerId: containerID, Timeout: uint32(math.Ceil(secs))}
	if _, err := c.agent.RemoveContainer(ctx, req); err != nil {
		return fmt.Errorf("agent RemoveContainer %q: %w", containerID, err)
	}
	return nil
}

// ExecProcess starts an extra process inside a running container.
func (c *Client) ExecProcess(ctx context.Context, req *pb.ExecProcessRequest) error {
	if _, err := c.agent.ExecProcess(ctx, req); err != nil {
		return fmt.Errorf("agent ExecProcess %q/%q: %w", req.GetContainerId(), req.GetExecId(), err)
	}
	return nil
}

// WaitProcess blocks until the process exits and returns its exit status
// (128+signal for a process killed by a signal).
func (c *Client) WaitProcess(ctx context.Context, containerID, execID string) (int32, error) {
	resp, err := c.agent.WaitProcess(ctx, &pb.WaitProcessRequest{ContainerId: containerID, ExecId: execID})
	if err != nil {
		return 0, fmt.Errorf("agent WaitProcess %q/%q: %w", containerID, execID, err)
	}
	return resp.GetStatus(), nil
}

// SignalProcess sends sig to a process; an empty execID means the container's
// init process.
func (c *Client) SignalProcess(ctx context.Context, containerID, execID string, sig syscall.Signal) error {
	if sig < 0 {
		return fmt.Errorf("agent SignalProcess %q/%q: negative signal %d", containerID, execID, sig)
	}
	req := &pb.SignalProcessRequest{ContainerId: containerID, ExecId: execID, Signal: uint32(sig)}
	if _, err := c.agent.SignalProcess(ctx, req); err != nil {
		return fmt.Errorf("agent SignalProcess %q/%q: %w", containerID, execID, err)
	}
	return nil
}

// ReadStdout reads the next chunk of a process's stdout into p; it returns
// io.EOF once the stream has ended (the agent answers with empty data).
func (c *Client) ReadStdout(ctx context.Context, containerID, execID string, p []byte) (int, error) {
	return c.read(ctx, c.agent.ReadStdout, "ReadStdout", containerID, execID, p)
}

// ReadStderr is ReadStdout for stderr.
func (c *Client) ReadStderr(ctx context.Context, containerID, execID string, p []byte) (int, error) {
	return c.read(ctx, c.agent.ReadStderr, "ReadStderr", containerID, execID, p)
}

func (c *Client) read(ctx context.Context,
	call func(context.Context, *pb.ReadStreamRequest) (*pb.ReadStreamResponse, error),
	name, containerID, execID string, p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	n := min(len(p), maxChunk)
	resp, err := call(ctx, &pb.ReadStreamRequest{ContainerId: containerID, ExecId: execID, Len: uint32(n)})
	if err != nil {
		return 0, fmt.Errorf("agent %s %q/%q: %w", name, containerID, execID, err)
	}
	data := resp.GetData()
	if len(data) == 0 {
		return 0, io.EOF
	}
	if len(data) > len(p) {
		return 0, fmt.Errorf("agent %s %q/%q: agent returned %d bytes for a %d-byte read", name, containerID, execID, len(data), len(p))
	}
	return copy(p, data), nil
}

// WriteStdin writes data to a process's stdin, in chunks that fit a ttrpc
// message, and returns how much the agent took. Empty data sends nothing:
// Kata's agent reads an empty write as closing stdin (CloseStdin does that).
func (c *Client) WriteStdin(ctx context.Context, containerID, execID string, data []byte) (int, error) {
	if len(data) == 0 {
		return 0, nil
	}
	written := 0
	for {
		chunk := data[written:min(len(data), written+maxChunk)]
		resp, err := c.agent.WriteStdin(ctx, &pb.WriteStreamRequest{ContainerId: containerID, ExecId: execID, Data: chunk})
		if err != nil {
			return written, fmt.Errorf("agent WriteStdin %q/%q: %w", containerID, execID, err)
		}
		if int64(resp.GetLen()) > int64(len(chunk)) {
			return written, fmt.Errorf("agent WriteStdin %q/%q: agent claims %d bytes written of %d", containerID, execID, resp.GetLen(), len(chunk))
		}
		written += int(resp.GetLen())
		if written == len(data) {
			return written, nil
		}
		if int(resp.GetLen()) < len(chunk) {
			return written, fmt.Errorf("agent WriteStdin %q/%q: %w", containerID, execID, io.ErrShortWrite)
		}
	}
}

// CloseStdin closes a process's stdin.
func (c *Client) CloseStdin(ctx context.Context, containerID, execID string) error {
	if _, err := c.agent.CloseStdin(ctx, &pb.CloseStdinRequest{ContainerId: containerID, ExecId: execID}); err != nil {
		return fmt.Errorf("agent CloseStdin %q/%q: %w", containerID, execID, err)
	}
	return nil
}

// TtyWinResize resizes a process's terminal.
func (c *Client) TtyWinResize(ctx context.Context, containerID, execID string, rows, cols uint32) error {
	req := &pb.TtyWinResizeRequest{ContainerId: containerID, ExecId: execID, Row: rows, Column: cols}
	if _, err := c.agent.TtyWinResize(ctx, req); err != nil {
		return fmt.Errorf("agent TtyWinResize %q/%q: %w", containerID, execID, err)
	}
	return nil
}

// StreamReader returns an io.Reader over a process's stdout (or stderr) that
// ends with io.EOF when the agent reports the end of the stream.
func (c *Client) StreamReader(ctx context.Context, containerID, execID string, stderr bool) io.Reader {
	return &streamReader{ctx: ctx, c: c, cid: containerID, eid: execID, stderr: stderr}
}

type streamReader struct {
	ctx      context.Context
	c        *Client
	cid, eid string
	stderr   bool
}

func (r *streamReader) Read(p []byte) (int, error) {
	if r.stderr {
		return r.c.ReadStderr(r.ctx, r.cid, r.eid, p)
	}
	return r.c.ReadStdout(r.ctx, r.cid, r.eid, p)
}
