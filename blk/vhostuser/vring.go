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
// are touched only by the session goroutine; the worker reads those two
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

	fdMu   sync.Mutex
	callFd int
	errFd  int

	w *worker
}

func newVring(i int, s *session) *vring {
	return &vring{index: i, sess: s, kickFd: -1, callFd: -1, errFd: -1}
}

func (r *vring) handleState(req request, st vringState) ([]byte, error) {
	switch req {
	case reqSetVringNum:
		if st.num == 0 || st.num > virtq.MaxSize || st.num&(st.num-1) != 0 {
			return nil, fmt.Errorf("%w: queue %d size %d", errProtocol, r.index, st.num)
		}
		if r.w != nil {
			return nil, fmt.Errorf("queue %d: size change while running", r.index)
		}
		r.num = uint16(st.num)
		return nil, nil
	case reqSetVringBase:
		if st.num > 0xffff {
			return nil, fmt.Errorf("%w: queue %d base %d", errProtocol, r.index, st.num)
		}
		if r.w != nil {
			return nil, fmt.Errorf("queue %d: base change while running", r.index)
		}
		r.base = uint16(st.num)
		return nil, nil
	case reqSetVringEnable:
		if st.num > 1 {
			return nil, fmt.Errorf("%w: queue %d enable %d", errProtocol, r.index, st.num)
		}
		r.enabled = st.num == 1
		return nil, r.update()
	case reqGetVringBase:
		r.stopWorker()
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
	return nil, fmt.Errorf("%w: %v", errProtocol, req)
}

func (r *vring) setAddr(a vringAddr) error {
	if a.flags&^1 != 0 { // bit 0 is VHOST_VRING_F_LOG, meaningless without logging
		return fmt.Errorf("%w: queue %d address flags %#x", errProtocol, r.index, a.flags)
	}
	if r.w != nil {
		return fmt.Errorf("queue %d: address change while running", r.index)
	}
	r.addr, r.addrSet = a, true
	return nil
}

// setFd installs a kick, call or err descriptor (fd -1: none), closing the old one.
func (r *vring) setFd(req request, fd int) error {
	switch req {
	case reqSetVringKick:
		if fd < 0 {
			return fmt.Errorf("queue %d: polling mode (no kick fd) is not supported", r.index)
		}
		r.stopWorker()
		if r.kickFd >= 0 {
			unix.Close(r.kickFd)
		}
		r.kickFd = fd
		r.started = true
		return r.update()
	case reqSetVringCall, reqSetVringErr:
		r.fdMu.Lock()
		p := &r.callFd
		if req == reqSetVringErr {
			p = &r.errFd
		}
		if *p >= 0 {
			unix.Close(*p)
		}
		*p = fd
		r.fdMu.Unlock()
		return nil
	}
	return fmt.Errorf("%w: %v", errProtocol, req)
}

// update starts or stops the worker so it runs exactly when the ring is
// started, enabled and fully described, and guest memory is mapped.
func (r *vring) update() error {
	want := r.started && r.enabled && r.num != 0 && r.addrSet && r.sess.mem != nil
	if !want {
		r.stopWorker()
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
		LastAvail: r.base, EventIdx: r.sess.acked&(1<<featEventIdx) != 0,
	})
	if err != nil {
		return fmt.Errorf("queue %d: %w", r.index, err)
	}
	w, err := startWorker(r, q)
	if err != nil {
		return err
	}
	r.w = w
	return nil
}

// stopWorker stops the worker, if any, and records where it stopped.
func (r *vring) stopWorker() {
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

// worker processes one started queue. One goroutine, the owner, holds the
// virtq.Queue: it pops requests and hands each to an executor goroutine,
// and publishes each used entry as soon as that request is done, while the
// others are still running. Finished requests come back on a channel; the
// owner publishes everything finished since its last look and then decides
// once whether to interrupt the driver. So the guest can refill the queue
// while slow requests (large writes, a flush) are in flight, as with QEMU's
// own block layer, instead of waiting for the slowest request of a batch.
// A second goroutine waits on the kick eventfd and forwards kicks, so the
// owner never sits in a system call and wakes as cheaply for a completion
// as for a kick.
type worker struct {
	r      *vring
	q      *virtq.Queue
	kick   int
	stopFd int           // eventfd written when the owner is done, to end the kick waiter
	quit   chan struct{} // closed by stop
	kicks  chan kickEvent
	doneCh chan int // slots whose request finished
	reqs   chan int // slots whose request is to run, for the executors
	done   chan struct{}

	// Owner only: request slots (their chains keep their buffers' backing
	// arrays from request to request), the free ones, and how many run.
	slots     [maxInflight]slot
	free      []int
	inflight  int
	executors int            // executor goroutines started, at most maxInflight
	execWG    sync.WaitGroup // the executors, which end when reqs closes
	pushed    bool           // used entries published since the last notification check
}

type slot struct {
	chain virtq.Chain
	used  uint32
}

// kickEvent is a kick, or the end of kicks (the fd failed or the worker stops).
type kickEvent struct{ err error }

// maxInflight bounds how many requests of one queue run at the same time:
// the driver keeps several in flight (fio's iodepth, readahead) and the
// device may complete them in any order.
const maxInflight = 32

func startWorker(r *vring, q *virtq.Queue) (*worker, error) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("queue %d: eventfd: %w", r.index, err)
	}
	w := &worker{r: r, q: q, kick: r.kickFd, stopFd: efd, quit: make(chan struct{}),
		kicks: make(chan kickEvent, 1), doneCh: make(chan int, maxInflight), reqs: make(chan int, maxInflight), done: make(chan struct{}),
		free: make([]int, 0, maxInflight)}
	for i := maxInflight - 1; i >= 0; i-- {
		w.free = append(w.free, i)
	}
	waiterDone := make(chan struct{})
	go w.waitKicks(waiterDone)
	go func() {
		w.run()
		close(w.reqs)
		w.execWG.Wait()
		// The kick waiter must be gone before stop closes its fds.
		wake(w.stopFd)
		<-waiterDone
		close(w.done)
	}()
	return w, nil
}

// stop ends the worker, waits for it (so no request is in flight and every
// finished one is published) and returns the next available index to
// resume from.
func (w *worker) stop() uint16 {
	close(w.quit)
	<-w.done
	unix.Close(w.stopFd)
	return w.q.LastAvail()
}

func wake(fd int) {
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	unix.Write(fd, one[:])
}

// waitKicks forwards kicks to the owner until the kick fd fails or stopFd
// is written; kicks that arrive while one is pending merge into it.
func (w *worker) waitKicks(done chan struct{}) {
	defer close(done)
	fds := []unix.PollFd{{Fd: int32(w.kick), Events: unix.POLLIN}, {Fd: int32(w.stopFd), Events: unix.POLLIN}}
	var buf [8]byte
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		var ev kickEvent
		switch {
		case fds[1].Revents != 0:
			return
		case err != nil:
			ev.err = fmt.Errorf("poll: %w", err)
		case fds[0].Revents&(unix.POLLERR|unix.POLLHUP|unix.POLLNVAL) != 0:
			ev.err = fmt.Errorf("kick fd failed (revents %#x)", fds[0].Revents)
		default:
			unix.Read(w.kick, buf[:]) // reset the counter; a spurious wakeup is harmless
		}
		select {
		case w.kicks <- ev:
		default: // a kick is already pending
			if ev.err != nil {
				// The end of kicks must not be lost behind a pending kick.
				select {
				case w.kicks <- ev:
				case <-w.quit:
				}
			}
		}
		if ev.err != nil {
			return
		}
	}
}

func (w *worker) run() {
	stopping := false // stop asked, the queue broke or the kick fd failed: pop no more
	// stopC is nil once stop was seen, so the select does not spin on the
	// closed channel while the last requests drain.
	stopC := (<-chan struct{})(w.quit)
	for {
		for more := true; more; {
			select {
			case i := <-w.doneCh:
				w.publish(i)
			default:
				more = false
			}
		}
		if !stopping {
			w.fill()
			if w.q.Broken() {
				// Every failure of Pop and PushUsed breaks the queue: say so once.
				w.r.signal(true)
				stopping = true
			}
		}
		if w.pushed {
			w.pushed = false
			if w.q.NeedsNotification() {
				w.r.signal(false)
			}
		}
		if stopping && w.inflight == 0 {
			return
		}
		select {
		case i := <-w.doneCh:
			w.publish(i)
		case ev := <-w.kicks:
			if ev.err != nil {
				w.r.sess.srv.opts.Logf("vhostuser: queue %d: %v", w.r.index, ev.err)
				stopping = true
			}
		case <-stopC:
			stopping, stopC = true, nil
		}
	}
}

// fill pops and starts requests while slots are free. With every slot busy
// it leaves kicks disabled: the next completion brings the owner back here.
// It stops early when the queue breaks (q.Broken).
func (w *worker) fill() {
	q := w.q
	for {
		q.DisableNotification()
		for len(w.free) > 0 {
			i := w.free[len(w.free)-1]
			s := &w.slots[i]
			ok, err := q.Pop(&s.chain)
			if errors.Is(err, virtq.ErrBroken) {
				w.r.sess.srv.opts.Logf("vhostuser: queue %d stopped: %v", w.r.index, err)
				return
			}
			if !ok {
				break
			}
			if err != nil {
				// A chain the walker refused goes back unhandled.
				w.r.sess.srv.opts.Logf("vhostuser: queue %d: %v", w.r.index, err)
				if q.PushUsed(s.chain.Head, 0) != nil {
					return
				}
				w.pushed = true
				continue
			}
			w.free = w.free[:len(w.free)-1]
			w.inflight++
			if w.inflight > w.executors {
				w.executors++
				w.execWG.Add(1)
				go w.executor()
			}
			w.reqs <- i // never blocks: it has room for every slot
		}
		if len(w.free) == 0 || !q.EnableNotification() {
			return
		}
	}
}

// executor runs requests until reqs closes. Executors live as long as the
// worker, as many as requests have been in flight at once: a goroutine per
// request paid for growing a fresh stack on every read (a tenth of the
// server's CPU in BenchmarkRead4K). While it runs a request, an executor is
// the only goroutine touching that slot; it hands the slot back on doneCh
// (which has room for every slot).
func (w *worker) executor() {
	defer w.execWG.Done()
	for i := range w.reqs {
		s := &w.slots[i]
		s.used = w.r.sess.handlerBlk.handle(&s.chain)
		w.doneCh <- i
	}
}

// publish puts a finished request in the used ring and frees its slot; on
// a broken queue the entry is dropped (the slot is freed all the same).
func (w *worker) publish(i int) {
	w.free = append(w.free, i)
	w.inflight--
	if w.q.PushUsed(w.slots[i].chain.Head, w.slots[i].used) == nil {
		w.pushed = true
	}
}
