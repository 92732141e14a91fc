package shim

import (
	"time"

	"github.com/containerd/log"
)

// orphanGrace is how long a server may hold no container, with no Create
// in flight, before it concludes containerd has lost it and exits.
// containerd sends Create right after `start` and Shutdown right after
// the last Delete, so a healthy pod never idles that long. A containerd
// that dies between `start` and a finished Create loses the task: once
// restarted, containerd 1.6 reconnects to the server, finds no task in it
// and never calls it again (1.7 and later delete such a leaked shim
// themselves), so without this the server would wait forever.
const orphanGrace = 30 * time.Second

// orphaned says whether the server has held no container and run no
// Create for grace up to now.
func (s *service) orphaned(now time.Time, grace time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.containers) == 0 && s.creating == 0 && now.Sub(s.idleSince) >= grace
}

// watchOrphan ends the server once it is orphaned; the server's exit tears
// down whatever a failed Create left, and containerd, seeing the
// connection close, runs `delete` and removes the bundle.
func (s *service) watchOrphan(grace time.Duration) {
	t := time.NewTicker(grace / 6)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case now := <-t.C:
			if s.orphaned(now, grace) {
				log.G(s.ctx).WithField("pod", s.opts.group).Warnf("no container and no Create for %v: containerd lost this shim; exiting", grace)
				s.doneOnce.Do(func() { close(s.done) })
				return
			}
		}
	}
}

// beginCreate marks a Create in flight; the function it returns ends it.
func (s *service) beginCreate() (end func()) {
	s.mu.Lock()
	s.creating++
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.creating--
		s.idleSince = time.Now()
		s.mu.Unlock()
	}
}
