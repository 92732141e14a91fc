package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// vring is the session's view of one queue. Fields other than callFd/errFd
// are touched only by the session goroutine; the queue's goroutines read those two
// under fdMu because SET_VRING_CALL may replace them while it runs.
type vring struct {
	index int
	sess  *session

	num     uint16
	addr    vringAddr
	addrSet bool
	base    uint16
	kickFd  int
	started bool // kick fd received and not stopped by GET_VRING_BASE
	enabled bool

	// fdMu is taken with no other lock held. Its holders write to an
	// eventfd the front-end gave (a write that adds 1 to a counter and
	// does not wait) or replace or close the descriptors: none waits
	// for anything, and the session never holds fdMu while it waits for
	// a queue (runner.stop).
	fdMu   sync.Mutex
	callFd int
	errFd  int

	w *runner
}

func newVring(i int, s *session) *vring {
	return &vring{index: i, sess: s, kickFd: -1, callFd: -1, errFd: -1}
}

func (r *vring) handleState(req Request, st vringState) ([]byte, error) {
	switch req {
	case ReqSetVringNum:
		if st.num == 0 || st.num > virtq.MaxSize || st.num&(st.num-1) != 0 {
			return nil, fmt.Errorf("%w: queue %d size %d", ErrProtocol, r.index, st.num)
		}
		if r.w != nil {
			return nil, fmt.Errorf("queue %d: size change while running", r.index)
		}
		r.num = uint16(st.num)
		return nil, nil
	case ReqSetVringBase:
		if st.num > 0xffff {
			return nil, fmt.Errorf("%w: queue %d base %d", ErrProtocol, r.index, st.num)
		}
		if r.w != nil {
			return nil, fmt.Errorf("queue %d: base change while running", r.index)
		}
		r.base = uint16(st.num)
		return nil, nil
	case ReqSetVringEnable:
		if st.num > 1 {
			return nil, fmt.Errorf("%w: queue %d enable %d", ErrProtocol, r.index, st.num)
		}
		r.enabled = st.num == 1
		return nil, r.update()
	case ReqGetVringBase:
		r.stopQueue()
		r.started = false
		if r.kickFd >= 0 {
			unix.Close(r.kickFd)
			r.kickFd = -1
		}
		var b [8]byte
		binary.LittleEndian.PutUint32(b[0:], uint32(r.index))
		binary.LittleEndian.PutUint32(b[4:], uint32(r.base))
		return b[:], nil
	}
	return nil, fmt.Errorf("%w: %v", ErrProtocol, req)
}

func (r *vring) setAddr(a vringAddr) error {
	if a.flags&^1 != 0 { // bit 0 is VHOST_VRING_F_LOG, meaningless without logging
		return fmt.Errorf("%w: queue %d address flags %#x", ErrProtocol, r.index, a.flags)
	}
	if r.w != nil {
		return fmt.Errorf("queue %d: address change while running", r.index)
	}
	r.addr, r.addrSet = a, true
	return nil
}

// setFd installs a kick, call or err descriptor (fd -1: none), closing the old one.
func (r *vring) setFd(req Request, fd int) error {
	switch req {
	case ReqSetVringKick:
		if fd < 0 {
			return fmt.Errorf("queue %d: polling mode (no kick fd) is not supported", r.index)
		}
		r.stopQueue()
		if r.kickFd >= 0 {
			unix.Close(r.kickFd)
		}
		r.kickFd = fd
		r.started = true
		return r.update()
	case ReqSetVringCall, ReqSetVringErr:
		r.fdMu.Lock()
		p := &r.callFd
		if req == ReqSetVringErr {
			p = &r.errFd
		}
		if *p >= 0 {
			unix.Close(*p)
		}
		*p = fd
		r.fdMu.Unlock()
		return nil
	}
	return fmt.Errorf("%w: %v", ErrProtocol, req)
}

// update starts or stops the queue so RunQueue runs exactly when the ring is
// started, enabled and fully described, and guest memory is mapped.
func (r *vring) update() error {
	want := r.started && r.enabled && r.num != 0 && r.addrSet && r.sess.mem != nil
	if !want {
		r.stopQueue()
		return nil
	}
	if r.w != nil {
		return nil
	}
	mem := r.sess.mem
	var gpa [3]uint64
	for i, va := range []uint64{r.addr.desc, r.addr.avail, r.addr.used} {
		g, err := mem.UserToGuest(va)
		if err != nil {
			return fmt.Errorf("queue %d ring address: %w", r.index, err)
		}
		gpa[i] = g
	}
	q, err := virtq.New(mem, virtq.Config{
		Size: r.num, DescAddr: gpa[0], AvailAddr: gpa[1], UsedAddr: gpa[2],
		LastAvail: r.base, EventIdx: r.sess.acked&(1<<FeatEventIdx) != 0,
	})
	if err != nil {
		return fmt.Errorf("queue %d: %w", r.index, err)
	}
	w, err := startRunner(r, q)
	if err != nil {
		return err
	}
	r.w = w
	return nil
}

// stopQueue stops the queue, if started, and records where it stopped.
func (r *vring) stopQueue() {
	if r.w == nil {
		return
	}
	r.base = r.w.stop()
	r.w = nil
}

func (r *vring) closeFds() {
	if r.kickFd >= 0 {
		unix.Close(r.kickFd)
		r.kickFd = -1
	}
	r.fdMu.Lock()
	for _, p := range []*int{&r.callFd, &r.errFd} {
		if *p >= 0 {
			unix.Close(*p)
			*p = -1
		}
	}
	r.fdMu.Unlock()
}

// signal writes to the call (or err) eventfd, if one is installed.
func (r *vring) signal(errFd bool) {
	r.fdMu.Lock()
	defer r.fdMu.Unlock()
	fd := r.callFd
	if errFd {
		fd = r.errFd
	}
	if fd < 0 {
		return
	}
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	for {
		_, err := unix.Write(fd, one[:])
		if err != unix.EINTR {
			return
		}
	}
}

// Queue is a started virtqueue handed to Device.RunQueue. The device owns
// VQ while RunQueue runs; the other methods are safe for concurrent use.
type Queue struct {
	index int
	vq    *virtq.Queue
	r     *vring
	kick  int // the ring's kick eventfd, owned by the vring
	logf  func(format string, args ...any)

	kicks    chan struct{} // one pending kick at most; later kicks merge into it
	done     chan struct{} // closed when the queue must stop
	doneOnce sync.Once
	stopFd   int // eventfd written to end the kick waiter
}

// Index returns the queue's index in the device.
func (q *Queue) Index() int { return q.index }

// VQ returns the split virtqueue; only the RunQueue call it was handed to may use it.
func (q *Queue) VQ() *virtq.Queue { return q.vq }

// Kicks delivers the driver's notifications: a value is pending after
// one or more kicks since the last receive.
func (q *Queue) Kicks() <-chan struct{} { return q.kicks }

// Done is closed when RunQueue must stop: the front-end stopped the ring,
// the connection ended, the memory table changes, or the kick eventfd failed.
func (q *Queue) Done() <-chan struct{} { return q.done }

// Notify interrupts the driver (writes the call eventfd), if one is installed.
func (q *Queue) Notify() { q.r.signal(false) }

// NotifyError reports a broken queue on the err eventfd, if one is installed.
func (q *Queue) NotifyError() { q.r.signal(true) }

// Logf writes a diagnostic through the server's Options.Logf.
func (q *Queue) Logf(format string, args ...any) { q.logf(format, args...) }

func (q *Queue) finish() { q.doneOnce.Do(func() { close(q.done) }) }

// runner is the core's side of one started queue: the device's RunQueue
// goroutine and the kick waiter, which turns the kick eventfd into
// channel sends so the device never sits in a system call.
type runner struct {
	q       *Queue
	ran     chan struct{} // closed when RunQueue returned
	waiting chan struct{} // closed when the kick waiter returned
}

func startRunner(r *vring, vq *virtq.Queue) (*runner, error) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("queue %d: eventfd: %w", r.index, err)
	}
	q := &Queue{index: r.index, vq: vq, r: r, kick: r.kickFd, logf: r.sess.srv.opts.Logf,
		kicks: make(chan struct{}, 1), done: make(chan struct{}), stopFd: efd}
	w := &runner{q: q, ran: make(chan struct{}), waiting: make(chan struct{})}
	go w.waitKicks()
	dev := r.sess.srv.dev
	go func() {
		defer close(w.ran)
		dev.RunQueue(q)
	}()
	return w, nil
}

// stop ends the queue: Done closes, RunQueue returns, the kick waiter
// ends. It returns the next available index to resume from.
func (w *runner) stop() uint16 {
	w.q.finish()
	<-w.ran
	wake(w.q.stopFd)
	<-w.waiting
	unix.Close(w.q.stopFd)
	return w.q.vq.LastAvail()
}

func wake(fd int) {
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	unix.Write(fd, one[:])
}

// waitKicks forwards kicks until the kick fd fails (which ends the queue)
// or stopFd is written.
func (w *runner) waitKicks() {
	defer close(w.waiting)
	q := w.q
	fds := []unix.PollFd{{Fd: int32(q.kick), Events: unix.POLLIN}, {Fd: int32(q.stopFd), Events: unix.POLLIN}}
	var buf [8]byte
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		switch {
		case fds[1].Revents != 0:
			return
		case err != nil:
			q.logf("vhostuser: queue %d: poll: %v", q.index, err)
			q.finish()
			return
		case fds[0].Revents&(unix.POLLERR|unix.POLLHUP|unix.POLLNVAL) != 0:
			q.logf("vhostuser: queue %d: kick fd failed (revents %#x)", q.index, fds[0].Revents)
			q.finish()
			return
		}
		unix.Read(q.kick, buf[:]) // reset the counter; a spurious wakeup is harmless
		select {
		case q.kicks <- struct{}{}:
		default: // a kick is already pending
		}
	}
}
