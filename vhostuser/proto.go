package vhostuser

import (
	"encoding/binary"
	"fmt"
	"math/bits"
)

// Wire format of the vhost-user protocol (QEMU docs/interop/vhost-user.rst):
// a 12-byte header (request, flags, payload size; native little-endian on
// the hosts we support) followed by at most MaxPayload bytes of payload;
// file descriptors travel as SCM_RIGHTS ancillary data with the header.

const (
	// HeaderSize is the size of a message header.
	HeaderSize = 12
	// MaxPayload bounds every payload (the spec's VHOST_USER_MAX_MSG_SIZE).
	MaxPayload = 0x1000
	// maxFds is the most descriptors one message may carry (SET_MEM_TABLE's
	// VHOST_MEMORY_BASELINE_NREGIONS); more is a protocol error.
	maxFds = 8
	// maxConfigSize bounds GET_CONFIG/SET_CONFIG windows (VHOST_USER_MAX_CONFIG_SIZE).
	maxConfigSize = 256

	flagVersionMask = 0x3
	// FlagVersion is the protocol version every header carries.
	FlagVersion = 0x1
	// FlagReply marks a reply.
	FlagReply = 0x4
	// FlagNeedReply asks for an ack (with REPLY_ACK negotiated).
	FlagNeedReply = 0x8
	flagsKnown    = flagVersionMask | FlagReply | FlagNeedReply

	// VringNoFd is bit 8 of a kick/call/err payload: no descriptor attached.
	VringNoFd    = 1 << 8
	vringIdxMask = 0xff
)

// Request is a vhost-user front-end request number.
type Request uint32

// Requests this backend understands; every other number is refused.
const (
	ReqGetFeatures         Request = 1  // VHOST_USER_GET_FEATURES: reply u64 virtio features
	ReqSetFeatures         Request = 2  // VHOST_USER_SET_FEATURES: u64 acked virtio features
	ReqSetOwner            Request = 3  // VHOST_USER_SET_OWNER: session start
	ReqResetOwner          Request = 4  // VHOST_USER_RESET_OWNER: deprecated, ignored
	ReqSetMemTable         Request = 5  // VHOST_USER_SET_MEM_TABLE: regions + one fd each
	ReqSetVringNum         Request = 8  // VHOST_USER_SET_VRING_NUM: queue size
	ReqSetVringAddr        Request = 9  // VHOST_USER_SET_VRING_ADDR: ring addresses (front-end VAs)
	ReqSetVringBase        Request = 10 // VHOST_USER_SET_VRING_BASE: next available index
	ReqGetVringBase        Request = 11 // VHOST_USER_GET_VRING_BASE: stop ring, reply its available index
	ReqSetVringKick        Request = 12 // VHOST_USER_SET_VRING_KICK: kick eventfd, starts the ring
	ReqSetVringCall        Request = 13 // VHOST_USER_SET_VRING_CALL: call (interrupt) eventfd
	ReqSetVringErr         Request = 14 // VHOST_USER_SET_VRING_ERR: error eventfd
	ReqGetProtocolFeatures Request = 15 // VHOST_USER_GET_PROTOCOL_FEATURES: reply u64
	ReqSetProtocolFeatures Request = 16 // VHOST_USER_SET_PROTOCOL_FEATURES: u64 acked
	ReqGetQueueNum         Request = 17 // VHOST_USER_GET_QUEUE_NUM: reply u64 (needs MQ)
	ReqSetVringEnable      Request = 18 // VHOST_USER_SET_VRING_ENABLE: enable/disable a ring
	ReqGetConfig           Request = 24 // VHOST_USER_GET_CONFIG: read device config space (needs CONFIG)
	ReqSetConfig           Request = 25 // VHOST_USER_SET_CONFIG: write config space; refused
	ReqGetMaxMemSlots      Request = 36 // VHOST_USER_GET_MAX_MEM_SLOTS: reply u64 (needs CONFIGURE_MEM_SLOTS)
	ReqAddMemReg           Request = 37 // VHOST_USER_ADD_MEM_REG: one region + its fd
	ReqRemMemReg           Request = 38 // VHOST_USER_REM_MEM_REG: one region (QEMU may attach its fd)
)

// Protocol feature bits (VHOST_USER_PROTOCOL_F_*) the core offers.
const (
	ProtoMQ       = 0  // VHOST_USER_PROTOCOL_F_MQ: GET_QUEUE_NUM
	ProtoReplyAck = 3  // VHOST_USER_PROTOCOL_F_REPLY_ACK: acks on NEED_REPLY
	ProtoConfig   = 9  // VHOST_USER_PROTOCOL_F_CONFIG: GET_CONFIG/SET_CONFIG
	ProtoMemSlots = 15 // VHOST_USER_PROTOCOL_F_CONFIGURE_MEM_SLOTS: ADD/REM_MEM_REG
	protoNone     = -1 // no protocol feature required

	// OfferedProtocolFeatures is every protocol feature bit the core offers.
	OfferedProtocolFeatures = 1<<ProtoMQ | 1<<ProtoReplyAck | 1<<ProtoConfig | 1<<ProtoMemSlots

	// MaxMemSlots is how many regions ADD_MEM_REG may build up (GET_MAX_MEM_SLOTS).
	MaxMemSlots = 64
)

// Transport feature bits the core handles for every device.
const (
	FeatIndirectDesc     = 28 // VIRTIO_RING_F_INDIRECT_DESC
	FeatEventIdx         = 29 // VIRTIO_RING_F_EVENT_IDX
	FeatProtocolFeatures = 30 // VHOST_USER_F_PROTOCOL_FEATURES
	FeatVersion1         = 32 // VIRTIO_F_VERSION_1
)

// fdRule says which descriptors a request may carry.
type fdRule uint8

const (
	fdsNone     fdRule = iota // none allowed
	fdsVring                  // one, unless the payload sets VringNoFd
	fdsRegions                // exactly one per memory region
	fdsOne                    // exactly one
	fdsOptional               // none or one (closed unused)
)

// replyKind says what a request answers.
type replyKind uint8

const (
	replyAck    replyKind = iota // nothing, or a u64 ack when REPLY_ACK and NEED_REPLY
	replyU64                     // a u64
	replyState                   // a vhost_vring_state
	replyConfig                  // a config header + bytes
)

// reqSpec is the single source of per-request checks applied by the gate.
type reqSpec struct {
	name    string
	minSize uint32 // payload size bounds; equal for fixed-size payloads
	maxSize uint32
	fds     fdRule
	proto   int // protocol feature that must be acked, or protoNone
	reply   replyKind
	config  bool // payload is a VhostUserConfig whose declared size must match
}

const (
	sizeU64        = 8
	sizeState      = 8
	sizeVringAddr  = 40
	sizeMemHeader  = 8
	sizeMemRegion  = 32
	sizeConfigHead = 12
	sizeSingleReg  = 8 + sizeMemRegion // VhostUserMemRegMsg: padding + region
)

// specs is indexed by request; a zero name marks an unknown request.
var specs = [...]reqSpec{
	ReqGetFeatures:         {name: "GET_FEATURES", reply: replyU64, proto: protoNone},
	ReqSetFeatures:         {name: "SET_FEATURES", minSize: sizeU64, maxSize: sizeU64, proto: protoNone},
	ReqSetOwner:            {name: "SET_OWNER", proto: protoNone},
	ReqResetOwner:          {name: "RESET_OWNER", proto: protoNone},
	ReqSetMemTable:         {name: "SET_MEM_TABLE", minSize: sizeMemHeader + sizeMemRegion, maxSize: sizeMemHeader + maxFds*sizeMemRegion, fds: fdsRegions, proto: protoNone},
	ReqSetVringNum:         {name: "SET_VRING_NUM", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	ReqSetVringAddr:        {name: "SET_VRING_ADDR", minSize: sizeVringAddr, maxSize: sizeVringAddr, proto: protoNone},
	ReqSetVringBase:        {name: "SET_VRING_BASE", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	ReqGetVringBase:        {name: "GET_VRING_BASE", minSize: sizeState, maxSize: sizeState, reply: replyState, proto: protoNone},
	ReqSetVringKick:        {name: "SET_VRING_KICK", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	ReqSetVringCall:        {name: "SET_VRING_CALL", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	ReqSetVringErr:         {name: "SET_VRING_ERR", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	ReqGetProtocolFeatures: {name: "GET_PROTOCOL_FEATURES", reply: replyU64, proto: protoNone},
	ReqSetProtocolFeatures: {name: "SET_PROTOCOL_FEATURES", minSize: sizeU64, maxSize: sizeU64, proto: protoNone},
	ReqGetQueueNum:         {name: "GET_QUEUE_NUM", reply: replyU64, proto: ProtoMQ},
	ReqSetVringEnable:      {name: "SET_VRING_ENABLE", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	ReqGetConfig:           {name: "GET_CONFIG", minSize: sizeConfigHead, maxSize: sizeConfigHead + maxConfigSize, reply: replyConfig, proto: ProtoConfig, config: true},
	ReqGetMaxMemSlots:      {name: "GET_MAX_MEM_SLOTS", reply: replyU64, proto: ProtoMemSlots},
	ReqAddMemReg:           {name: "ADD_MEM_REG", minSize: sizeSingleReg, maxSize: sizeSingleReg, fds: fdsOne, proto: ProtoMemSlots},
	ReqRemMemReg:           {name: "REM_MEM_REG", minSize: sizeSingleReg, maxSize: sizeSingleReg, fds: fdsOptional, proto: ProtoMemSlots},
	ReqSetConfig:           {name: "SET_CONFIG", minSize: sizeConfigHead, maxSize: sizeConfigHead + maxConfigSize, proto: ProtoConfig, config: true},
}

func specFor(r Request) (*reqSpec, bool) {
	if uint64(r) >= uint64(len(specs)) || specs[r].name == "" {
		return nil, false
	}
	return &specs[r], true
}

func (r Request) String() string {
	if s, ok := specFor(r); ok {
		return s.name
	}
	return fmt.Sprintf("request(%d)", uint32(r))
}

// Header is a decoded message header.
type Header struct {
	// Req is the request number.
	Req Request
	// Flags holds the version and the reply and need-reply bits.
	Flags uint32
	// Size is the payload size in bytes.
	Size uint32
}

// DecodeHeader decodes the first HeaderSize bytes of b.
func DecodeHeader(b []byte) Header {
	return Header{
		Req:   Request(binary.LittleEndian.Uint32(b[0:4])),
		Flags: binary.LittleEndian.Uint32(b[4:8]),
		Size:  binary.LittleEndian.Uint32(b[8:12]),
	}
}

// EncodeHeader writes h into the first HeaderSize bytes of b.
func EncodeHeader(b []byte, h Header) {
	binary.LittleEndian.PutUint32(b[0:4], uint32(h.Req))
	binary.LittleEndian.PutUint32(b[4:8], h.Flags)
	binary.LittleEndian.PutUint32(b[8:12], h.Size)
}

// checkHeader applies the header checks that precede reading the payload.
func checkHeader(h Header) (*reqSpec, error) {
	if h.Flags&flagVersionMask != FlagVersion {
		return nil, fmt.Errorf("%w: version %d", ErrProtocol, h.Flags&flagVersionMask)
	}
	if h.Flags&^flagsKnown != 0 {
		return nil, fmt.Errorf("%w: reserved flag bits %#x", ErrProtocol, h.Flags&^flagsKnown)
	}
	if h.Flags&FlagReply != 0 {
		return nil, fmt.Errorf("%w: %v has the reply flag", ErrProtocol, h.Req)
	}
	if h.Size > MaxPayload {
		return nil, fmt.Errorf("%w: payload of %d bytes exceeds %d", ErrProtocol, h.Size, MaxPayload)
	}
	spec, ok := specFor(h.Req)
	if !ok {
		return nil, fmt.Errorf("%w: unknown request %d", ErrProtocol, uint32(h.Req))
	}
	if h.Size < spec.minSize || h.Size > spec.maxSize {
		return nil, fmt.Errorf("%w: %s payload is %d bytes, want %d..%d", ErrProtocol, spec.name, h.Size, spec.minSize, spec.maxSize)
	}
	return spec, nil
}

// checkMessage applies the payload-dependent checks: acked protocol feature,
// exact payload shape and the descriptor count.
func checkMessage(spec *reqSpec, h Header, payload []byte, nfds int, ackedProto uint64) error {
	if spec.proto != protoNone && ackedProto&(1<<spec.proto) == 0 {
		return fmt.Errorf("%w: %s needs protocol feature %d, not acked", ErrProtocol, spec.name, spec.proto)
	}
	if uint32(len(payload)) != h.Size {
		return fmt.Errorf("%w: %s payload truncated", ErrProtocol, spec.name)
	}
	want := 0
	switch spec.fds {
	case fdsVring:
		if binary.LittleEndian.Uint64(payload)&VringNoFd == 0 {
			want = 1
		}
	case fdsRegions:
		n := binary.LittleEndian.Uint32(payload[0:4])
		if n == 0 || n > maxFds {
			return fmt.Errorf("%w: %s with %d regions", ErrProtocol, spec.name, n)
		}
		if h.Size != sizeMemHeader+n*sizeMemRegion {
			return fmt.Errorf("%w: %s of %d regions is %d bytes", ErrProtocol, spec.name, n, h.Size)
		}
		want = int(n)
	case fdsOne:
		want = 1
	case fdsOptional:
		want = min(nfds, 1)
	}
	if spec.config {
		cfg, err := decodeConfigHeader(payload)
		if err != nil {
			return err
		}
		if h.Size != sizeConfigHead+cfg.size {
			return fmt.Errorf("%w: %s declares %d config bytes in a %d-byte payload", ErrProtocol, spec.name, cfg.size, h.Size)
		}
	}
	if nfds != want {
		return fmt.Errorf("%w: %s carries %d file descriptors, want %d", ErrProtocol, spec.name, nfds, want)
	}
	return nil
}

// memRegion is a VhostUserMemoryRegion.
type memRegion struct {
	guestAddr  uint64
	size       uint64
	userAddr   uint64
	mmapOffset uint64
}

func decodeMemTable(p []byte) ([]memRegion, error) {
	n := binary.LittleEndian.Uint32(p[0:4])
	rs := make([]memRegion, 0, n)
	for i := range int(n) {
		r, err := decodeRegion(p[sizeMemHeader+i*sizeMemRegion:])
		if err != nil {
			return nil, fmt.Errorf("region %d: %w", i, err)
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// decodeRegion decodes and syntax-checks one VhostUserMemoryRegion.
func decodeRegion(e []byte) (memRegion, error) {
	r := memRegion{
		guestAddr:  binary.LittleEndian.Uint64(e[0:8]),
		size:       binary.LittleEndian.Uint64(e[8:16]),
		userAddr:   binary.LittleEndian.Uint64(e[16:24]),
		mmapOffset: binary.LittleEndian.Uint64(e[24:32]),
	}
	if r.size == 0 {
		return r, fmt.Errorf("%w: zero-size memory region", ErrProtocol)
	}
	_, c1 := bits.Add64(r.guestAddr, r.size, 0)
	_, c2 := bits.Add64(r.userAddr, r.size, 0)
	_, c3 := bits.Add64(r.mmapOffset, r.size, 0)
	if c1|c2|c3 != 0 {
		return r, fmt.Errorf("%w: memory region overflows", ErrProtocol)
	}
	return r, nil
}

// vringState is a vhost_vring_state.
type vringState struct{ index, num uint32 }

func decodeState(p []byte) vringState {
	return vringState{index: binary.LittleEndian.Uint32(p[0:4]), num: binary.LittleEndian.Uint32(p[4:8])}
}

// vringAddr is a vhost_vring_addr (addresses in the front-end's address space).
type vringAddr struct {
	index                  uint32
	flags                  uint32
	desc, used, avail, log uint64
}

func decodeVringAddr(p []byte) vringAddr {
	return vringAddr{
		index: binary.LittleEndian.Uint32(p[0:4]),
		flags: binary.LittleEndian.Uint32(p[4:8]),
		desc:  binary.LittleEndian.Uint64(p[8:16]),
		used:  binary.LittleEndian.Uint64(p[16:24]),
		avail: binary.LittleEndian.Uint64(p[24:32]),
		log:   binary.LittleEndian.Uint64(p[32:40]),
	}
}

// configHeader is the head of a VhostUserConfig payload.
type configHeader struct{ offset, size, flags uint32 }

func decodeConfigHeader(p []byte) (configHeader, error) {
	c := configHeader{
		offset: binary.LittleEndian.Uint32(p[0:4]),
		size:   binary.LittleEndian.Uint32(p[4:8]),
		flags:  binary.LittleEndian.Uint32(p[8:12]),
	}
	end, carry := bits.Add32(c.offset, c.size, 0)
	if carry != 0 || end > maxConfigSize || c.size == 0 {
		return c, fmt.Errorf("%w: config window offset %d size %d", ErrProtocol, c.offset, c.size)
	}
	return c, nil
}
