package main

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// The network calls of Kata's protocol are not implemented by the test
// agent yet: it answers them as unimplemented, so a runtime that relies on
// them fails loudly instead of running a pod without its network.

func (a *agent) UpdateInterface(context.Context, *pb.UpdateInterfaceRequest) (*pb.Interface, error) {
	return nil, status.Error(codes.Unimplemented, "UpdateInterface: not implemented by the test agent")
}

func (a *agent) UpdateRoutes(context.Context, *pb.UpdateRoutesRequest) (*pb.Routes, error) {
	return nil, status.Error(codes.Unimplemented, "UpdateRoutes: not implemented by the test agent")
}

func (a *agent) ListInterfaces(context.Context, *pb.ListInterfacesRequest) (*pb.Interfaces, error) {
	return nil, status.Error(codes.Unimplemented, "ListInterfaces: not implemented by the test agent")
}

func (a *agent) ListRoutes(context.Context, *pb.ListRoutesRequest) (*pb.Routes, error) {
	return nil, status.Error(codes.Unimplemented, "ListRoutes: not implemented by the test agent")
}

func (a *agent) AddARPNeighbors(context.Context, *pb.AddARPNeighborsRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "AddARPNeighbors: not implemented by the test agent")
}
