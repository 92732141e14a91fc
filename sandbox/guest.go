package sandbox

import (
	"context"
	"io"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/config"
)

// Guest runs and watches a sandbox's processes through its guest agent,
// in the sandbox's own types: its callers (the shim, kata-fsx run and
// exec) never see the agent's protocol, as Kata's shim holds a VCSandbox
// and never the agent's. A process is named by its container id and the
// agent's exec id, which is the container id for the init process.
type Guest struct {
	a *agent.Client
}

// Guest returns the sandbox's connection to its guest agent; nil once
// ReleaseAgent let it go.
func (s *Sandbox) Guest() *Guest {
	if s.agent == nil {
		return nil
	}
	return &Guest{a: s.agent}
}

// DialGuest connects to the agent of the running sandbox id from another
// process (kata-fsx exec); the caller closes it.
func DialGuest(ctx context.Context, c *config.Config, id string, timeout time.Duration) (*Guest, error) {
	transport, err := DialTransport(c, id)
	if err != nil {
		return nil, err
	}
	a, err := agent.Dial(ctx, transport, timeout)
	if err != nil {
		return nil, err
	}
	return &Guest{a: a}, nil
}

// Close closes the connection.
func (g *Guest) Close() error { return g.a.Close() }

// ExclusiveChannel reports whether the agent's channel takes one host
// connection at a time (virtio-serial), so that another client can
// connect only once this one is closed.
func (g *Guest) ExclusiveChannel() bool {
	_, serial := g.a.Transport().(agent.SerialTransport)
	return serial
}

// ProcessSpec is an exec process as the guest runs it, checked.
type ProcessSpec struct {
	p *pb.Process
}

// NewProcessSpec converts an exec's OCI process, refusing one the agent
// could not run.
func NewProcessSpec(p *specs.Process) (*ProcessSpec, error) {
	s, err := agentSpec(&specs.Spec{Process: p}, "/", false)
	if err != nil {
		return nil, err
	}
	return &ProcessSpec{p: s.Process}, nil
}

// StartContainer starts the init process of a created container.
func (g *Guest) StartContainer(ctx context.Context, cid string) error {
	return g.a.StartContainer(ctx, cid)
}

// Exec starts process p in container cid as execID.
func (g *Guest) Exec(ctx context.Context, cid, execID string, p *ProcessSpec) error {
	return g.a.ExecProcess(ctx, &pb.ExecProcessRequest{ContainerId: cid, ExecId: execID, Process: p.p})
}

// Wait waits for a process to exit and returns its exit status.
func (g *Guest) Wait(ctx context.Context, cid, execID string) (int32, error) {
	return g.a.WaitProcess(ctx, cid, execID)
}

// Signal sends sig to a process.
func (g *Guest) Signal(ctx context.Context, cid, execID string, sig syscall.Signal) error {
	return g.a.SignalProcess(ctx, cid, execID, sig)
}

// ResizePty sets the size of a process's terminal.
func (g *Guest) ResizePty(ctx context.Context, cid, execID string, rows, cols uint32) error {
	return g.a.TtyWinResize(ctx, cid, execID, rows, cols)
}

// WriteStdin writes data to a process's stdin.
func (g *Guest) WriteStdin(ctx context.Context, cid, execID string, data []byte) (int, error) {
	return g.a.WriteStdin(ctx, cid, execID, data)
}

// CloseStdin ends a process's stdin.
func (g *Guest) CloseStdin(ctx context.Context, cid, execID string) error {
	return g.a.CloseStdin(ctx, cid, execID)
}

// Output is a process's stdout (or stderr) until the process closes it:
// the reader ends with io.EOF then.
func (g *Guest) Output(ctx context.Context, cid, execID string, stderr bool) io.Reader {
	return g.a.StreamReader(ctx, cid, execID, stderr)
}

// Update changes a container's cgroup resources in the guest.
func (g *Guest) Update(ctx context.Context, cid string, res *specs.LinuxResources) error {
	return g.a.UpdateContainer(ctx, cid, AgentResources(res))
}

// Pause freezes a container's processes.
func (g *Guest) Pause(ctx context.Context, cid string) error { return g.a.PauseContainer(ctx, cid) }

// Resume thaws a paused container.
func (g *Guest) Resume(ctx context.Context, cid string) error { return g.a.ResumeContainer(ctx, cid) }

// OOMEvent waits for the guest's next OOM kill and returns the container
// it happened in.
func (g *Guest) OOMEvent(ctx context.Context) (string, error) { return g.a.GetOOMEvent(ctx) }

// Stats returns a container's cgroup statistics as containerd's cgroup
// v2 metrics.
func (g *Guest) Stats(ctx context.Context, cid string) (*ContainerStats, error) {
	st, err := g.a.StatsContainer(ctx, cid)
	if err != nil {
		return nil, err
	}
	return containerStats(st), nil
}
