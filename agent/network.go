package agent

import (
	"context"
	"fmt"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// UpdateInterface configures the guest NIC the interface names (found by
// its MAC or PCI path) and returns it as the guest now has it.
func (c *Client) UpdateInterface(ctx context.Context, ifc *pb.Interface) (*pb.Interface, error) {
	got, err := c.agent.UpdateInterface(ctx, &pb.UpdateInterfaceRequest{Interface: ifc})
	if err != nil {
		return nil, fmt.Errorf("agent UpdateInterface %s (%s): %w", ifc.GetName(), ifc.GetHwAddr(), err)
	}
	return got, nil
}

// UpdateRoutes replaces the guest's routes with routes and returns the
// guest's routes after the update.
func (c *Client) UpdateRoutes(ctx context.Context, routes []*pb.Route) ([]*pb.Route, error) {
	got, err := c.agent.UpdateRoutes(ctx, &pb.UpdateRoutesRequest{Routes: &pb.Routes{Routes: routes}})
	if err != nil {
		return nil, fmt.Errorf("agent UpdateRoutes: %w", err)
	}
	return got.GetRoutes(), nil
}

// AddARPNeighbors adds neighbour entries to the guest's tables.
func (c *Client) AddARPNeighbors(ctx context.Context, neighbors []*pb.ARPNeighbor) error {
	if _, err := c.agent.AddARPNeighbors(ctx, &pb.AddARPNeighborsRequest{Neighbors: &pb.ARPNeighbors{ARPNeighbors: neighbors}}); err != nil {
		return fmt.Errorf("agent AddARPNeighbors: %w", err)
	}
	return nil
}

// ListInterfaces returns the guest's network interfaces.
func (c *Client) ListInterfaces(ctx context.Context) ([]*pb.Interface, error) {
	got, err := c.agent.ListInterfaces(ctx, &pb.ListInterfacesRequest{})
	if err != nil {
		return nil, fmt.Errorf("agent ListInterfaces: %w", err)
	}
	return got.GetInterfaces(), nil
}

// ListRoutes returns the guest's routes.
func (c *Client) ListRoutes(ctx context.Context) ([]*pb.Route, error) {
	got, err := c.agent.ListRoutes(ctx, &pb.ListRoutesRequest{})
	if err != nil {
		return nil, fmt.Errorf("agent ListRoutes: %w", err)
	}
	return got.GetRoutes(), nil
}
