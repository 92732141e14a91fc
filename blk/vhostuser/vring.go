package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/virtq"
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

// worker processes one started queue: wait for a kick, drain the available
// ring, execute requests, publish used entries, interrupt when asked to.
type worker struct {
	r      *vring
	q      *virtq.Queue
	kick   int
	stopFd int // eventfd written by stop
	done   chan struct{}
	// chains hold a batch of popped requests; they keep their buffers'
	// backing arrays from batch to batch.
	chains [maxBatch]virtq.Chain
	used   [maxBatch]uint32
}

// maxBatch bounds how many requests of one queue run at the same time: the
// driver keeps several in flight (fio's iodepth, readahead) and the device
// may complete them in any order, so serving them one by one would
// serialize what QEMU's own block layer runs concurrently.
const maxBatch = 32

func startWorker(r *vring, q *virtq.Queue) (*worker, error) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("queue %d: eventfd: %w", r.index, err)
	}
	w := &worker{r: r, q: q, kick: r.kickFd, stopFd: efd, done: make(chan struct{})}
	go w.run()
	return w, nil
}

// stop ends the worker, waits for it (so no request is in flight) and
// returns the next available index to resume from.
func (w *worker) stop() uint16 {
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	unix.Write(w.stopFd, one[:])
	<-w.done
	unix.Close(w.stopFd)
	return w.q.LastAvail()
}

func (w *worker) run() {
	defer close(w.done)
	if !w.process() {
		return
	}
	fds := []unix.PollFd{{Fd: int32(w.kick), Events: unix.POLLIN}, {Fd: int32(w.stopFd), Events: unix.POLLIN}}
	var buf [8]byte
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, -1)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			w.r.sess.srv.opts.Logf("vhostuser: queue %d: poll: %v", w.r.index, err)
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		if fds[0].Revents&(unix.POLLERR|unix.POLLHUP|unix.POLLNVAL) != 0 {
			w.r.sess.srv.opts.Logf("vhostuser: queue %d: kick fd failed (revents %#x)", w.r.index, fds[0].Revents)
			return
		}
		if fds[0].Revents&unix.POLLIN != 0 {
			unix.Read(w.kick, buf[:]) // reset the counter; a spurious wakeup is harmless
		}
		if !w.process() {
			return
		}
	}
}

// process drains the queue until no work remains with notifications enabled;
// false means the queue broke and the worker must stop. Requests popped
// together run concurrently; their used entries are published once all of
// them are done.
func (w *worker) process() bool {
	q := w.q
	for {
		q.DisableNotification()
		for {
			n, broken := w.popBatch()
			if n > 0 {
				w.runBatch(n)
				for i := 0; i < n; i++ {
					if err := q.PushUsed(w.chains[i].Head, w.used[i]); err != nil {
						w.r.signal(true)
						return false
					}
				}
			}
			if broken {
				w.r.signal(true)
				return false
			}
			if n < maxBatch {
				break
			}
		}
		if q.NeedsNotification() {
			w.r.signal(false)
		}
		if !q.EnableNotification() {
			return true
		}
	}
}

// popBatch pops up to maxBatch chains; a chain the walker refused gets used
// length 0 and no handling. broken reports a queue that must stop (the
// chains popped before it are still completed).
func (w *worker) popBatch() (n int, broken bool) {
	for n < maxBatch {
		ok, err := w.q.Pop(&w.chains[n])
		if errors.Is(err, virtq.ErrBroken) {
			w.r.sess.srv.opts.Logf("vhostuser: queue %d stopped: %v", w.r.index, err)
			return n, true
		}
		if !ok {
			return n, false
		}
		w.used[n] = 0
		if err != nil {
			w.r.sess.srv.opts.Logf("vhostuser: queue %d: %v", w.r.index, err)
			w.used[n] = noHandle
		}
		n++
	}
	return n, false
}

// noHandle marks a popped chain that must be returned unhandled.
const noHandle = ^uint32(0)

func (w *worker) runBatch(n int) {
	h := w.r.sess.handlerBlk
	run := func(i int) {
		if w.used[i] == noHandle {
			w.used[i] = 0
			return
		}
		w.used[i] = h.handle(&w.chains[i])
	}
	if n == 1 {
		run(0)
		return
	}
	var wg sync.WaitGroup
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); run(i) }()
	}
	run(0)
	wg.Wait()
}
