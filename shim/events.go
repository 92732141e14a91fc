package shim

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	eventsapi "github.com/containerd/containerd/api/events"
	evttrpc "github.com/containerd/containerd/api/services/ttrpc/events/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// eventBuffer is how many events may wait for the forwarder, as runc-v2 has it.
const eventBuffer = 128

// publishTimeout bounds one publish, so a stuck containerd cannot wedge the forwarder.
const publishTimeout = 5 * time.Second

// forwarder publishes task events to containerd in order, from one goroutine.
type forwarder struct {
	namespace string
	address   string
	ch        chan proto.Message
	done      chan struct{}
	closeOnce sync.Once
	// mu guards closed, so send never writes to a closed channel; it is
	// held across that send, which waits while the queue is full. The
	// wait is bounded: the forwarder goroutine takes no lock and ends
	// each publish within twice publishTimeout (the dial, then Forward),
	// and no caller of send holds another lock (the service releases its
	// mu first). Close waits for such a sender the same way.
	mu     sync.Mutex
	closed bool
}

// newForwarder starts the forwarder; with no TTRPC_ADDRESS events are only logged.
func newForwarder(ctx context.Context, namespace, address string) *forwarder {
	f := &forwarder{namespace: namespace, address: address, ch: make(chan proto.Message, eventBuffer), done: make(chan struct{})}
	go f.forward(ctx)
	return f
}

// send queues an event. Like runc-v2 it waits when the queue is full
// rather than drop an exit containerd is waiting for; the forwarder's
// per-publish timeout bounds that wait.
func (f *forwarder) send(e proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		log.L.Debugf("event %s after shutdown: dropped", topicOf(e))
		return
	}
	f.ch <- e
}

// Close stops accepting events and waits until the queued ones are published.
func (f *forwarder) Close() {
	f.closeOnce.Do(func() {
		f.mu.Lock()
		f.closed = true
		close(f.ch)
		f.mu.Unlock()
		<-f.done
	})
}

func (f *forwarder) forward(ctx context.Context) {
	defer close(f.done)
	var (
		client *ttrpc.Client
		events evttrpc.EventsService
	)
	defer func() {
		if client != nil {
			client.Close()
		}
	}()
	for e := range f.ch {
		topic := topicOf(e)
		if f.address == "" {
			log.G(ctx).Debugf("event %s (no TTRPC_ADDRESS: not published)", topic)
			continue
		}
		if client == nil {
			conn, err := net.DialTimeout("unix", strings.TrimPrefix(f.address, "unix://"), publishTimeout)
			if err != nil {
				log.G(ctx).WithError(err).Warnf("publish %s: dial containerd", topic)
				continue
			}
			client = ttrpc.NewClient(conn)
			events = evttrpc.NewEventsClient(client)
		}
		any, err := anypb.New(e)
		if err != nil {
			log.G(ctx).WithError(err).Errorf("publish %s: marshal", topic)
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, publishTimeout)
		pctx = ttrpc.WithMetadata(pctx, ttrpc.MD{"containerd-namespace-ttrpc": []string{f.namespace}})
		_, err = events.Forward(pctx, &evttrpc.ForwardRequest{Envelope: &types.Envelope{
			Timestamp: timestamppb.Now(), Namespace: f.namespace, Topic: topic, Event: fixTypeURL(any),
		}})
		cancel()
		if err != nil {
			log.G(ctx).WithError(err).Warnf("publish %s", topic)
			client.Close()
			client = nil
		}
	}
}

// fixTypeURL drops the type.googleapis.com/ prefix: containerd resolves
// events by their plain proto name, as its typeurl registry records them.
func fixTypeURL(a *anypb.Any) *anypb.Any {
	a.TypeUrl = strings.TrimPrefix(a.TypeUrl, "type.googleapis.com/")
	return a
}

// topicOf is containerd's runtime.GetTopic for the task events a shim raises.
func topicOf(e proto.Message) string {
	switch e.(type) {
	case *eventsapi.TaskCreate:
		return "/tasks/create"
	case *eventsapi.TaskStart:
		return "/tasks/start"
	case *eventsapi.TaskExit:
		return "/tasks/exit"
	case *eventsapi.TaskDelete:
		return "/tasks/delete"
	case *eventsapi.TaskExecAdded:
		return "/tasks/exec-added"
	case *eventsapi.TaskExecStarted:
		return "/tasks/exec-started"
	case *eventsapi.TaskOOM:
		return "/tasks/oom"
	case *eventsapi.TaskPaused:
		return "/tasks/paused"
	case *eventsapi.TaskResumed:
		return "/tasks/resumed"
	}
	return fmt.Sprintf("/unknown/%T", e)
}
