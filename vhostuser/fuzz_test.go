package vhostuser

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// feWait bounds the tests' waits: a hang guard, not a timing assertion.
const feWait = 20 * time.Second

func le64b(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func state(idx, num uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, idx)
	return binary.LittleEndian.AppendUint32(b, num)
}

// nullDevice has queues that pop nothing: the core's own behaviour is
// what the fuzz target exercises.
type nullDevice struct {
	queues int
	config []byte
}

func (d *nullDevice) Features() uint64 { return 0 }
func (d *nullDevice) NumQueues() int   { return d.queues }
func (d *nullDevice) ReadConfig(offset uint32, p []byte) {
	if offset < uint32(len(d.config)) {
		copy(p, d.config[offset:])
	}
}
func (d *nullDevice) RunQueue(q *Queue) { <-q.Done() }
func (d *nullDevice) Disconnect()       {}

// FuzzMessage feeds arbitrary bytes (one or more messages, headers and
// payloads alike) to a session over a socketpair. The session must never
// panic, must end when the input ends, and every reply must be well formed.
func FuzzMessage(f *testing.F) {
	msg := func(req Request, flags uint32, payload []byte) []byte {
		b := make([]byte, HeaderSize)
		EncodeHeader(b, Header{Req: req, Flags: flags, Size: uint32(len(payload))})
		return append(b, payload...)
	}
	cat := func(ms ...[]byte) []byte { return bytes.Join(ms, nil) }
	cfg := func(off, size uint32) []byte {
		b := binary.LittleEndian.AppendUint32(nil, off)
		b = binary.LittleEndian.AppendUint32(b, size)
		b = binary.LittleEndian.AppendUint32(b, 0)
		return append(b, make([]byte, size)...)
	}
	v, nr := uint32(FlagVersion), uint32(FlagVersion|FlagNeedReply)
	handshake := cat(
		msg(ReqGetFeatures, v, nil),
		msg(ReqGetProtocolFeatures, v, nil),
		msg(ReqSetProtocolFeatures, nr, le64b(OfferedProtocolFeatures)),
		msg(ReqSetOwner, nr, nil),
	)
	f.Add(handshake)
	f.Add(cat(handshake, msg(ReqGetQueueNum, v, nil), msg(ReqGetConfig, v, cfg(0, 60))))
	f.Add(cat(handshake, msg(ReqGetConfig, v, cfg(250, 6)), msg(ReqSetConfig, nr, cfg(0, 4))))
	f.Add(cat(handshake, msg(ReqSetVringNum, nr, state(0, 256)), msg(ReqSetVringBase, nr, state(0, 7)),
		msg(ReqSetVringAddr, nr, make([]byte, 40)), msg(ReqSetVringEnable, nr, state(0, 1)),
		msg(ReqGetVringBase, v, state(0, 0))))
	f.Add(cat(handshake, msg(ReqSetVringCall, nr, le64b(VringNoFd)), msg(ReqSetVringKick, nr, le64b(VringNoFd))))
	f.Add(msg(ReqSetMemTable, v, make([]byte, 40)))
	f.Add(msg(ReqGetFeatures, v|FlagReply, nil))
	f.Add(msg(99, v, nil))
	f.Add([]byte{1, 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0, 0})
	f.Add(msg(ReqSetFeatures, v, le64b(1<<FeatProtocolFeatures|1<<FeatVersion1)))

	srv, err := newServer(&nullDevice{queues: 2, config: make([]byte, 60)}, Options{})
	if err != nil {
		f.Fatal(err)
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		ours := socketConn(t, fds[0])
		peer := socketConn(t, fds[1])
		defer peer.Close()

		done := make(chan error, 1)
		go func() {
			s := newSession(srv, ours)
			err := s.serve()
			s.teardown()
			ours.Close()
			done <- err
		}()
		go func() {
			peer.Write(data)
			peer.CloseWrite()
		}()
		// Replies must be well-formed headers with bounded payloads, and
		// the session must hang up once the input ends.
		peer.SetReadDeadline(time.Now().Add(feWait))
		for {
			var hb [HeaderSize]byte
			if _, err := io.ReadFull(peer, hb[:]); errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("session neither replied nor hung up within %v of the input being sent", feWait)
			} else if err != nil {
				break
			}
			h := DecodeHeader(hb[:])
			if h.Flags != FlagVersion|FlagReply || h.Size > MaxPayload {
				t.Fatalf("bad reply header %+v", h)
			}
			if _, err := io.CopyN(io.Discard, peer, int64(h.Size)); err != nil {
				t.Fatalf("truncated reply: %v", err)
			}
		}
		select {
		case <-done:
		case <-time.After(feWait):
			t.Fatalf("session did not end within %v of the input ending", feWait)
		}
	})
}

func socketConn(t *testing.T, fd int) *net.UnixConn {
	file := os.NewFile(uintptr(fd), "socketpair")
	c, err := net.FileConn(file)
	file.Close()
	if err != nil {
		t.Fatal(err)
	}
	return c.(*net.UnixConn)
}
