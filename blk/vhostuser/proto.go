package vhostuser

import (
	"encoding/binary"
	"fmt"
	"math/bits"
)

// Wire format of the vhost-user protocol (QEMU docs/interop/vhost-user.rst):
// a 12-byte header (request, flags, payload size; native little-endian on
// the hosts we support) followed by at most maxPayload bytes of payload;
// file descriptors travel as SCM_RIGHTS ancillary data with the header.

const (
	headerSize = 12
	// maxPayload bounds every payload (the spec's VHOST_USER_MAX_MSG_SIZE).
	maxPayload = 0x1000
	// maxFds is the most descriptors one message may carry (SET_MEM_TABLE's
	// VHOST_MEMORY_BASELINE_NREGIONS); more is a protocol error.
	maxFds = 8
	// maxConfigSize bounds GET_CONFIG/SET_CONFIG windows (VHOST_USER_MAX_CONFIG_SIZE).
	maxConfigSize = 256

	flagVersionMask = 0x3
	flagVersion     = 0x1
	flagReply       = 0x4
	flagNeedReply   = 0x8
	flagsKnown      = flagVersionMask | flagReply | flagNeedReply

	// vringNoFd is bit 8 of a kick/call/err payload: no descriptor attached.
	vringNoFd    = 1 << 8
	vringIdxMask = 0xff
)

// request is a vhost-user front-end request number.
type request uint32

// Requests this backend understands; every other number is refused.
const (
	reqGetFeatures         request = 1  // VHOST_USER_GET_FEATURES: reply u64 virtio features
	reqSetFeatures         request = 2  // VHOST_USER_SET_FEATURES: u64 acked virtio features
	reqSetOwner            request = 3  // VHOST_USER_SET_OWNER: session start
	reqResetOwner          request = 4  // VHOST_USER_RESET_OWNER: deprecated, ignored
	reqSetMemTable         request = 5  // VHOST_USER_SET_MEM_TABLE: regions + one fd each
	reqSetVringNum         request = 8  // VHOST_USER_SET_VRING_NUM: queue size
	reqSetVringAddr        request = 9  // VHOST_USER_SET_VRING_ADDR: ring addresses (front-end VAs)
	reqSetVringBase        request = 10 // VHOST_USER_SET_VRING_BASE: next available index
	reqGetVringBase        request = 11 // VHOST_USER_GET_VRING_BASE: stop ring, reply its available index
	reqSetVringKick        request = 12 // VHOST_USER_SET_VRING_KICK: kick eventfd, starts the ring
	reqSetVringCall        request = 13 // VHOST_USER_SET_VRING_CALL: call (interrupt) eventfd
	reqSetVringErr         request = 14 // VHOST_USER_SET_VRING_ERR: error eventfd
	reqGetProtocolFeatures request = 15 // VHOST_USER_GET_PROTOCOL_FEATURES: reply u64
	reqSetProtocolFeatures request = 16 // VHOST_USER_SET_PROTOCOL_FEATURES: u64 acked
	reqGetQueueNum         request = 17 // VHOST_USER_GET_QUEUE_NUM: reply u64 (needs MQ)
	reqSetVringEnable      request = 18 // VHOST_USER_SET_VRING_ENABLE: enable/disable a ring
	reqGetConfig           request = 24 // VHOST_USER_GET_CONFIG: read device config space (needs CONFIG)
	reqSetConfig           request = 25 // VHOST_USER_SET_CONFIG: write config space; refused
	reqGetMaxMemSlots      request = 36 // VHOST_USER_GET_MAX_MEM_SLOTS: reply u64 (needs CONFIGURE_MEM_SLOTS)
	reqAddMemReg           request = 37 // VHOST_USER_ADD_MEM_REG: one region + its fd
	reqRemMemReg           request = 38 // VHOST_USER_REM_MEM_REG: one region (QEMU may attach its fd)
)

// Protocol feature bits.
const (
	protoMQ       = 0  // VHOST_USER_PROTOCOL_F_MQ
	protoReplyAck = 3  // VHOST_USER_PROTOCOL_F_REPLY_ACK
	protoConfig   = 9  // VHOST_USER_PROTOCOL_F_CONFIG
	protoMemSlots = 15 // VHOST_USER_PROTOCOL_F_CONFIGURE_MEM_SLOTS
	protoNone     = -1 // no protocol feature required

	offeredProtocolFeatures = 1<<protoMQ | 1<<protoReplyAck | 1<<protoConfig | 1<<protoMemSlots

	// maxMemSlots is how many regions ADD_MEM_REG may build up (GET_MAX_MEM_SLOTS).
	maxMemSlots = 64
)

// Virtio feature bits.
const (
	featBlkSegMax      = 2
	featBlkRO          = 5
	featBlkBlkSize     = 6
	featBlkFlush       = 9
	featBlkMQ          = 12
	featBlkDiscard     = 13
	featBlkWriteZeroes = 14
	featIndirectDesc   = 28
	featEventIdx       = 29
	featProtocol       = 30 // VHOST_USER_F_PROTOCOL_FEATURES
	featVersion1       = 32
)

// fdRule says which descriptors a request may carry.
type fdRule uint8

const (
	fdsNone     fdRule = iota // none allowed
	fdsVring                  // one, unless the payload sets vringNoFd
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
	reqGetFeatures:         {name: "GET_FEATURES", reply: replyU64, proto: protoNone},
	reqSetFeatures:         {name: "SET_FEATURES", minSize: sizeU64, maxSize: sizeU64, proto: protoNone},
	reqSetOwner:            {name: "SET_OWNER", proto: protoNone},
	reqResetOwner:          {name: "RESET_OWNER", proto: protoNone},
	reqSetMemTable:         {name: "SET_MEM_TABLE", minSize: sizeMemHeader + sizeMemRegion, maxSize: sizeMemHeader + maxFds*sizeMemRegion, fds: fdsRegions, proto: protoNone},
	reqSetVringNum:         {name: "SET_VRING_NUM", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	reqSetVringAddr:        {name: "SET_VRING_ADDR", minSize: sizeVringAddr, maxSize: sizeVringAddr, proto: protoNone},
	reqSetVringBase:        {name: "SET_VRING_BASE", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	reqGetVringBase:        {name: "GET_VRING_BASE", minSize: sizeState, maxSize: sizeState, reply: replyState, proto: protoNone},
	reqSetVringKick:        {name: "SET_VRING_KICK", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	reqSetVringCall:        {name: "SET_VRING_CALL", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	reqSetVringErr:         {name: "SET_VRING_ERR", minSize: sizeU64, maxSize: sizeU64, fds: fdsVring, proto: protoNone},
	reqGetProtocolFeatures: {name: "GET_PROTOCOL_FEATURES", reply: replyU64, proto: protoNone},
	reqSetProtocolFeatures: {name: "SET_PROTOCOL_FEATURES", minSize: sizeU64, maxSize: sizeU64, proto: protoNone},
	reqGetQueueNum:         {name: "GET_QUEUE_NUM", reply: replyU64, proto: protoMQ},
	reqSetVringEnable:      {name: "SET_VRING_ENABLE", minSize: sizeState, maxSize: sizeState, proto: protoNone},
	reqGetConfig:           {name: "GET_CONFIG", minSize: sizeConfigHead, maxSize: sizeConfigHead + maxConfigSize, reply: replyConfig, proto: protoConfig, config: true},
	reqGetMaxMemSlots:      {name: "GET_MAX_MEM_SLOTS", reply: replyU64, proto: protoMemSlots},
	reqAddMemReg:           {name: "ADD_MEM_REG", minSize: sizeSingleReg, maxSize: sizeSingleReg, fds: fdsOne, proto: protoMemSlots},
	reqRemMemReg:           {name: "REM_MEM_REG", minSize: sizeSingleReg, maxSize: sizeSingleReg, fds: fdsOptional, proto: protoMemSlots},
	reqSetConfig:           {name: "SET_CONFIG", minSize: sizeConfigHead, maxSize: sizeConfigHead + maxConfigSize, proto: protoConfig, config: true},
}

func specFor(r request) (*reqSpec, bool) {
	if uint64(r) >= uint64(len(specs)) || specs[r].name == "" {
		return nil, false
	}
	return &specs[r], true
}

func (r request) String() string {
	if s, ok := specFor(r); ok {
		return s.name
	}
	return fmt.Sprintf("request(%d)", uint32(r))
}

// header is a decoded message header.
type header struct {
	req   request
	flags uint32
	size  uint32
}

func decodeHeader(b []byte) header {
	return header{
		req:   request(binary.LittleEndian.Uint32(b[0:4])),
		flags: binary.LittleEndian.Uint32(b[4:8]),
		size:  binary.LittleEndian.Uint32(b[8:12]),
	}
}

func encodeHeader(b []byte, h header) {
	binary.LittleEndian.PutUint32(b[0:4], uint32(h.req))
	binary.LittleEndian.PutUint32(b[4:8], h.flags)
	binary.LittleEndian.PutUint32(b[8:12], h.size)
}

// checkHeader applies the header checks that precede reading the payload.
func checkHeader(h header) (*reqSpec, error) {
	if h.flags&flagVersionMask != flagVersion {
		return nil, fmt.Errorf("%w: version %d", errProtocol, h.flags&flagVersionMask)
	}
	if h.flags&^flagsKnown != 0 {
		return nil, fmt.Errorf("%w: reserved flag bits %#x", errProtocol, h.flags&^flagsKnown)
	}
	if h.flags&flagReply != 0 {
		return nil, fmt.Errorf("%w: %v has the reply flag", errProtocol, h.req)
	}
	if h.size > maxPayload {
		return nil, fmt.Errorf("%w: payload of %d bytes exceeds %d", errProtocol, h.size, maxPayload)
	}
	spec, ok := specFor(h.req)
	if !ok {
		return nil, fmt.Errorf("%w: unknown request %d", errProtocol, uint32(h.req))
	}
	if h.size < spec.minSize || h.size > spec.maxSize {
		return nil, fmt.Errorf("%w: %s payload is %d bytes, want %d..%d", errProtocol, spec.name, h.size, spec.minSize, spec.maxSize)
	}
	return spec, nil
}

// checkMessage applies the payload-dependent checks: acked protocol feature,
// exact payload shape and the descriptor count.
func checkMessage(spec *reqSpec, h header, payload []byte, nfds int, ackedProto uint64) error {
	if spec.proto != protoNone && ackedProto&(1<<spec.proto) == 0 {
		return fmt.Errorf("%w: %s needs protocol feature %d, not acked", errProtocol, spec.name, spec.proto)
	}
	if uint32(len(payload)) != h.size {
		return fmt.Errorf("%w: %s payload truncated", errProtocol, spec.name)
	}
	want := 0
	switch spec.fds {
	case fdsVring:
		if binary.LittleEndian.Uint64(payload)&vringNoFd == 0 {
			want = 1
		}
	case fdsRegions:
		n := binary.LittleEndian.Uint32(payload[0:4])
		if n == 0 || n > maxFds {
			return fmt.Errorf("%w: %s with %d regions", errProtocol, spec.name, n)
		}
		if h.size != sizeMemHeader+n*sizeMemRegion {
			return fmt.Errorf("%w: %s of %d regions is %d bytes", errProtocol, spec.name, n, h.size)
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
		if h.size != sizeConfigHead+cfg.size {
			return fmt.Errorf("%w: %s declares %d config bytes in a %d-byte payload", errProtocol, spec.name, cfg.size, h.size)
		}
	}
	if nfds != want {
		return fmt.Errorf("%w: %s carries %d file descriptors, want %d", errProtocol, spec.name, nfds, want)
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
		return r, fmt.Errorf("%w: zero-size memory region", errProtocol)
	}
	_, c1 := bits.Add64(r.guestAddr, r.size, 0)
	_, c2 := bits.Add64(r.userAddr, r.size, 0)
	_, c3 := bits.Add64(r.mmapOffset, r.size, 0)
	if c1|c2|c3 != 0 {
		return r, fmt.Errorf("%w: memory region overflows", errProtocol)
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
		return c, fmt.Errorf("%w: config window offset %d size %d", errProtocol, c.offset, c.size)
	}
	return c, nil
}
