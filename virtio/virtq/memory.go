// Package virtq implements the device side of a virtio 1.x split virtqueue
// over guest memory shared by the VMM (vhost-user SET_MEM_TABLE regions).
//
// Everything read from guest memory is untrusted: addresses and lengths are
// checked with overflow-safe arithmetic, slices never extend past a region,
// and a malformed ring marks the queue broken instead of panicking.
package virtq

import (
	"errors"
	"fmt"
	"math/bits"
)

// ErrBadAddress reports a guest address (or address range) outside every region.
var ErrBadAddress = errors.New("virtq: guest address not mapped")

// Region is one contiguous piece of guest RAM mapped into this process.
type Region struct {
	// GuestAddr is the guest physical address of the first byte.
	GuestAddr uint64
	// Size is the region length in bytes; Data holds exactly Size bytes.
	Size uint64
	// UserAddr is the VMM's virtual address of the first byte (vhost-user ring addresses use it).
	UserAddr uint64
	// MmapOffset is the offset of the region inside the file descriptor it was mapped from.
	MmapOffset uint64
	// Data is the mapping of the region in this process.
	Data []byte
}

// Memory is an immutable set of non-overlapping guest memory regions.
type Memory struct {
	regions []Region
}

// MaxRegions bounds the number of regions a Memory accepts.
const MaxRegions = 509

// NewMemory validates regions (nonzero, no overflow, no overlap in guest or
// user address space, Data of the declared size) and returns a Memory.
func NewMemory(regions []Region) (*Memory, error) {
	if len(regions) > MaxRegions {
		return nil, fmt.Errorf("virtq: %d regions, at most %d", len(regions), MaxRegions)
	}
	rs := make([]Region, len(regions))
	copy(rs, regions)
	for i, r := range rs {
		if r.Size == 0 {
			return nil, fmt.Errorf("virtq: region %d has zero size", i)
		}
		if uint64(len(r.Data)) != r.Size {
			return nil, fmt.Errorf("virtq: region %d maps %d bytes, declares %d", i, len(r.Data), r.Size)
		}
		if _, c := bits.Add64(r.GuestAddr, r.Size-1, 0); c != 0 {
			return nil, fmt.Errorf("virtq: region %d guest range overflows", i)
		}
		if _, c := bits.Add64(r.UserAddr, r.Size-1, 0); c != 0 {
			return nil, fmt.Errorf("virtq: region %d user range overflows", i)
		}
		if _, c := bits.Add64(r.MmapOffset, r.Size, 0); c != 0 {
			return nil, fmt.Errorf("virtq: region %d mmap offset overflows", i)
		}
		for j := range i {
			o := rs[j]
			if overlaps(r.GuestAddr, r.Size, o.GuestAddr, o.Size) {
				return nil, fmt.Errorf("virtq: regions %d and %d overlap in guest memory", j, i)
			}
			if overlaps(r.UserAddr, r.Size, o.UserAddr, o.Size) {
				return nil, fmt.Errorf("virtq: regions %d and %d overlap in user memory", j, i)
			}
		}
	}
	return &Memory{regions: rs}, nil
}

// overlaps reports whether [a, a+an) and [b, b+bn) intersect; sizes are nonzero
// and a+an-1, b+bn-1 do not overflow.
func overlaps(a, an, b, bn uint64) bool {
	return a <= b+bn-1 && b <= a+an-1
}

// Regions returns the regions (shared; callers must not modify them).
func (m *Memory) Regions() []Region { return m.regions }

// find returns the region holding gpa and the offset inside it.
func (m *Memory) find(gpa uint64) (*Region, uint64, bool) {
	for i := range m.regions {
		r := &m.regions[i]
		if gpa >= r.GuestAddr && gpa-r.GuestAddr < r.Size {
			return r, gpa - r.GuestAddr, true
		}
	}
	return nil, 0, false
}

// Slice returns guest memory starting at gpa, up to n bytes but clamped to the
// end of the region holding gpa (so possibly shorter than n).
func (m *Memory) Slice(gpa, n uint64) ([]byte, error) {
	if m == nil {
		return nil, ErrBadAddress
	}
	r, off, ok := m.find(gpa)
	if !ok {
		return nil, fmt.Errorf("%w: %#x", ErrBadAddress, gpa)
	}
	n = min(n, r.Size-off)
	return r.Data[off : off+n : off+n], nil
}

// Range returns exactly n bytes at gpa, which must lie in a single region
// (rings and indirect tables are accessed this way).
func (m *Memory) Range(gpa, n uint64) ([]byte, error) {
	if n == 0 {
		return nil, fmt.Errorf("%w: empty range at %#x", ErrBadAddress, gpa)
	}
	if _, c := bits.Add64(gpa, n-1, 0); c != 0 {
		return nil, fmt.Errorf("%w: %#x+%d overflows", ErrBadAddress, gpa, n)
	}
	b, err := m.Slice(gpa, n)
	if err != nil {
		return nil, err
	}
	if uint64(len(b)) != n {
		return nil, fmt.Errorf("%w: %#x+%d crosses a region end", ErrBadAddress, gpa, n)
	}
	return b, nil
}

// AppendBuffers appends the slices covering [gpa, gpa+n) to dst, splitting
// at region boundaries; the whole range must be mapped.
func (m *Memory) AppendBuffers(dst [][]byte, gpa, n uint64) ([][]byte, error) {
	if n == 0 {
		return dst, nil
	}
	if _, c := bits.Add64(gpa, n-1, 0); c != 0 {
		return dst, fmt.Errorf("%w: %#x+%d overflows", ErrBadAddress, gpa, n)
	}
	for n > 0 {
		b, err := m.Slice(gpa, n)
		if err != nil {
			return dst, err
		}
		dst = append(dst, b)
		gpa += uint64(len(b))
		n -= uint64(len(b))
	}
	return dst, nil
}

// UserToGuest translates a VMM virtual address to a guest physical address.
func (m *Memory) UserToGuest(va uint64) (uint64, error) {
	if m == nil {
		return 0, ErrBadAddress
	}
	for i := range m.regions {
		r := &m.regions[i]
		if va >= r.UserAddr && va-r.UserAddr < r.Size {
			return r.GuestAddr + (va - r.UserAddr), nil
		}
	}
	return 0, fmt.Errorf("%w: user address %#x", ErrBadAddress, va)
}
