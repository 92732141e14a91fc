package overlay

import "math/bits"

// DirtyBytes is how many bytes of the disk the guest changed (blocks
// written, discarded or zeroed, which now read from the overlay rather
// than the base): what the pod added to its image. Discarded blocks
// count though the overlay file holds no data for them. It counts the
// dirty bitmap, a few microseconds per GiB of disk.
func (d *Device) DirtyBytes() int64 {
	var blocks uint64
	for i := range d.words {
		blocks += uint64(bits.OnesCount64(d.words[i].Load()))
	}
	if blocks == 0 {
		return 0
	}
	n := int64(blocks) << d.shift
	// The last block may be short: count only its bytes.
	if last := d.nblocks - 1; d.dirty(last) {
		n -= d.blockSize - d.blockSpan(last)
	}
	return n
}
