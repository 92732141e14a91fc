package main

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

// The cgroup calls of Kata's protocol are not implemented by the test agent
// yet: it answers them as unimplemented.

func (a *agent) UpdateContainer(context.Context, *pb.UpdateContainerRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "UpdateContainer: not implemented by the test agent")
}

func (a *agent) StatsContainer(context.Context, *pb.StatsContainerRequest) (*pb.StatsContainerResponse, error) {
	return nil, status.Error(codes.Unimplemented, "StatsContainer: not implemented by the test agent")
}

func (a *agent) PauseContainer(context.Context, *pb.PauseContainerRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "PauseContainer: not implemented by the test agent")
}

func (a *agent) ResumeContainer(context.Context, *pb.ResumeContainerRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "ResumeContainer: not implemented by the test agent")
}

func (a *agent) GetOOMEvent(context.Context, *pb.GetOOMEventRequest) (*pb.OOMEvent, error) {
	return nil, status.Error(codes.Unimplemented, "GetOOMEvent: not implemented by the test agent")
}
