package service

import (
	"context"

	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/network"
)

// UpdateInterface implements grpc.AgentService: it configures the NIC the
// request names (see network.UpdateInterface).
func (a *Agent) UpdateInterface(ctx context.Context, r *pb.UpdateInterfaceRequest) (*pb.Interface, error) {
	// virtio_net is among the modules the agent loads while it serves.
	if r.GetInterface() != nil {
		if err := a.waitModules(ctx); err != nil {
			return nil, err
		}
	}
	return network.UpdateInterface(ctx, r)
}

// UpdateRoutes implements grpc.AgentService (see network.UpdateRoutes).
func (a *Agent) UpdateRoutes(ctx context.Context, r *pb.UpdateRoutesRequest) (*pb.Routes, error) {
	return network.UpdateRoutes(ctx, r)
}

// AddARPNeighbors implements grpc.AgentService (see network.AddARPNeighbors).
func (a *Agent) AddARPNeighbors(ctx context.Context, r *pb.AddARPNeighborsRequest) (*emptypb.Empty, error) {
	return network.AddARPNeighbors(ctx, r)
}

// ListInterfaces implements grpc.AgentService (see network.ListInterfaces).
func (a *Agent) ListInterfaces(ctx context.Context, r *pb.ListInterfacesRequest) (*pb.Interfaces, error) {
	return network.ListInterfaces(ctx, r)
}

// ListRoutes implements grpc.AgentService (see network.ListRoutes).
func (a *Agent) ListRoutes(ctx context.Context, r *pb.ListRoutesRequest) (*pb.Routes, error) {
	return network.ListRoutes(ctx, r)
}
