package virtq

import (
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/kata-fsx/kata-fsx/virtio/virtq/internal/ring"
)

// Descriptor and ring flags (virtio 1.2 section 2.7).
const (
	DescFNext     = 1 // VIRTQ_DESC_F_NEXT
	DescFWrite    = 2 // VIRTQ_DESC_F_WRITE
	DescFIndirect = 4 // VIRTQ_DESC_F_INDIRECT

	AvailFNoInterrupt = 1 // VIRTQ_AVAIL_F_NO_INTERRUPT
	UsedFNoNotify     = 1 // VIRTQ_USED_F_NO_NOTIFY

	// MaxSize is the largest split queue size.
	MaxSize = 32768
)

// ErrBroken reports a queue the driver corrupted beyond recovery (e.g. an
// available index running more than a queue size ahead, a head index out of
// range); the queue stays stopped until it is set up again.
var ErrBroken = errors.New("virtq: queue is broken")

// ErrBadChain reports a malformed descriptor chain; the chain's head was
// consumed and should be returned with PushUsed(head, 0).
var ErrBadChain = errors.New("virtq: malformed descriptor chain")

// Config describes a queue as the driver laid it out.
type Config struct {
	// Size is the number of descriptors: a power of two, 1..MaxSize.
	Size uint16
	// DescAddr, AvailAddr and UsedAddr are guest physical addresses of the
	// descriptor table (16-byte aligned), available ring (2) and used ring (4).
	DescAddr, AvailAddr, UsedAddr uint64
	// LastAvail is the available index to resume from (vhost-user SET_VRING_BASE).
	LastAvail uint16
	// EventIdx enables VIRTIO_F_EVENT_IDX notification suppression.
	EventIdx bool
}

// Queue is the device side of one split virtqueue; it is not safe for
// concurrent use (one goroutine owns it).
type Queue struct {
	mem   *Memory
	size  uint16
	desc  []byte
	avail []byte
	used  []byte

	lastAvail uint16
	nextUsed  uint16
	eventIdx  bool
	broken    bool

	signalled      uint16 // nextUsed when the driver was last considered for notification
	signalledValid bool
}

// Chain is one descriptor chain popped from the available ring. Its buffers
// alias guest memory and stay valid while the memory table is unchanged.
type Chain struct {
	// Head is the index of the chain's first descriptor (the id returned in the used ring).
	Head uint16
	// Readable lists the device-readable buffers in order.
	Readable [][]byte
	// Writable lists the device-writable buffers in order.
	Writable [][]byte
	// ReadLen and WriteLen are the total readable and writable byte counts.
	ReadLen, WriteLen uint32
	// Descriptors counts the buffer descriptors walked (indirect table descriptors excluded).
	Descriptors int
}

func (c *Chain) reset(head uint16) {
	c.Head = head
	c.Readable = c.Readable[:0]
	c.Writable = c.Writable[:0]
	c.ReadLen, c.WriteLen = 0, 0
	c.Descriptors = 0
}

// New validates the layout against mem and returns the queue. The next used
// index is resumed from the used ring itself.
func New(mem *Memory, c Config) (*Queue, error) {
	if c.Size == 0 || c.Size > MaxSize || c.Size&(c.Size-1) != 0 {
		return nil, fmt.Errorf("virtq: size %d is not a power of two in 1..%d", c.Size, MaxSize)
	}
	if c.DescAddr%16 != 0 || c.AvailAddr%2 != 0 || c.UsedAddr%4 != 0 {
		return nil, fmt.Errorf("virtq: misaligned rings: desc %#x avail %#x used %#x", c.DescAddr, c.AvailAddr, c.UsedAddr)
	}
	n := uint64(c.Size)
	availLen := ring.AvailHeader + 2*n
	usedLen := ring.UsedHeader + ring.UsedElemSize*n
	if c.EventIdx {
		availLen += ring.EventSize
		usedLen += ring.EventSize
	}
	q := &Queue{mem: mem, size: c.Size, lastAvail: c.LastAvail, eventIdx: c.EventIdx}
	var err error
	if q.desc, err = mem.Range(c.DescAddr, ring.DescSize*n); err != nil {
		return nil, fmt.Errorf("virtq: descriptor table: %w", err)
	}
	if q.avail, err = mem.Range(c.AvailAddr, availLen); err != nil {
		return nil, fmt.Errorf("virtq: available ring: %w", err)
	}
	if q.used, err = mem.Range(c.UsedAddr, usedLen); err != nil {
		return nil, fmt.Errorf("virtq: used ring: %w", err)
	}
	if err := q.readUsedIdx(); err != nil {
		return nil, fmt.Errorf("virtq: used ring: %w", err)
	}
	return q, nil
}

// readUsedIdx resumes nextUsed from the used ring.
func (q *Queue) readUsedIdx() (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer q.guard(&err)
	q.nextUsed = ring.UsedIdx(q.used)
	return nil
}

// Size returns the queue size.
func (q *Queue) Size() uint16 { return q.size }

// LastAvail returns the index of the next available entry to consume.
func (q *Queue) LastAvail() uint16 { return q.lastAvail }

// NextUsed returns the used index the device will publish next.
func (q *Queue) NextUsed() uint16 { return q.nextUsed }

// Broken reports whether the queue was stopped because the driver corrupted it.
func (q *Queue) Broken() bool { return q.broken }

// guard is deferred by every method that touches the rings: a fault on
// guest memory (see ErrFault) breaks the queue instead of the process.
// The caller enabled runtime/debug.SetPanicOnFault for its own duration.
func (q *Queue) guard(err *error) {
	if r := recover(); r != nil {
		q.broken = true
		ferr := fmt.Errorf("%w: %w", ErrBroken, FaultError(r))
		if err != nil {
			*err = ferr
		}
	}
}

func (q *Queue) breakf(format string, args ...any) error {
	q.broken = true
	return fmt.Errorf("%w: "+format, append([]any{ErrBroken}, args...)...)
}

// Pop takes the next available chain into c (reusing its slices). It returns
// false when nothing is pending. An error wrapping ErrBadChain still consumed
// the chain (c.Head is valid); ErrBroken means the queue must be reset.
func (q *Queue) Pop(c *Chain) (popped bool, err error) {
	if q.broken {
		return false, ErrBroken
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer q.guard(&err) // popped stays false: results are set only by a return
	idx := ring.AvailIdx(q.avail)
	pending := idx - q.lastAvail
	if pending == 0 {
		return false, nil
	}
	if pending > q.size {
		return false, q.breakf("available index %d is %d entries ahead of %d, queue size %d", idx, pending, q.lastAvail, q.size)
	}
	head := ring.AvailEntry(q.avail, q.lastAvail&(q.size-1))
	if head >= q.size {
		return false, q.breakf("head index %d out of range (size %d)", head, q.size)
	}
	q.lastAvail++
	c.reset(head)
	if err := q.walk(c, head); err != nil {
		return true, fmt.Errorf("%w (head %d): %w", ErrBadChain, head, err)
	}
	return true, nil
}

// walk follows a chain, bounded by a ttl so a looping chain ends.
func (q *Queue) walk(c *Chain, head uint16) error {
	table := q.desc
	tableLen := uint32(q.size)
	idx := uint32(head)
	ttl := uint32(q.size)
	indirect := false
	seenWrite := false
	var total uint64
	for {
		if ttl == 0 {
			return errors.New("chain longer than its table (loop?)")
		}
		ttl--
		d := ring.ReadDesc(table, uint16(idx))
		if d.Flags&DescFIndirect != 0 {
			if indirect {
				return errors.New("nested indirect descriptor")
			}
			if d.Flags&DescFNext != 0 {
				return errors.New("indirect descriptor with NEXT")
			}
			if d.Len == 0 || d.Len%ring.DescSize != 0 {
				return fmt.Errorf("indirect table length %d is not a nonzero multiple of %d", d.Len, ring.DescSize)
			}
			if d.Addr%ring.DescSize != 0 {
				return fmt.Errorf("indirect table at %#x is not %d-byte aligned", d.Addr, ring.DescSize)
			}
			n := d.Len / ring.DescSize
			if n > uint32(q.size) {
				return fmt.Errorf("indirect table of %d descriptors exceeds queue size %d", n, q.size)
			}
			t, err := q.mem.Range(d.Addr, uint64(d.Len))
			if err != nil {
				return fmt.Errorf("indirect table: %w", err)
			}
			table, tableLen, idx, ttl, indirect = t, n, 0, n, true
			continue
		}
		total += uint64(d.Len)
		if total > 0xffffffff {
			return errors.New("chain length exceeds 4 GiB")
		}
		var err error
		if d.Flags&DescFWrite != 0 {
			seenWrite = true
			c.Writable, err = q.mem.AppendBuffers(c.Writable, d.Addr, uint64(d.Len))
			c.WriteLen += d.Len
		} else {
			if seenWrite {
				return errors.New("device-readable descriptor after a writable one")
			}
			c.Readable, err = q.mem.AppendBuffers(c.Readable, d.Addr, uint64(d.Len))
			c.ReadLen += d.Len
		}
		if err != nil {
			return fmt.Errorf("descriptor %d: %w", idx, err)
		}
		c.Descriptors++
		if d.Flags&DescFNext == 0 {
			return nil
		}
		if uint32(d.Next) >= tableLen {
			return fmt.Errorf("next index %d out of range (table of %d)", d.Next, tableLen)
		}
		idx = uint32(d.Next)
	}
}

// PushUsed returns chain head to the driver with n bytes written to its
// writable buffers, publishing the element before the index.
func (q *Queue) PushUsed(head uint16, n uint32) (err error) {
	if q.broken {
		return ErrBroken
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer q.guard(&err)
	if head >= q.size {
		return q.breakf("used head %d out of range (size %d)", head, q.size)
	}
	ring.PutUsedElem(q.used, q.nextUsed&(q.size-1), uint32(head), n)
	q.nextUsed++
	ring.SetUsedIdx(q.used, q.nextUsed)
	return nil
}

// NeedsNotification reports whether the driver wants an interrupt for the
// used entries published since the last call.
func (q *Queue) NeedsNotification() (notify bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer q.guard(nil) // a broken queue's driver is told through the err eventfd
	newIdx, old := q.nextUsed, q.signalled
	valid := q.signalledValid
	q.signalled, q.signalledValid = newIdx, true
	if !q.eventIdx {
		return newIdx != old && ring.AvailFlags(q.avail)&AvailFNoInterrupt == 0
	}
	if !valid {
		return true
	}
	return needEvent(ring.UsedEvent(q.avail, q.size), newIdx, old)
}

// needEvent is vring_need_event: notify if used_event lies in (old, new],
// all in wrapping 16-bit arithmetic.
func needEvent(event, newIdx, old uint16) bool {
	return newIdx-event-1 < newIdx-old
}

// DisableNotification asks the driver not to kick (without EVENT_IDX; with
// it, the stale avail_event already suppresses kicks).
func (q *Queue) DisableNotification() {
	if !q.eventIdx && !q.broken {
		defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
		defer q.guard(nil)
		ring.SetUsedFlags(q.used, ring.UsedFlags(q.used)|UsedFNoNotify)
	}
}

// EnableNotification asks the driver to kick on new buffers, then re-reads
// the available index: true means buffers arrived meanwhile and the caller
// must drain again rather than wait for a kick that may never come.
func (q *Queue) EnableNotification() (more bool) {
	if q.broken {
		return false
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer q.guard(nil) // more stays false: the caller sees Broken
	if q.eventIdx {
		ring.SetAvailEvent(q.used, q.size, q.lastAvail)
	} else {
		ring.SetUsedFlags(q.used, ring.UsedFlags(q.used)&^UsedFNoNotify)
	}
	return ring.AvailIdx(q.avail) != q.lastAvail
}
