package vsock

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Wire format of the virtio socket device (virtio 1.2 section 5.10.6): every
// packet starts with a 44-byte little-endian header; a RW packet's payload
// follows it in the same descriptor chain.

// Packet header layout and limits.
const (
	hdrSize = 44

	// maxPayload bounds one packet's payload in either direction: Linux
	// never sends more (VIRTIO_VSOCK_MAX_PKT_BUF_SIZE), and a guest that
	// claims more is malformed.
	maxPayload = 64 << 10

	// hostCID is the host's context id (VMADDR_CID_HOST).
	hostCID = 2
)

// Packet types and operations (struct virtio_vsock_hdr's type and op).
const (
	typeStream = 1

	opInvalid       = 0
	opRequest       = 1
	opResponse      = 2
	opRST           = 3
	opShutdown      = 4
	opRW            = 5
	opCreditUpdate  = 6
	opCreditRequest = 7

	shutdownRcv  = 1 // VIRTIO_VSOCK_SHUTDOWN_RCV: the sender will receive no more
	shutdownSend = 2 // VIRTIO_VSOCK_SHUTDOWN_SEND: the sender will send no more

	// eventTransportReset is VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, the id
	// of a struct virtio_vsock_event (one le32) on the event queue.
	eventTransportReset = 0
	eventSize           = 4
)

// Queue indexes of the device.
const (
	queueRX    = 0
	queueTX    = 1
	queueEvent = 2
	numQueues  = 3
)

// featVersion1 is VIRTIO_F_VERSION_1; the core offers it for every device.
// The device offers no feature bits of its own (no VIRTIO_VSOCK_F_SEQPACKET).

// header is a decoded struct virtio_vsock_hdr.
type header struct {
	srcCID, dstCID   uint64
	srcPort, dstPort uint32
	len              uint32
	typ              uint16
	op               uint16
	flags            uint32
	bufAlloc         uint32
	fwdCnt           uint32
}

func decodeHeader(b []byte) header {
	le := binary.LittleEndian
	return header{
		srcCID:   le.Uint64(b[0:8]),
		dstCID:   le.Uint64(b[8:16]),
		srcPort:  le.Uint32(b[16:20]),
		dstPort:  le.Uint32(b[20:24]),
		len:      le.Uint32(b[24:28]),
		typ:      le.Uint16(b[28:30]),
		op:       le.Uint16(b[30:32]),
		flags:    le.Uint32(b[32:36]),
		bufAlloc: le.Uint32(b[36:40]),
		fwdCnt:   le.Uint32(b[40:44]),
	}
}

func (h *header) encode(b []byte) {
	le := binary.LittleEndian
	le.PutUint64(b[0:8], h.srcCID)
	le.PutUint64(b[8:16], h.dstCID)
	le.PutUint32(b[16:20], h.srcPort)
	le.PutUint32(b[20:24], h.dstPort)
	le.PutUint32(b[24:28], h.len)
	le.PutUint16(b[28:30], h.typ)
	le.PutUint16(b[30:32], h.op)
	le.PutUint32(b[32:36], h.flags)
	le.PutUint32(b[36:40], h.bufAlloc)
	le.PutUint32(b[40:44], h.fwdCnt)
}

func (h *header) String() string {
	return fmt.Sprintf("%d:%d -> %d:%d type %d op %s flags %#x len %d buf_alloc %d fwd_cnt %d",
		h.srcCID, h.srcPort, h.dstCID, h.dstPort, h.typ, opName(h.op), h.flags, h.len, h.bufAlloc, h.fwdCnt)
}

func opName(op uint16) string {
	switch op {
	case opRequest:
		return "REQUEST"
	case opResponse:
		return "RESPONSE"
	case opRST:
		return "RST"
	case opShutdown:
		return "SHUTDOWN"
	case opRW:
		return "RW"
	case opCreditUpdate:
		return "CREDIT_UPDATE"
	case opCreditRequest:
		return "CREDIT_REQUEST"
	}
	return fmt.Sprintf("op(%d)", op)
}

// Reasons a guest packet is malformed.
var (
	errShortPacket = errors.New("vsock: packet shorter than its header")
	errLenMismatch = errors.New("vsock: header len does not match the buffer")
	errTooLong     = errors.New("vsock: payload over the packet limit")
	errWritable    = errors.New("vsock: transmit chain has device-writable buffers")
)

// parsePacket decodes the header at the start of a transmit chain's
// readable buffers (readLen bytes in all) and returns it with the payload
// length. The header's len must equal the bytes after the header and
// stay within maxPayload; any writable buffer makes the chain malformed.
// The header comes back (valid=true) whenever 44 bytes were there, so the
// caller can answer a malformed packet with RST.
func parsePacket(readable [][]byte, readLen uint32, writeLen uint32) (h header, valid bool, err error) {
	if readLen < hdrSize {
		return header{}, false, fmt.Errorf("%w: %d bytes", errShortPacket, readLen)
	}
	var b [hdrSize]byte
	gather(b[:], readable, 0)
	h = decodeHeader(b[:])
	switch {
	case writeLen != 0:
		return h, true, fmt.Errorf("%w (%d bytes)", errWritable, writeLen)
	case h.len > maxPayload:
		return h, true, fmt.Errorf("%w: %d bytes", errTooLong, h.len)
	case h.len != readLen-hdrSize:
		return h, true, fmt.Errorf("%w: len %d, %d bytes after the header", errLenMismatch, h.len, readLen-hdrSize)
	}
	return h, true, nil
}

// gather copies len(dst) bytes starting at byte skip of bufs into dst and
// returns how many it found.
func gather(dst []byte, bufs [][]byte, skip uint32) int {
	n := 0
	for _, b := range bufs {
		if n == len(dst) {
			break
		}
		if uint32(len(b)) <= skip {
			skip -= uint32(len(b))
			continue
		}
		n += copy(dst[n:], b[skip:])
		skip = 0
	}
	return n
}

// scatter copies src into bufs starting at byte skip and returns how many
// bytes fit.
func scatter(bufs [][]byte, skip uint32, src []byte) int {
	n := 0
	for _, b := range bufs {
		if n == len(src) {
			break
		}
		if uint32(len(b)) <= skip {
			skip -= uint32(len(b))
			continue
		}
		n += copy(b[skip:], src[n:])
		skip = 0
	}
	return n
}
