package vhostblk

import (
	"errors"
	"sync"

	"github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// worker processes one started queue. One goroutine, the owner (the core's
// RunQueue goroutine), holds the virtq.Queue: it pops requests and hands
// each to an executor goroutine, and publishes each used entry as soon as
// that request is done, while the others are still running. Finished
// requests come back on a channel; the owner publishes everything finished
// since its last look and then decides once whether to interrupt the
// driver. So the guest can refill the queue while slow requests (large
// writes, a flush) are in flight, as with QEMU's own block layer, instead
// of waiting for the slowest request of a batch. The core's kick waiter
// forwards kicks on a channel, so the owner never sits in a system call
// and wakes as cheaply for a completion as for a kick. Requests run
// through blkHandler directly: no interface call per request or buffer.
type worker struct {
	q      *vhostuser.Queue
	vq     *virtq.Queue
	h      *blkHandler
	ctr    *counterShard // this queue's request counters
	doneCh chan int      // slots whose request finished
	reqs   chan int      // slots whose request is to run, for the executors

	// Owner only: request slots (their chains keep their buffers' backing
	// arrays from request to request), the free ones, and how many run.
	slots     []slot
	free      []int
	inflight  int
	executors int            // executor goroutines started, at most one per slot
	execWG    sync.WaitGroup // the executors, which end when reqs closes
	pushed    bool           // used entries published since the last notification check
}

type slot struct {
	chain virtq.Chain
	used  uint32
}

// inflightLimit is how many requests of a queue of size descriptors may
// run at the same time: every request the driver can post (each takes at
// least one descriptor), so a request that waits long (a lazy image's
// read from a slow registry, until its deadline) never keeps another from
// starting; the driver's own queue is the bound, up to maxInflight so
// that a hostile driver's 32768-entry queue cannot make the device start
// 32768 goroutines. Executors are started as requests arrive, not up front.
func inflightLimit(size uint16) int { return min(max(int(size), 1), maxInflight) }

// maxInflight is twice the largest queue_size Kata configures (128 by default).
const maxInflight = 256

// runWorker runs queue q until the core stops it, then returns once no
// request is in flight and every finished one is published.
func runWorker(h *blkHandler, q *vhostuser.Queue, ctr *counterShard) {
	n := inflightLimit(q.VQ().Size())
	w := &worker{q: q, vq: q.VQ(), h: h, ctr: ctr, doneCh: make(chan int, n), reqs: make(chan int, n),
		slots: make([]slot, n), free: make([]int, 0, n)}
	for i := n - 1; i >= 0; i-- {
		w.free = append(w.free, i)
	}
	w.run()
	close(w.reqs)
	w.execWG.Wait()
}

func (w *worker) run() {
	stopping := false // stop asked, the queue broke or the kick fd failed: pop no more
	// stopC is nil once stop was seen, so the select does not spin on the
	// closed channel while the last requests drain.
	stopC := w.q.Done()
	kicks := w.q.Kicks()
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
			if w.vq.Broken() {
				// Every failure of Pop and PushUsed breaks the queue: say so once.
				w.q.NotifyError()
				stopping = true
			}
		}
		if w.pushed {
			w.pushed = false
			if w.vq.NeedsNotification() {
				w.q.Notify()
			}
		}
		if stopping && w.inflight == 0 {
			return
		}
		select {
		case i := <-w.doneCh:
			w.publish(i)
		case <-kicks:
		case <-stopC:
			stopping, stopC = true, nil
		}
	}
}

// fill pops and starts requests while slots are free. With every slot busy
// it leaves kicks disabled: the next completion brings the owner back here.
// It stops early when the queue breaks (vq.Broken).
func (w *worker) fill() {
	q := w.vq
	for {
		q.DisableNotification()
		for len(w.free) > 0 {
			i := w.free[len(w.free)-1]
			s := &w.slots[i]
			ok, err := q.Pop(&s.chain)
			if errors.Is(err, virtq.ErrBroken) {
				w.q.Logf("vhostuser: queue %d stopped: %v", w.q.Index(), err)
				return
			}
			if !ok {
				break
			}
			if err != nil {
				// A chain the walker refused goes back unhandled.
				w.q.Logf("vhostuser: queue %d: %v", w.q.Index(), err)
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
		s.used = w.h.handle(&s.chain, w.ctr)
		w.doneCh <- i
	}
}

// publish puts a finished request in the used ring and frees its slot; on
// a broken queue the entry is dropped (the slot is freed all the same).
func (w *worker) publish(i int) {
	w.free = append(w.free, i)
	w.inflight--
	if w.vq.PushUsed(w.slots[i].chain.Head, w.slots[i].used) == nil {
		w.pushed = true
	}
}
