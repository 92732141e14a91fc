//go:build amd64 || arm64 || riscv64 || ppc64le || loong64 || 386 || arm || mipsle || mips64le || wasm

// Package ring reads and writes the fields of a split virtqueue (virtio 1.2
// section 2.7) in shared memory. It is the one place that touches the ring
// index and flag words, for the device (package virtq) and for the test
// driver (package virtq/testdriver) alike, so both sides obey the same
// memory-ordering rules.
//
// Every index and flag access is atomic. The available index is loaded with
// acquire semantics before the ring entries it publishes are read, and the
// used index is stored with release semantics after the used elements it
// publishes are written (and the same holds the other way round for the
// driver). Go's sync/atomic operations are sequentially consistent, so they
// also supply the full fence the virtio spec asks for between publishing the
// used index and reading used_event, and between publishing avail_event and
// re-reading the available index.
//
// sync/atomic has no 16-bit operations. Ring fields are 2-byte aligned, so
// each lies inside one naturally aligned 32-bit word of the mapping (guest
// regions are page aligned; test memory comes from 8-byte-aligned heap
// allocations). Loads read that word; stores replace the 16 bits with a
// compare-and-swap loop so the neighbouring 16 bits, which the other side
// may be writing, are never clobbered. Available ring entries share words
// with each other and with the index, so they go through the same atomics.
// The build constraint lists little-endian architectures only, matching
// virtio's little-endian rings.
package ring

import (
	"encoding/binary"
	"sync/atomic"
	"unsafe"
)

// Sizes of the split ring's parts, in bytes.
const (
	// DescSize is the size of one descriptor.
	DescSize = 16
	// AvailHeader is the size of the available ring's flags and idx.
	AvailHeader = 4
	// UsedHeader is the size of the used ring's flags and idx.
	UsedHeader = 4
	// UsedElemSize is the size of one used ring element (id, len).
	UsedElemSize = 8
	// EventSize is the size of used_event or avail_event (EVENT_IDX).
	EventSize = 2
)

// AvailLen is the size of the available ring of a queue of size entries,
// including used_event.
func AvailLen(size uint16) uint64 { return AvailHeader + 2*uint64(size) + EventSize }

// UsedLen is the size of the used ring of a queue of size entries, including
// avail_event.
func UsedLen(size uint16) uint64 { return UsedHeader + UsedElemSize*uint64(size) + EventSize }

// word returns the aligned 32-bit word holding the 2 bytes at b[0:2] and the
// bit shift of those bytes inside it.
func word(b []byte) (*uint32, uint) {
	p := unsafe.Pointer(&b[:2][0])
	addr := uintptr(p)
	w := (*uint32)(unsafe.Add(p, -int(addr&3)))
	return w, uint(addr&3) * 8
}

// load16 atomically loads a little-endian 16-bit ring field.
func load16(b []byte) uint16 {
	w, shift := word(b)
	return uint16(atomic.LoadUint32(w) >> shift)
}

// store16 atomically stores a little-endian 16-bit ring field.
func store16(b []byte, v uint16) {
	w, shift := word(b)
	mask := uint32(0xffff) << shift
	for {
		old := atomic.LoadUint32(w)
		if atomic.CompareAndSwapUint32(w, old, old&^mask|uint32(v)<<shift) {
			return
		}
	}
}

// AvailFlags loads the available ring's flags.
func AvailFlags(avail []byte) uint16 { return load16(avail[0:]) }

// SetAvailFlags stores the available ring's flags.
func SetAvailFlags(avail []byte, v uint16) { store16(avail[0:], v) }

// AvailIdx loads the available ring's index.
func AvailIdx(avail []byte) uint16 { return load16(avail[2:]) }

// SetAvailIdx stores the available ring's index, publishing the entries
// written before it.
func SetAvailIdx(avail []byte, v uint16) { store16(avail[2:], v) }

// AvailEntry loads ring[slot] of the available ring.
func AvailEntry(avail []byte, slot uint16) uint16 {
	return load16(avail[AvailHeader+2*int(slot):])
}

// SetAvailEntry stores ring[slot] of the available ring; the device may see
// it only after the following SetAvailIdx.
func SetAvailEntry(avail []byte, slot, head uint16) {
	store16(avail[AvailHeader+2*int(slot):], head)
}

// UsedEvent loads used_event, the field after the available ring's entries.
func UsedEvent(avail []byte, size uint16) uint16 {
	return load16(avail[AvailHeader+2*int(size):])
}

// SetUsedEvent stores used_event.
func SetUsedEvent(avail []byte, size, v uint16) {
	store16(avail[AvailHeader+2*int(size):], v)
}

// UsedFlags loads the used ring's flags.
func UsedFlags(used []byte) uint16 { return load16(used[0:]) }

// SetUsedFlags stores the used ring's flags.
func SetUsedFlags(used []byte, v uint16) { store16(used[0:], v) }

// UsedIdx loads the used ring's index.
func UsedIdx(used []byte) uint16 { return load16(used[2:]) }

// SetUsedIdx stores the used ring's index, publishing the elements written
// before it.
func SetUsedIdx(used []byte, v uint16) { store16(used[2:], v) }

// AvailEvent loads avail_event, the field after the used ring's elements.
func AvailEvent(used []byte, size uint16) uint16 {
	return load16(used[UsedHeader+UsedElemSize*int(size):])
}

// SetAvailEvent stores avail_event.
func SetAvailEvent(used []byte, size, v uint16) {
	store16(used[UsedHeader+UsedElemSize*int(size):], v)
}

// PutUsedElem fills used ring element slot; the driver may see it only
// after the following SetUsedIdx.
func PutUsedElem(used []byte, slot uint16, id, n uint32) {
	e := used[UsedHeader+UsedElemSize*int(slot):]
	binary.LittleEndian.PutUint32(e[0:4], id)
	binary.LittleEndian.PutUint32(e[4:8], n)
}

// UsedElem reads used ring element slot, which the caller saw published by
// UsedIdx.
func UsedElem(used []byte, slot uint16) (id, n uint32) {
	e := used[UsedHeader+UsedElemSize*int(slot):]
	return binary.LittleEndian.Uint32(e[0:4]), binary.LittleEndian.Uint32(e[4:8])
}

// Desc is one split-ring descriptor.
type Desc struct {
	Addr  uint64
	Len   uint32
	Flags uint16
	Next  uint16
}

// ReadDesc copies descriptor i out of table; the device checks and uses the
// copy so the driver cannot change it in between.
func ReadDesc(table []byte, i uint16) Desc {
	e := table[DescSize*int(i) : DescSize*int(i)+DescSize]
	return Desc{
		Addr:  binary.LittleEndian.Uint64(e[0:8]),
		Len:   binary.LittleEndian.Uint32(e[8:12]),
		Flags: binary.LittleEndian.Uint16(e[12:14]),
		Next:  binary.LittleEndian.Uint16(e[14:16]),
	}
}

// PutDesc writes d as descriptor i of table.
func PutDesc(table []byte, i uint16, d Desc) {
	e := table[DescSize*int(i) : DescSize*int(i)+DescSize]
	binary.LittleEndian.PutUint64(e[0:8], d.Addr)
	binary.LittleEndian.PutUint32(e[8:12], d.Len)
	binary.LittleEndian.PutUint16(e[12:14], d.Flags)
	binary.LittleEndian.PutUint16(e[14:16], d.Next)
}
