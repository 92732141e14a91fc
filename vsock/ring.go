package vsock

// byteRing is a fixed-size byte queue with one producer and one consumer.
// Its indexes change under the device lock, but the bytes move outside it:
// the producer fills the free region it was handed and the consumer drains
// the filled one, and the two regions never overlap.
type byteRing struct {
	buf  []byte
	r, w uint64 // consumed and produced byte counts; w-r bytes are filled
}

func newByteRing(size int) byteRing { return byteRing{buf: make([]byte, size)} }

// filled returns the number of bytes waiting.
func (b *byteRing) filled() int { return int(b.w - b.r) }

// free returns the room left.
func (b *byteRing) free() int { return len(b.buf) - b.filled() }

// freeSpan returns the contiguous free region after the last produced byte.
func (b *byteRing) freeSpan() []byte {
	n := uint64(len(b.buf))
	start := b.w % n
	end := min(n, start+uint64(b.free()))
	return b.buf[start:end]
}

// filledSpans returns the waiting bytes in order, as at most two slices.
func (b *byteRing) filledSpans() (first, second []byte) {
	n := uint64(len(b.buf))
	start := b.r % n
	f := uint64(b.filled())
	if start+f <= n {
		return b.buf[start : start+f], nil
	}
	return b.buf[start:], b.buf[:start+f-n]
}

// produced records n bytes written into freeSpan.
func (b *byteRing) produced(n int) { b.w += uint64(n) }

// consumed records n bytes taken from the front.
func (b *byteRing) consumed(n int) { b.r += uint64(n) }

// appendFrom copies up to n bytes of bufs, starting at byte skip, into the
// free space (the caller checked that n bytes fit).
func (b *byteRing) appendFrom(bufs [][]byte, skip uint32, n int) {
	for n > 0 {
		span := b.freeSpan()
		span = span[:min(len(span), n)]
		got := gather(span, bufs, skip)
		b.produced(got)
		n -= got
		skip += uint32(got)
		if got == 0 {
			return
		}
	}
}
