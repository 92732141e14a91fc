// Package testdriver plays the virtio driver's part in tests: it lays out a
// split virtqueue in (fake or shared) guest memory, writes descriptor chains,
// publishes them and reads the used ring back. It is test support only; it
// trusts its caller and panics on misuse.
package testdriver

import (
	"fmt"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/internal/ring"
)

// Buf is one buffer of a chain the driver submits.
type Buf struct {
	// Addr is the buffer's guest physical address.
	Addr uint64
	// Len is the buffer length in bytes.
	Len uint32
	// Write marks a device-writable buffer.
	Write bool
}

// Layout returns aligned ring addresses for a queue of size starting at base
// (descriptor table, available ring with used_event, used ring with
// avail_event) and the first address after them.
func Layout(base uint64, size uint16) (desc, avail, used, end uint64) {
	desc = (base + 15) &^ 15
	avail = desc + ring.DescSize*uint64(size)
	used = (avail + ring.AvailLen(size) + 3) &^ 3
	end = used + ring.UsedLen(size)
	return desc, avail, used, end
}

// Driver is the driver side of one split queue.
type Driver struct {
	Mem                           *virtq.Memory
	Size                          uint16
	DescAddr, AvailAddr, UsedAddr uint64

	avail, used []byte // the rings, including used_event and avail_event

	nextDesc uint16
	availIdx uint16
	lastUsed uint16
}

// New zeroes the rings at the given addresses and returns a driver for them.
func New(mem *virtq.Memory, size uint16, desc, avail, used uint64) *Driver {
	d := &Driver{Mem: mem, Size: size, DescAddr: desc, AvailAddr: avail, UsedAddr: used}
	clear(d.bytes(desc, ring.DescSize*uint64(size)))
	d.avail = d.bytes(avail, ring.AvailLen(size))
	d.used = d.bytes(used, ring.UsedLen(size))
	clear(d.avail)
	clear(d.used)
	return d
}

func (d *Driver) bytes(gpa, n uint64) []byte {
	b, err := d.Mem.Range(gpa, n)
	if err != nil {
		panic(fmt.Sprintf("testdriver: %v", err))
	}
	return b
}

// Write copies b into guest memory at gpa (which may cross regions).
func (d *Driver) Write(gpa uint64, b []byte) {
	bufs, err := d.Mem.AppendBuffers(nil, gpa, uint64(len(b)))
	if err != nil {
		panic(fmt.Sprintf("testdriver: %v", err))
	}
	for _, s := range bufs {
		b = b[copy(s, b):]
	}
}

// Read copies n bytes of guest memory at gpa.
func (d *Driver) Read(gpa uint64, n int) []byte {
	bufs, err := d.Mem.AppendBuffers(nil, gpa, uint64(n))
	if err != nil {
		panic(fmt.Sprintf("testdriver: %v", err))
	}
	out := make([]byte, 0, n)
	for _, s := range bufs {
		out = append(out, s...)
	}
	return out
}

// SetDesc writes descriptor i of the table at table (the queue's own table or an indirect one).
func (d *Driver) SetDesc(table uint64, i uint16, addr uint64, length uint32, flags, next uint16) {
	e := d.bytes(table+ring.DescSize*uint64(i), ring.DescSize)
	ring.PutDesc(e, 0, ring.Desc{Addr: addr, Len: length, Flags: flags, Next: next})
}

func (d *Driver) alloc() uint16 {
	i := d.nextDesc
	d.nextDesc = (d.nextDesc + 1) & (d.Size - 1)
	return i
}

// Chain writes bufs as a chain of consecutive descriptors and returns its head.
func (d *Driver) Chain(bufs ...Buf) uint16 {
	idx := make([]uint16, len(bufs))
	for i := range bufs {
		idx[i] = d.alloc()
	}
	for i, b := range bufs {
		var flags, next uint16
		if b.Write {
			flags |= virtq.DescFWrite
		}
		if i+1 < len(bufs) {
			flags |= virtq.DescFNext
			next = idx[i+1]
		}
		d.SetDesc(d.DescAddr, idx[i], b.Addr, b.Len, flags, next)
	}
	return idx[0]
}

// IndirectChain writes bufs as an indirect table at table and one queue
// descriptor pointing to it, returning that descriptor's index.
func (d *Driver) IndirectChain(table uint64, bufs ...Buf) uint16 {
	for i, b := range bufs {
		var flags, next uint16
		if b.Write {
			flags |= virtq.DescFWrite
		}
		if i+1 < len(bufs) {
			flags |= virtq.DescFNext
			next = uint16(i + 1)
		}
		d.SetDesc(table, uint16(i), b.Addr, b.Len, flags, next)
	}
	head := d.alloc()
	d.SetDesc(d.DescAddr, head, table, uint32(ring.DescSize*len(bufs)), virtq.DescFIndirect, 0)
	return head
}

// Publish puts heads on the available ring and then advances its index.
func (d *Driver) Publish(heads ...uint16) {
	for _, h := range heads {
		ring.SetAvailEntry(d.avail, d.availIdx&(d.Size-1), h)
		d.availIdx++
	}
	ring.SetAvailIdx(d.avail, d.availIdx)
}

// SetAvailIdx stores a raw available index (for corrupt-ring tests).
func (d *Driver) SetAvailIdx(v uint16) {
	d.availIdx = v
	ring.SetAvailIdx(d.avail, v)
}

// SetAvailFlags stores the available ring's flags.
func (d *Driver) SetAvailFlags(v uint16) { ring.SetAvailFlags(d.avail, v) }

// SetUsedEvent stores used_event (EVENT_IDX).
func (d *Driver) SetUsedEvent(v uint16) { ring.SetUsedEvent(d.avail, d.Size, v) }

// AvailEvent loads avail_event (EVENT_IDX).
func (d *Driver) AvailEvent() uint16 { return ring.AvailEvent(d.used, d.Size) }

// UsedFlags loads the used ring's flags.
func (d *Driver) UsedFlags() uint16 { return ring.UsedFlags(d.used) }

// UsedIdx loads the used ring's index.
func (d *Driver) UsedIdx() uint16 { return ring.UsedIdx(d.used) }

// Used returns the next used element, if the device published one.
func (d *Driver) Used() (id, n uint32, ok bool) {
	if d.UsedIdx() == d.lastUsed {
		return 0, 0, false
	}
	id, n = ring.UsedElem(d.used, d.lastUsed&(d.Size-1))
	d.lastUsed++
	return id, n, true
}

// LastUsed returns the used index up to which the driver has consumed elements.
func (d *Driver) LastUsed() uint16 { return d.lastUsed }
