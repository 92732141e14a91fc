package vhostuser

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/overlay"
)

// FuzzMessage feeds arbitrary bytes (one or more messages, headers and
// payloads alike) to a session over a socketpair. The session must never
// panic, must end when the input ends, and every reply must be well formed.
func FuzzMessage(f *testing.F) {
	msg := func(req request, flags uint32, payload []byte) []byte {
		b := make([]byte, headerSize)
		encodeHeader(b, header{req: req, flags: flags, size: uint32(len(payload))})
		return append(b, payload...)
	}
	cat := func(ms ...[]byte) []byte { return bytes.Join(ms, nil) }
	cfg := func(off, size uint32) []byte {
		b := binary.LittleEndian.AppendUint32(nil, off)
		b = binary.LittleEndian.AppendUint32(b, size)
		b = binary.LittleEndian.AppendUint32(b, 0)
		return append(b, make([]byte, size)...)
	}
	v, nr := uint32(flagVersion), uint32(flagVersion|flagNeedReply)
	handshake := cat(
		msg(reqGetFeatures, v, nil),
		msg(reqGetProtocolFeatures, v, nil),
		msg(reqSetProtocolFeatures, nr, le64b(offeredProtocolFeatures)),
		msg(reqSetOwner, nr, nil),
	)
	f.Add(handshake)
	f.Add(cat(handshake, msg(reqGetQueueNum, v, nil), msg(reqGetConfig, v, cfg(0, 60))))
	f.Add(cat(handshake, msg(reqGetConfig, v, cfg(250, 6)), msg(reqSetConfig, nr, cfg(0, 4))))
	f.Add(cat(handshake, msg(reqSetVringNum, nr, state(0, 256)), msg(reqSetVringBase, nr, state(0, 7)),
		msg(reqSetVringAddr, nr, make([]byte, 40)), msg(reqSetVringEnable, nr, state(0, 1)),
		msg(reqGetVringBase, v, state(0, 0))))
	f.Add(cat(handshake, msg(reqSetVringCall, nr, le64b(vringNoFd)), msg(reqSetVringKick, nr, le64b(vringNoFd))))
	f.Add(msg(reqSetMemTable, v, make([]byte, 40)))
	f.Add(msg(reqGetFeatures, v|flagReply, nil))
	f.Add(msg(99, v, nil))
	f.Add([]byte{1, 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0, 0})
	f.Add(msg(reqSetFeatures, v, le64b(1<<featProtocol|1<<featVersion1)))

	dir := f.TempDir()
	base := make([]byte, 1<<20)
	dev, err := overlay.Open(bytes.NewReader(base), int64(len(base)), filepath.Join(dir, "ov"), overlay.Options{})
	if err != nil {
		f.Fatal(err)
	}
	opts := Options{NumQueues: 2}
	bcfg, err := buildConfig(dev, &opts)
	if err != nil {
		f.Fatal(err)
	}
	srv := &Server{dev: dev, cfg: bcfg, opts: opts}

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
			var hb [headerSize]byte
			if _, err := io.ReadFull(peer, hb[:]); errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("session neither replied nor hung up within %v of the input being sent", feWait)
			} else if err != nil {
				break
			}
			h := decodeHeader(hb[:])
			if h.flags != flagVersion|flagReply || h.size > maxPayload {
				t.Fatalf("bad reply header %+v", h)
			}
			if _, err := io.CopyN(io.Discard, peer, int64(h.size)); err != nil {
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
