package sandbox

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/log"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

// containerd's CRI serves a port-forward (kubectl port-forward, crictl
// port-forward) by dialling localhost:PORT inside the pod's network
// namespace on the host. Under a VM the pod's servers listen in the guest
// and the namespace holds only the tap, so the shim listens there for
// them: it follows which TCP ports the pod listens on (the guest reports
// each change), keeps a listener on 127.0.0.1 of the namespace for each,
// and carries every connection to the guest over the agent's port-forward
// service. A dial that comes before the guest's report is refused, as
// under runc before the server binds.

const (
	// forwardRetry is the first wait before following the guest's ports
	// again after the watch ended; it doubles up to forwardRetryMax, so a
	// pod whose agent has no such service costs little.
	forwardRetry    = time.Second
	forwardRetryMax = time.Minute
	// forwardMinGap spaces the updates a guest can make the shim act on.
	forwardMinGap = 100 * time.Millisecond
	// forwardDialWait bounds the guest side of one connection's dial.
	forwardDialWait = 15 * time.Second
)

// forwardGuest is what the forwarder needs of the guest: *agent.Client.
type forwardGuest interface {
	WatchPorts(ctx context.Context, fn func(ports []uint16)) error
	DialPort(ctx context.Context, port uint16) (net.Conn, error)
}

// portForwarder keeps a listener in the pod's network namespace for each
// port the guest listens on.
type portForwarder struct {
	guest  forwardGuest
	listen func(addr string) (net.Listener, error)
	logf   func(format string, args ...any)

	cancel context.CancelFunc
	wg     sync.WaitGroup

	// mu guards the fields below; it is never held across a dial or a
	// copy.
	mu        sync.Mutex
	listeners map[uint16]net.Listener
	conns     map[net.Conn]struct{} // open connections, both sides, closed on stop
	failed    map[uint16]bool       // ports that could not be listened on, logged once
	stopped   bool
}

// startPortForward starts the forwarder for a pod with a network
// namespace; Stop ends it before the namespace is released.
func (s *Sandbox) startPortForward(ctx context.Context) {
	if s.net == nil || s.agent == nil {
		return
	}
	lg := log.G(ctx).WithField("sandbox", s.ID)
	f := &portForwarder{
		guest:  s.agent,
		listen: s.net.Listen,
		logf:   func(format string, args ...any) { lg.Infof("port-forward: "+format, args...) },
	}
	f.start(s.life)
	s.forwarder = f
}

func (f *portForwarder) start(ctx context.Context) {
	ctx, f.cancel = context.WithCancel(ctx)
	f.listeners = map[uint16]net.Listener{}
	f.conns = map[net.Conn]struct{}{}
	f.failed = map[uint16]bool{}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		f.follow(ctx)
	}()
}

// follow keeps the listeners in step with the guest's ports until ctx ends.
func (f *portForwarder) follow(ctx context.Context) {
	var lastErr string
	wait := forwardRetry
	for {
		var last time.Time
		began := time.Now()
		err := f.guest.WatchPorts(ctx, func(ports []uint16) {
			if lastErr != "" {
				f.logf("following the guest's listening ports again")
				lastErr = ""
			}
			// A guest that reports as fast as it can gets one update per gap.
			if gap := time.Since(last); gap < forwardMinGap {
				select {
				case <-ctx.Done():
					return
				case <-time.After(forwardMinGap - gap):
				}
			}
			last = time.Now()
			f.sync(ctx, ports)
		})
		if ctx.Err() != nil {
			return
		}
		if time.Since(began) > forwardRetryMax {
			wait = forwardRetry
		}
		// Said once per distinct failure; what is forwarded stays.
		if err.Error() != lastErr {
			f.logf("the guest's listening ports cannot be followed, no new port is forwarded meanwhile: %v", err)
			lastErr = err.Error()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, forwardRetryMax)
	}
}

// sync opens a listener for each new port and closes those of ports the
// guest no longer listens on; connections already made go on.
func (f *portForwarder) sync(ctx context.Context, ports []uint16) {
	f.mu.Lock()
	var gone []uint16
	for p := range f.listeners {
		if !slices.Contains(ports, p) {
			gone = append(gone, p)
		}
	}
	for _, p := range gone {
		f.listeners[p].Close()
		delete(f.listeners, p)
	}
	for p := range f.failed {
		if !slices.Contains(ports, p) {
			delete(f.failed, p)
		}
	}
	var add []uint16
	for _, p := range ports {
		if _, ok := f.listeners[p]; !ok && !f.failed[p] {
			add = append(add, p)
		}
	}
	f.mu.Unlock()
	for _, p := range add {
		l, err := f.listen(net.JoinHostPort("127.0.0.1", strconv.Itoa(int(p))))
		f.mu.Lock()
		if err != nil {
			f.failed[p] = true
			f.mu.Unlock()
			f.logf("port %d is not forwarded: %v", p, err)
			continue
		}
		if f.stopped {
			f.mu.Unlock()
			l.Close()
			return
		}
		f.listeners[p] = l
		f.mu.Unlock()
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			f.accept(ctx, l, p)
		}()
	}
}

// accept serves one port's listener until it is closed.
func (f *portForwarder) accept(ctx context.Context, l net.Listener, port uint16) {
	for {
		c, err := l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) && ctx.Err() == nil {
				f.logf("port %d: accept: %v", port, err)
			}
			return
		}
		if !f.track(c) {
			c.Close()
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.untrack(c)
			f.forward(ctx, c, port)
		}()
	}
}

// forward carries one connection to the guest's port.
func (f *portForwarder) forward(ctx context.Context, c net.Conn, port uint16) {
	dctx, cancel := context.WithTimeout(ctx, forwardDialWait)
	g, err := f.guest.DialPort(dctx, port)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			f.logf("port %d: %v", port, err)
		}
		return
	}
	if !f.track(g) {
		g.Close()
		return
	}
	defer f.untrack(g)
	portfwd.Splice(c, g)
}

func (f *portForwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *portForwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

// stop closes every listener and connection and waits for the goroutines.
func (f *portForwarder) stop() {
	f.cancel()
	f.mu.Lock()
	f.stopped = true
	for p, l := range f.listeners {
		l.Close()
		delete(f.listeners, p)
	}
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// ports are the ports listened on, ascending.
func (f *portForwarder) ports() []uint16 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ps []uint16
	for p := range f.listeners {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	return ps
}
