package shim

import (
	"context"
	"time"

	eventsapi "github.com/containerd/containerd/api/events"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kata-fsx/kata-fsx/sandbox"
)

// oomRetry is the pause after a failed GetOOMEvent before the next one.
const oomRetry = time.Second

// forwardOOM publishes a TaskOOM event for every OOM kill the pod's agent
// reports, until the sandbox stops or fails or the server ends.
func (s *service) forwardOOM(sb *sandbox.Sandbox) {
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	go func() {
		select {
		case <-sb.Failed():
		case <-s.done:
		case <-ctx.Done():
		}
		cancel()
	}()
	for {
		id, err := sb.Guest().OOMEvent(ctx)
		if err == nil {
			s.log(id).Warn("OOM kill in the guest")
			s.opts.events.send(&eventsapi.TaskOOM{ContainerID: id})
			continue
		}
		if ctx.Err() != nil || s.currentSandbox() != sb {
			return
		}
		if status.Code(err) == codes.Unimplemented {
			s.log(sb.ID).WithError(err).Warn("the guest agent reports no OOM events: TaskOOM is not published for this pod")
			return
		}
		s.log(sb.ID).WithError(err).Debug("GetOOMEvent")
		t := time.NewTimer(oomRetry)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}
