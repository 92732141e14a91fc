package agent

import (
	"context"
	"fmt"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// UpdateContainer rewrites a running container's cgroup limits in the guest.
func (c *Client) UpdateContainer(ctx context.Context, containerID string, res *pb.LinuxResources) error {
	if _, err := c.agent.UpdateContainer(ctx, &pb.UpdateContainerRequest{ContainerId: containerID, Resources: res}); err != nil {
		return fmt.Errorf("agent UpdateContainer %q: %w", containerID, err)
	}
	return nil
}

// StatsContainer returns the accounting of a container's cgroup in the guest.
func (c *Client) StatsContainer(ctx context.Context, containerID string) (*pb.StatsContainerResponse, error) {
	resp, err := c.agent.StatsContainer(ctx, &pb.StatsContainerRequest{ContainerId: containerID})
	if err != nil {
		return nil, fmt.Errorf("agent StatsContainer %q: %w", containerID, err)
	}
	return resp, nil
}

// PauseContainer freezes every process of a container.
func (c *Client) PauseContainer(ctx context.Context, containerID string) error {
	if _, err := c.agent.PauseContainer(ctx, &pb.PauseContainerRequest{ContainerId: containerID}); err != nil {
		return fmt.Errorf("agent PauseContainer %q: %w", containerID, err)
	}
	return nil
}

// ResumeContainer thaws a paused container.
func (c *Client) ResumeContainer(ctx context.Context, containerID string) error {
	if _, err := c.agent.ResumeContainer(ctx, &pb.ResumeContainerRequest{ContainerId: containerID}); err != nil {
		return fmt.Errorf("agent ResumeContainer %q: %w", containerID, err)
	}
	return nil
}

// GetOOMEvent blocks until the guest OOM-kills a process of a container and
// returns that container's id.
func (c *Client) GetOOMEvent(ctx context.Context) (string, error) {
	ev, err := c.agent.GetOOMEvent(ctx, &pb.GetOOMEventRequest{})
	if err != nil {
		return "", fmt.Errorf("agent GetOOMEvent: %w", err)
	}
	return ev.GetContainerId(), nil
}
