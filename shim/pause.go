package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	eventsapi "github.com/containerd/containerd/api/events"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/kata-fsx/kata-fsx/sandbox"
)

// runningSandbox is the pod's sandbox, or a precondition error naming the
// container when the VM is gone.
func (s *service) runningSandbox(id string) (*sandbox.Sandbox, error) {
	sb := s.currentSandbox()
	if sb == nil {
		return nil, errPrecondition("container %s: the pod has no sandbox", id)
	}
	if err := sb.Err(); err != nil {
		return nil, errPrecondition("container %s: %v", id, err)
	}
	return sb, nil
}

func (s *service) isPaused(c *container) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.paused
}

// setPaused freezes or thaws a running container and publishes
// TaskPaused or TaskResumed.
func (s *service) setPaused(ctx context.Context, id string, pause bool) (*emptypb.Empty, error) {
	c, p, err := s.lookup(id, "")
	if err != nil {
		return nil, err
	}
	verb := "resume"
	if pause {
		verb = "pause"
	}
	if st, _, _ := p.status(); st != procRunning {
		return nil, errPrecondition("cannot %s container %s in %s state", verb, id, st)
	}
	if s.isPaused(c) == pause {
		return nil, errPrecondition("cannot %s container %s: it is %s already", verb, id, map[bool]string{true: "paused", false: "running"}[pause])
	}
	sb, err := s.runningSandbox(id)
	if err != nil {
		return nil, err
	}
	if pause {
		err = sb.Guest().Pause(ctx, id)
	} else {
		err = sb.Guest().Resume(ctx, id)
	}
	if err != nil {
		return nil, sb.Explain(err)
	}
	s.mu.Lock()
	c.paused = pause
	s.mu.Unlock()
	if pause {
		s.opts.events.send(&eventsapi.TaskPaused{ContainerID: id})
	} else {
		s.opts.events.send(&eventsapi.TaskResumed{ContainerID: id})
	}
	return &emptypb.Empty{}, nil
}

// updateResources reads Update's resources: OCI LinuxResources as JSON,
// as containerd's typeurl packs them.
func updateResources(a *anypb.Any) (*specs.LinuxResources, error) {
	if a == nil || len(a.Value) == 0 {
		return nil, errors.New("no resources given")
	}
	var res specs.LinuxResources
	if err := json.Unmarshal(a.Value, &res); err != nil {
		return nil, fmt.Errorf("resources of type %s are not OCI LinuxResources JSON: %w", a.TypeUrl, err)
	}
	return &res, nil
}
