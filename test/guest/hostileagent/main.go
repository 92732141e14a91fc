// Command hostileagent is the kata-fsx guest agent with an attacker inside,
// for the hostile-guest tests (test/e2e's TestHostileGuest): the product
// agent (guest/agent) unchanged, with a ttrpc interceptor that, when the
// kernel command line carries kata_fsx.hostile=<host dir>[,<container
// id>...], attacks the share at every step of a pod (see hostile.go).
// Without that parameter it behaves exactly as the product agent, so the
// test guest kit (make guest) boots it for every test.
package main

import (
	"context"
	"sync"

	"github.com/containerd/ttrpc"

	"github.com/kata-fsx/kata-fsx/guest/agent/boot"
)

func main() {
	var i interceptor
	boot.Main(ttrpc.WithUnaryServerInterceptor(i.intercept))
}

// interceptor runs the attacks around the agent's own handling of a
// request: the hostile mode is read from the kernel command line at the
// first request, once the agent has mounted /proc.
type interceptor struct {
	once sync.Once
	h    *hostile
}

// The methods the attacker acts around, as ttrpc names them.
const (
	createSandbox   = "/grpc.AgentService/CreateSandbox"
	destroySandbox  = "/grpc.AgentService/DestroySandbox"
	createContainer = "/grpc.AgentService/CreateContainer"
	execProcess     = "/grpc.AgentService/ExecProcess"
	removeContainer = "/grpc.AgentService/RemoveContainer"
)

func (i *interceptor) intercept(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, method ttrpc.Method) (interface{}, error) {
	i.once.Do(func() { i.h = hostileFromCmdline() })
	h := i.h
	if h == nil {
		return method(ctx, unmarshal)
	}
	// Before the agent acts: the teardown round, with the racer stopped,
	// meets the containers still there; an exec's round comes before the
	// agent looks the container up.
	switch info.FullMethod {
	case destroySandbox:
		h.endRace()
		h.attack("teardown")
	case execProcess:
		h.attack("exec")
	}
	resp, err := method(ctx, unmarshal)
	if err != nil {
		return resp, err
	}
	// After the agent succeeded: the share is mounted (sandbox), the
	// container's storages are (create), and a removal's round comes last,
	// so the shim's unbind meets what was planted.
	switch info.FullMethod {
	case createSandbox:
		h.attack("sandbox")
		h.race()
	case createContainer:
		h.attack("create")
	case removeContainer:
		h.attack("delete")
	}
	return resp, nil
}
