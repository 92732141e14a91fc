//go:build amd64 || arm64 || riscv64 || ppc64le || loong64 || 386 || arm || mipsle || mips64le || wasm

package virtq

// This file is the only place that touches the ring index and flag words
// shared with the driver. Every access is atomic: the available index is
// loaded with acquire semantics before the ring entries it publishes are read,
// and the used index is stored with release semantics after the used elements
// it publishes are written. Go's sync/atomic operations are sequentially
// consistent, so they also supply the full fence the virtio spec asks for
// between publishing the used index and reading used_event, and between
// publishing avail_event and re-reading the available index.
//
// sync/atomic has no 16-bit operations. Ring fields are 2-byte aligned, so
// each lies inside one naturally aligned 32-bit word of the mapping (guest
// regions are page aligned; test memory comes from 8-byte-aligned heap
// allocations). Loads read that word; stores replace the 16 bits with a
// compare-and-swap loop so the neighbouring 16 bits, which the driver may be
// writing, are never clobbered. The build constraint lists little-endian
// architectures only, matching virtio's little-endian rings.

import (
	"encoding/binary"
	"sync/atomic"
	"unsafe"
)

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
		nw := old&^mask | uint32(v)<<shift
		if atomic.CompareAndSwapUint32(w, old, nw) {
			return
		}
	}
}

// Field offsets inside the split rings (virtio 1.2 section 2.7).
const (
	descSize     = 16
	availHeader  = 4 // flags, idx
	usedHeader   = 4 // flags, idx
	usedElemSize = 8
)

func availFlags(avail []byte) uint16 { return load16(avail[0:]) }
func availIdx(avail []byte) uint16   { return load16(avail[2:]) }

// availEntry reads ring[slot] of the available ring.
func availEntry(avail []byte, slot uint16) uint16 {
	return load16(avail[availHeader+2*int(slot):])
}

// usedEvent reads used_event, the last field of the available ring.
func usedEvent(avail []byte, size uint16) uint16 {
	return load16(avail[availHeader+2*int(size):])
}

func usedIdx(used []byte) uint16         { return load16(used[2:]) }
func setUsedIdx(used []byte, v uint16)   { store16(used[2:], v) }
func usedFlags(used []byte) uint16       { return load16(used[0:]) }
func setUsedFlags(used []byte, v uint16) { store16(used[0:], v) }
func setAvailEvent(used []byte, size uint16, v uint16) {
	store16(used[usedHeader+usedElemSize*int(size):], v)
}

// writeUsedElem fills used ring element slot; it becomes visible to the
// driver only with the following setUsedIdx.
func writeUsedElem(used []byte, slot uint16, id, n uint32) {
	e := used[usedHeader+usedElemSize*int(slot):]
	binary.LittleEndian.PutUint32(e[0:4], id)
	binary.LittleEndian.PutUint32(e[4:8], n)
}

// descriptor is one split-ring descriptor, copied out of guest memory once so
// the driver cannot change it between checks and use.
type descriptor struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func readDesc(table []byte, i uint16) descriptor {
	e := table[descSize*int(i) : descSize*int(i)+descSize]
	return descriptor{
		addr:  binary.LittleEndian.Uint64(e[0:8]),
		len:   binary.LittleEndian.Uint32(e[8:12]),
		flags: binary.LittleEndian.Uint16(e[12:14]),
		next:  binary.LittleEndian.Uint16(e[14:16]),
	}
}
