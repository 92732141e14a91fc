package vhostblk

import (
	"encoding/binary"
	"math/bits"
	"runtime/debug"
	"time"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// BlockDevice is the storage behind the virtio-blk device; *overlay.Device satisfies it.
// Implementations must be safe for concurrent use (one caller per queue).
type BlockDevice interface {
	// ReadAt reads len(p) bytes at byte offset off.
	ReadAt(p []byte, off int64) (int, error)
	// WriteAt writes p at byte offset off.
	WriteAt(p []byte, off int64) (int, error)
	// Flush makes completed writes durable.
	Flush() error
	// Discard deallocates a byte range; it reads as zeros afterwards.
	Discard(off, n int64) error
	// WriteZeroes zeroes a byte range; unmap allows deallocation.
	WriteZeroes(off, n int64, unmap bool) error
	// Size returns the device size in bytes (a multiple of 512).
	Size() int64
	// ReadOnly reports whether writes are refused.
	ReadOnly() bool
	// ID returns the serial reported by GET_ID (at most 20 bytes are used).
	ID() string
}

// VectorWriter is implemented by devices that take a request's data
// buffers in one call (*overlay.Device does); others get one WriteAt per buffer.
type VectorWriter interface {
	// WriteVecAt writes the concatenation of bufs at byte offset off.
	WriteVecAt(bufs [][]byte, off int64) (int, error)
}

// VectorReader is implemented by devices that fill a request's data
// buffers in one call (*overlay.Device does); others get one ReadAt per buffer.
type VectorReader interface {
	// ReadVecAt fills bufs, in order, with the bytes at byte offset off.
	ReadVecAt(bufs [][]byte, off int64) (int, error)
}

// virtio-blk request types and status values (virtio 1.2 section 5.2.6).
const (
	blkTypeIn          = 0
	blkTypeOut         = 1
	blkTypeFlush       = 4
	blkTypeGetID       = 8
	blkTypeDiscard     = 11
	blkTypeWriteZeroes = 13

	blkStatusOK     = 0
	blkStatusIOErr  = 1
	blkStatusUnsupp = 2

	blkHeaderSize  = 16
	blkSegmentSize = 16 // virtio_blk_discard_write_zeroes
	blkIDBytes     = 20
	sectorSize     = 512

	blkFlagUnmap = 1

	// blkConfigSize is the part of struct virtio_blk_config the device fills.
	blkConfigSize = 60
)

// blkConfig is the device-side configuration of the virtio-blk device.
type blkConfig struct {
	capacity          uint64 // 512-byte sectors
	segMax            uint32
	blkSize           uint32
	numQueues         uint16
	maxDiscardSectors uint32
	maxDiscardSeg     uint32
	discardAlign      uint32
	maxWZSectors      uint32
	maxWZSeg          uint32
	maxRequestBytes   uint64
	readOnly          bool
}

// configSpace encodes struct virtio_blk_config up to write_zeroes_may_unmap
// and its padding (the fields after it are not offered).
func (c *blkConfig) configSpace() [blkConfigSize]byte {
	var b [blkConfigSize]byte
	le := binary.LittleEndian
	le.PutUint64(b[0:], c.capacity)
	le.PutUint32(b[8:], 0) // size_max: VIRTIO_BLK_F_SIZE_MAX not offered
	le.PutUint32(b[12:], c.segMax)
	// geometry (16..20) not offered
	le.PutUint32(b[20:], c.blkSize)
	// topology (24..32) not offered; writeback (32) without CONFIG_WCE
	le.PutUint16(b[34:], c.numQueues)
	le.PutUint32(b[36:], c.maxDiscardSectors)
	le.PutUint32(b[40:], c.maxDiscardSeg)
	le.PutUint32(b[44:], c.discardAlign)
	le.PutUint32(b[48:], c.maxWZSectors)
	le.PutUint32(b[52:], c.maxWZSeg)
	b[56] = 1 // write_zeroes_may_unmap
	return b
}

// blkHandler executes virtio-blk requests against a BlockDevice.
type blkHandler struct {
	dev  BlockDevice
	cfg  blkConfig
	logf func(format string, args ...any)
	// shards are the request counters, one per queue (numQueues of them).
	shards []counterShard
}

// reqStat is what execute tells handle about a request for the counters.
type reqStat struct {
	op    Op
	bytes uint64 // data moved, counted only if the request succeeds
}

// handle executes one request chain and returns the number of bytes written
// into guest buffers (including the status byte), the used length.
//
// Guest memory can fault (see virtq.ErrFault): the request then fails with
// IOERR, or, when the status byte itself cannot be written, goes back with
// used length 0, and the shim lives on. Faults inside system calls on guest
// buffers come back as EFAULT errors; those on Go's own accesses (the
// header, the segments, a partial block's bytes, the status byte) are
// turned into panics here and recovered.
//
// The request is counted in ctr, its queue's counters.
func (h *blkHandler) handle(c *virtq.Chain, ctr *counterShard) uint32 {
	start := time.Now()
	if c.WriteLen == 0 || len(c.Writable) == 0 {
		ctr.record(OpOther, 0, true, time.Since(start))
		return 0 // no status byte: nothing we can tell the driver
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	last := c.Writable[len(c.Writable)-1]
	dataIn := c.WriteLen - 1 // writable bytes before the status byte

	rs := reqStat{op: OpOther}
	st, written := h.executeGuarded(c, dataIn, &rs)
	if err := putStatus(&last[len(last)-1], st); err != nil {
		h.logf("vhostblk: request returned without status: %v", err)
		ctr.record(rs.op, 0, true, time.Since(start))
		return 0
	}
	ctr.record(rs.op, rs.bytes, st != blkStatusOK, time.Since(start))
	return written + 1
}

// executeGuarded is execute with a fault on guest memory turned into IOERR.
func (h *blkHandler) executeGuarded(c *virtq.Chain, dataIn uint32, rs *reqStat) (st byte, written uint32) {
	defer func() {
		if r := recover(); r != nil {
			err := virtq.FaultError(r) // panics again unless r is a memory fault
			h.logf("vhostblk: request failed: %v", err)
			st, written = blkStatusIOErr, 0
		}
	}()
	return h.execute(c, dataIn, rs)
}

// putStatus stores the status byte; the error is a fault on its page.
func putStatus(p *byte, st byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = virtq.FaultError(r)
		}
	}()
	*p = st
	return nil
}

// execute runs one request; it names the request's class and data size
// in rs as soon as it knows them.
func (h *blkHandler) execute(c *virtq.Chain, dataIn uint32, rs *reqStat) (byte, uint32) {
	if c.ReadLen < blkHeaderSize {
		return blkStatusIOErr, 0
	}
	var hdr [blkHeaderSize]byte
	gather(hdr[:], c.Readable, 0)
	typ := binary.LittleEndian.Uint32(hdr[0:4])
	sector := binary.LittleEndian.Uint64(hdr[8:16])
	dataOut := c.ReadLen - blkHeaderSize

	// header + status take a descriptor each; the rest are data segments.
	if c.Descriptors > int(h.cfg.segMax)+2 {
		return blkStatusIOErr, 0
	}
	switch typ {
	case blkTypeIn:
		rs.op, rs.bytes = OpRead, uint64(dataIn)
		off, ok := h.span(sector, uint64(dataIn))
		if !ok || dataOut != 0 {
			return blkStatusIOErr, 0
		}
		n, err := h.readInto(c.Writable, dataIn, off)
		if err != nil {
			return blkStatusIOErr, n
		}
		return blkStatusOK, n
	case blkTypeOut:
		rs.op, rs.bytes = OpWrite, uint64(dataOut)
		if h.cfg.readOnly {
			return blkStatusIOErr, 0
		}
		off, ok := h.span(sector, uint64(dataOut))
		if !ok || dataIn != 0 {
			return blkStatusIOErr, 0
		}
		if err := h.writeFrom(c.Readable, blkHeaderSize, off); err != nil {
			return blkStatusIOErr, 0
		}
		return blkStatusOK, 0
	case blkTypeFlush:
		rs.op = OpFlush
		if err := h.dev.Flush(); err != nil {
			return blkStatusIOErr, 0
		}
		return blkStatusOK, 0
	case blkTypeGetID:
		var id [blkIDBytes]byte
		copy(id[:], h.dev.ID())
		n := min(dataIn, blkIDBytes)
		scatter(c.Writable, id[:n])
		return blkStatusOK, n
	case blkTypeDiscard, blkTypeWriteZeroes:
		rs.op = OpDiscard
		if typ == blkTypeWriteZeroes {
			rs.op = OpWriteZeroes
		}
		st, n := h.discardOrZero(c, typ, dataOut)
		rs.bytes = n
		return st, 0
	default:
		return blkStatusUnsupp, 0
	}
}

// span converts a sector and byte length into a byte offset, checking
// alignment, the request-size cap and the device end without overflow.
func (h *blkHandler) span(sector, n uint64) (int64, bool) {
	if n%sectorSize != 0 || n > h.cfg.maxRequestBytes {
		return 0, false
	}
	return h.spanUncapped(sector, n)
}

// readInto reads n bytes at off straight into the writable buffers (the
// status byte excluded) and returns how many bytes reached the guest.
func (h *blkHandler) readInto(bufs [][]byte, n uint32, off int64) (uint32, error) {
	if vr, ok := h.dev.(VectorReader); ok {
		// Trim the list to n bytes in place (the status byte was taken
		// before): the chain's buffer list is rebuilt on every pop.
		var k int
		var have uint32
		for k < len(bufs) && have < n {
			if l := uint32(len(bufs[k])); l > n-have {
				bufs[k] = bufs[k][:n-have]
			}
			have += uint32(len(bufs[k]))
			k++
		}
		got, err := vr.ReadVecAt(bufs[:k], off)
		if err != nil {
			return 0, err
		}
		return uint32(got), nil
	}
	var done uint32
	for _, b := range bufs {
		if done == n {
			break
		}
		b = b[:min(uint32(len(b)), n-done)]
		if _, err := h.dev.ReadAt(b, off+int64(done)); err != nil {
			return done, err
		}
		done += uint32(len(b))
	}
	return done, nil
}

// writeFrom writes the readable bytes after skip to the device at off. It
// may reslice the elements of bufs (the chain's own buffer list).
func (h *blkHandler) writeFrom(bufs [][]byte, skip uint32, off int64) error {
	if vw, ok := h.dev.(VectorWriter); ok {
		for len(bufs) > 0 && uint32(len(bufs[0])) <= skip {
			skip -= uint32(len(bufs[0]))
			bufs = bufs[1:]
		}
		if len(bufs) == 0 {
			return nil
		}
		bufs[0] = bufs[0][skip:]
		_, err := vw.WriteVecAt(bufs, off)
		return err
	}
	for _, b := range bufs {
		if uint32(len(b)) <= skip {
			skip -= uint32(len(b))
			continue
		}
		b = b[skip:]
		skip = 0
		if _, err := h.dev.WriteAt(b, off); err != nil {
			return err
		}
		off += int64(len(b))
	}
	return nil
}

// blkSegment is one decoded virtio_blk_discard_write_zeroes segment,
// checked: off and n are byte values inside the device.
type blkSegment struct {
	off, n int64
	unmap  bool
}

// maxSegments bounds the segments of one discard or write-zeroes request
// (the max_discard_seg and max_write_zeroes_seg the device offers), so the
// request's segments are copied out of guest memory into a fixed array.
const maxSegments = defaultMaxDiscardSeg

// discardOrZero runs a discard or write-zeroes request and returns its
// status and the bytes its segments cover.
func (h *blkHandler) discardOrZero(c *virtq.Chain, typ uint32, dataOut uint32) (byte, uint64) {
	maxSeg, maxSectors := h.cfg.maxDiscardSeg, h.cfg.maxDiscardSectors
	if typ == blkTypeWriteZeroes {
		maxSeg, maxSectors = h.cfg.maxWZSeg, h.cfg.maxWZSectors
	}
	if dataOut == 0 || dataOut%blkSegmentSize != 0 || dataOut/blkSegmentSize > min(maxSeg, maxSegments) {
		return blkStatusIOErr, 0
	}
	if h.cfg.readOnly {
		return blkStatusIOErr, 0
	}
	// Copy every segment out of guest memory once, check the copy and use
	// only the copy: the guest may rewrite the segments while the request
	// runs, and a second read would bypass the checks.
	var raw [maxSegments * blkSegmentSize]byte
	nseg := dataOut / blkSegmentSize
	gather(raw[:dataOut], c.Readable, blkHeaderSize)
	var segs [maxSegments]blkSegment
	var total uint64
	for i := range nseg {
		seg := raw[i*blkSegmentSize : (i+1)*blkSegmentSize]
		sector := binary.LittleEndian.Uint64(seg[0:8])
		num := binary.LittleEndian.Uint32(seg[8:12])
		flags := binary.LittleEndian.Uint32(seg[12:16])
		if flags&^blkFlagUnmap != 0 || (typ == blkTypeDiscard && flags&blkFlagUnmap != 0) {
			return blkStatusUnsupp, 0
		}
		if num > maxSectors {
			return blkStatusIOErr, 0
		}
		n := uint64(num) * sectorSize // at most 2^32 * 512: no overflow
		off, ok := h.spanUncapped(sector, n)
		if !ok {
			return blkStatusIOErr, 0
		}
		segs[i] = blkSegment{off: off, n: int64(n), unmap: flags&blkFlagUnmap != 0}
		total += n
	}
	for _, s := range segs[:nseg] {
		var err error
		if typ == blkTypeDiscard {
			err = h.dev.Discard(s.off, s.n)
		} else {
			err = h.dev.WriteZeroes(s.off, s.n, s.unmap)
		}
		if err != nil {
			return blkStatusIOErr, 0
		}
	}
	return blkStatusOK, total
}

// spanUncapped is span without the data-transfer size cap (discard and
// write-zeroes move no data; their own sector limits apply).
func (h *blkHandler) spanUncapped(sector, n uint64) (int64, bool) {
	hi, off := bits.Mul64(sector, sectorSize)
	if hi != 0 {
		return 0, false
	}
	end, carry := bits.Add64(off, n, 0)
	if carry != 0 || end > h.cfg.capacity*sectorSize {
		return 0, false
	}
	return int64(off), true
}

// gather copies len(dst) bytes starting at byte skip of bufs; the caller
// has checked that enough bytes exist.
func gather(dst []byte, bufs [][]byte, skip uint32) {
	for _, b := range bufs {
		if len(dst) == 0 {
			return
		}
		if uint32(len(b)) <= skip {
			skip -= uint32(len(b))
			continue
		}
		n := copy(dst, b[skip:])
		dst = dst[n:]
		skip = 0
	}
}

// scatter copies src into the start of bufs.
func scatter(bufs [][]byte, src []byte) {
	for _, b := range bufs {
		if len(src) == 0 {
			return
		}
		src = src[copy(b, src):]
	}
}
