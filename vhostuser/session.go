package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// session is one front-end connection. Only its goroutine reads the socket,
// writes replies and changes session state; each started queue belongs to
// its RunQueue goroutine.
type session struct {
	srv  *Server
	conn *net.UnixConn

	acked      uint64
	ackedProto uint64
	mem        *virtq.Memory
	regions    []mappedRegion // parallel to mem's regions
	vrings     []*vring
	headerBuf  [HeaderSize]byte
	payloadBuf [MaxPayload]byte
	oobBuf     []byte
	replyBuf   [HeaderSize + MaxPayload]byte
}

func newSession(s *Server, c *net.UnixConn) *session {
	sess := &session{
		srv:    s,
		conn:   c,
		oobBuf: make([]byte, unix.CmsgSpace(4*maxFds)),
	}
	sess.vrings = make([]*vring, s.numQueues)
	for i := range sess.vrings {
		sess.vrings[i] = newVring(i, sess)
	}
	return sess
}

// message is a gated request: header, payload view and the descriptors it carried.
type message struct {
	hdr     Header
	spec    *reqSpec
	payload []byte
	fds     []int
}

// takeFd hands the message's single descriptor to a handler (or -1).
func (m *message) takeFd() int {
	if len(m.fds) == 0 {
		return -1
	}
	fd := m.fds[0]
	m.fds = m.fds[1:]
	return fd
}

func closeFds(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// serve runs the request loop until the peer hangs up or breaks the protocol.
func (s *session) serve() error {
	for {
		m, err := s.readMessage()
		if err == io.EOF { // a hang-up between messages, not inside one
			return nil
		}
		if err != nil {
			return err
		}
		err = s.dispatch(m)
		closeFds(m.fds) // whatever the handler did not take
		if err != nil {
			return err
		}
	}
}

// readMessage reads one message and applies every gate check.
func (s *session) readMessage() (*message, error) {
	hb := s.headerBuf[:]
	n, oobn, flags, _, err := s.conn.ReadMsgUnix(hb, s.oobBuf)
	var fds []int
	if oobn > 0 {
		var perr error
		fds, perr = parseRights(s.oobBuf[:oobn])
		if perr != nil && err == nil {
			err = perr
		}
	}
	fail := func(e error) (*message, error) {
		closeFds(fds)
		return nil, e
	}
	if err != nil {
		if n == 0 && errors.Is(err, io.EOF) {
			return fail(io.EOF)
		}
		return fail(fmt.Errorf("read header: %w", err))
	}
	if n == 0 {
		return fail(io.EOF)
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fail(fmt.Errorf("%w: ancillary data truncated (more than %d descriptors?)", ErrProtocol, maxFds))
	}
	if n < HeaderSize {
		if _, err := io.ReadFull(s.conn, hb[n:]); err != nil {
			return fail(fmt.Errorf("%w: truncated header: %w", ErrProtocol, err))
		}
	}
	h := DecodeHeader(hb)
	spec, err := checkHeader(h)
	if err != nil {
		return fail(err)
	}
	payload := s.payloadBuf[:h.Size]
	if _, err := io.ReadFull(s.conn, payload); err != nil {
		return fail(fmt.Errorf("%w: %s payload truncated: %w", ErrProtocol, spec.name, err))
	}
	if err := checkMessage(spec, h, payload, len(fds), s.ackedProto); err != nil {
		return fail(err)
	}
	return &message{hdr: h, spec: spec, payload: payload, fds: fds}, nil
}

// parseRights extracts SCM_RIGHTS descriptors; anything else is an error
// (and the descriptors found so far are still returned for closing).
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("%w: control message: %w", ErrProtocol, err)
	}
	var fds []int
	var bad error
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			bad = fmt.Errorf("%w: unexpected control message: %w", ErrProtocol, err)
			continue
		}
		fds = append(fds, got...)
	}
	if bad == nil && len(fds) > maxFds {
		bad = fmt.Errorf("%w: %d descriptors", ErrProtocol, len(fds))
	}
	return fds, bad
}

// dispatch runs the handler and sends its reply or ack. A handler error is
// reported as a nack when the front-end asked for one; otherwise, since the
// front-end would wrongly assume success, the connection is dropped.
func (s *session) dispatch(m *message) error {
	s.srv.counts[m.hdr.Req].Add(1)
	reply, err := s.handle(m)
	wantAck := s.ackedProto&(1<<ProtoReplyAck) != 0 && m.hdr.Flags&FlagNeedReply != 0
	switch m.spec.reply {
	case replyAck:
		if !wantAck {
			if err != nil {
				return fmt.Errorf("%s: %w", m.spec.name, err)
			}
			return nil
		}
		var ack [8]byte
		if err != nil {
			s.srv.opts.Logf("vhostuser: %s failed (nacked): %v", m.spec.name, err)
			binary.LittleEndian.PutUint64(ack[:], 1)
		}
		if werr := s.reply(m.hdr.Req, ack[:]); werr != nil {
			return werr
		}
		if errors.Is(err, ErrProtocol) {
			return err
		}
		return nil
	default:
		if err != nil {
			return fmt.Errorf("%s: %w", m.spec.name, err)
		}
		return s.reply(m.hdr.Req, reply)
	}
}

func (s *session) reply(req Request, payload []byte) error {
	b := s.replyBuf[:HeaderSize+len(payload)]
	EncodeHeader(b, Header{Req: req, Flags: FlagVersion | FlagReply, Size: uint32(len(payload))})
	copy(b[HeaderSize:], payload)
	if _, err := s.conn.Write(b); err != nil {
		return fmt.Errorf("write %v reply: %w", req, err)
	}
	return nil
}

func u64(v uint64) []byte {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	return b[:]
}

func (s *session) handle(m *message) ([]byte, error) {
	p := m.payload
	switch m.hdr.Req {
	case ReqGetFeatures:
		return u64(s.srv.offered), nil
	case ReqSetFeatures:
		f := binary.LittleEndian.Uint64(p)
		if f&^s.srv.offered != 0 {
			return nil, fmt.Errorf("%w: acked features %#x not offered", ErrProtocol, f&^s.srv.offered)
		}
		s.acked = f
		if f&(1<<FeatProtocolFeatures) == 0 {
			// Without protocol features rings are enabled from the start.
			for _, r := range s.vrings {
				r.enabled = true
			}
		}
		return nil, s.updateAll()
	case ReqGetProtocolFeatures:
		return u64(OfferedProtocolFeatures), nil
	case ReqSetProtocolFeatures:
		f := binary.LittleEndian.Uint64(p)
		if f&^OfferedProtocolFeatures != 0 {
			return nil, fmt.Errorf("%w: acked protocol features %#x not offered", ErrProtocol, f&^OfferedProtocolFeatures)
		}
		s.ackedProto = f
		return nil, nil
	case ReqSetOwner, ReqResetOwner:
		// One connection is one owner; RESET_OWNER is deprecated and ignored.
		return nil, nil
	case ReqGetQueueNum:
		return u64(uint64(len(s.vrings))), nil
	case ReqSetMemTable:
		return nil, s.setMemTable(m)
	case ReqGetMaxMemSlots:
		return u64(MaxMemSlots), nil
	case ReqAddMemReg:
		return nil, s.addMemReg(m)
	case ReqRemMemReg:
		return nil, s.remMemReg(m)
	case ReqSetVringNum, ReqSetVringBase, ReqSetVringEnable, ReqGetVringBase:
		st := decodeState(p)
		r, err := s.ring(st.index)
		if err != nil {
			return nil, err
		}
		return r.handleState(m.hdr.Req, st)
	case ReqSetVringAddr:
		a := decodeVringAddr(p)
		r, err := s.ring(a.index)
		if err != nil {
			return nil, err
		}
		return nil, r.setAddr(a)
	case ReqSetVringKick, ReqSetVringCall, ReqSetVringErr:
		v := binary.LittleEndian.Uint64(p)
		if v&^(vringIdxMask|VringNoFd) != 0 {
			return nil, fmt.Errorf("%w: reserved bits in %#x", ErrProtocol, v)
		}
		r, err := s.ring(uint32(v & vringIdxMask))
		if err != nil {
			return nil, err
		}
		return nil, r.setFd(m.hdr.Req, m.takeFd())
	case ReqGetConfig:
		c, _ := decodeConfigHeader(p)
		out := make([]byte, sizeConfigHead+c.size)
		copy(out, p[:sizeConfigHead])
		s.srv.dev.ReadConfig(c.offset, out[sizeConfigHead:])
		return out, nil
	case ReqSetConfig:
		return nil, errors.New("configuration space is read-only")
	}
	return nil, fmt.Errorf("%w: no handler for %v", ErrProtocol, m.hdr.Req)
}

func (s *session) ring(i uint32) (*vring, error) {
	if uint64(i) >= uint64(len(s.vrings)) {
		return nil, fmt.Errorf("%w: queue index %d, device has %d", ErrProtocol, i, len(s.vrings))
	}
	return s.vrings[i], nil
}

// updateAll starts or stops every ring to match its state.
func (s *session) updateAll() error {
	var first error
	for _, r := range s.vrings {
		if err := r.update(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// mappedRegion is one guest memory region and this process's mapping of it.
type mappedRegion struct {
	r       memRegion
	mapping []byte // [0, mmapOffset+size) of the region's fd
}

func (m mappedRegion) virtq() virtq.Region {
	o := m.r.mmapOffset
	return virtq.Region{GuestAddr: m.r.guestAddr, Size: m.r.size, UserAddr: m.r.userAddr, MmapOffset: o,
		Data: m.mapping[o : o+m.r.size : o+m.r.size]}
}

// install validates and switches to a new region list. Queues are stopped
// across the switch (their buffers point into the old mappings) and
// restarted; mappings no longer listed are unmapped afterwards. installed
// is false when the list was refused and nothing changed (the caller still
// owns any new mapping).
func (s *session) install(list []mappedRegion) (installed bool, err error) {
	vr := make([]virtq.Region, len(list))
	for i, m := range list {
		vr[i] = m.virtq()
	}
	mem, err := virtq.NewMemory(vr)
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrProtocol, err)
	}
	for _, r := range s.vrings {
		r.stopQueue()
	}
	old := s.regions
	s.mem, s.regions = mem, list
	for _, o := range old {
		kept := false
		for _, n := range list {
			if &o.mapping[0] == &n.mapping[0] {
				kept = true
			}
		}
		if !kept {
			unix.Munmap(o.mapping)
		}
	}
	return true, s.updateAll()
}

// setMemTable replaces the whole memory table.
func (s *session) setMemTable(m *message) error {
	regions, err := decodeMemTable(m.payload)
	if err != nil {
		return err
	}
	var list []mappedRegion
	for i, r := range regions {
		data, err := mapRegion(m.fds[i], r)
		if err != nil {
			unmapRegions(list)
			return err
		}
		list = append(list, mappedRegion{r: r, mapping: data})
	}
	installed, err := s.install(list)
	if !installed {
		unmapRegions(list)
	}
	return err
}

// addMemReg adds one region (CONFIGURE_MEM_SLOTS).
func (s *session) addMemReg(m *message) error {
	r, err := decodeRegion(m.payload[8:])
	if err != nil {
		return err
	}
	if len(s.regions) >= MaxMemSlots {
		return fmt.Errorf("%w: more than %d memory regions", ErrProtocol, MaxMemSlots)
	}
	data, err := mapRegion(m.fds[0], r)
	if err != nil {
		return err
	}
	nr := mappedRegion{r: r, mapping: data}
	list := append(append([]mappedRegion(nil), s.regions...), nr)
	installed, err := s.install(list)
	if !installed {
		unix.Munmap(data)
	}
	return err
}

// remMemReg removes the region with the given guest address, size and user address.
func (s *session) remMemReg(m *message) error {
	r, err := decodeRegion(m.payload[8:])
	if err != nil {
		return err
	}
	for i, o := range s.regions {
		if o.r.guestAddr == r.guestAddr && o.r.size == r.size && o.r.userAddr == r.userAddr {
			list := append(append([]mappedRegion(nil), s.regions[:i]...), s.regions[i+1:]...)
			_, err := s.install(list)
			return err
		}
	}
	return fmt.Errorf("no memory region at guest address %#x size %#x", r.guestAddr, r.size)
}

// mapRegion maps [0, mmap_offset+size) of fd shared, so the offset need not
// meet the mapping alignment of hugetlbfs-backed memory.
func mapRegion(fd int, r memRegion) ([]byte, error) {
	total := r.mmapOffset + r.size // overflow checked when decoding
	if total > 1<<46 {
		return nil, fmt.Errorf("%w: region of %d bytes", ErrProtocol, total)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat region fd: %w", err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFREG && uint64(st.Size) < total {
		return nil, fmt.Errorf("%w: region needs %d bytes of a %d-byte file", ErrProtocol, total, st.Size)
	}
	data, err := unix.Mmap(fd, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap guest region: %w", err)
	}
	return data, nil
}

func unmapRegions(list []mappedRegion) {
	for _, m := range list {
		unix.Munmap(m.mapping)
	}
}

// teardown stops every queue, closes ring descriptors and unmaps guest memory.
func (s *session) teardown() {
	for _, r := range s.vrings {
		r.stopQueue()
		r.closeFds()
	}
	s.srv.dev.Disconnect()
	unmapRegions(s.regions)
	s.regions, s.mem = nil, nil
}
