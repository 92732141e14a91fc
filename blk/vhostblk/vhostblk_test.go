package vhostblk

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

const testSerial = "kata-fsx-test-disk"

// The overlay is the device the runtime serves.
var _ BlockDevice = (*overlay.Device)(nil)

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 99))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

type testEnv struct {
	srv  *Server
	dev  *overlay.Device
	base []byte
	sock string
}

// newEnv serves an overlay over a random base: a real copy-on-write device.
func newEnv(t testing.TB, size int, readOnly bool, opts Options) *testEnv {
	t.Helper()
	base := randomBytes(uint64(size), size)
	dir := t.TempDir()
	ovPath := filepath.Join(dir, "overlay")
	if readOnly {
		ovPath = ""
	}
	dev, err := overlay.Open(bytes.NewReader(base), int64(size), ovPath, overlay.Options{ReadOnly: readOnly, Serial: testSerial})
	if err != nil {
		t.Fatal(err)
	}
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	sock := filepath.Join(dir, "vu", "blk.sock")
	srv, err := Serve(context.Background(), sock, dev, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
		dev.Close()
	})
	return &testEnv{srv: srv, dev: dev, base: base, sock: sock}
}

// connect dials, negotiates, shares memory and starts queue 0.
func (e *testEnv) connect(t testing.TB, clearFeat uint64) (*vhostusertest.Frontend, *testQueue) {
	f := vhostusertest.Dial(t, e.sock)
	f.Negotiate(clearFeat)
	f.SetupMemory()
	return f, startQueue(t, f, 0, 128)
}

func TestBlockRequests(t *testing.T) {
	for _, indirect := range []bool{false, true} {
		name := "direct"
		if indirect {
			name = "indirect"
		}
		t.Run(name, func(t *testing.T) {
			env := newEnv(t, 4<<20, false, Options{})
			_, q := env.connect(t, 0)
			q.Indirect = indirect

			// Read of untouched disk returns the base.
			st, in, n := q.blkReq(blkTypeIn, 16, nil, 8192)
			if st != blkStatusOK || n != 8193 || !bytes.Equal(in, env.base[16*512:16*512+8192]) {
				t.Fatalf("read base: status %d used %d match %v", st, n, bytes.Equal(in, env.base[16*512:16*512+8192]))
			}
			// Write then read back, including a 512-byte write inside a 4 KiB block.
			data := randomBytes(5, 12288)
			if st, _, n := q.blkReq(blkTypeOut, 8, data, 0); st != blkStatusOK || n != 1 {
				t.Fatalf("write: status %d used %d", st, n)
			}
			small := bytes.Repeat([]byte{0x42}, 512)
			if st, _, _ := q.blkReq(blkTypeOut, 3, small, 0); st != blkStatusOK {
				t.Fatalf("small write: %d", st)
			}
			st, in, _ = q.blkReq(blkTypeIn, 0, nil, 8*512+12288)
			want := append(bytes.Clone(env.base[:8*512]), data...)
			copy(want[3*512:], small)
			if st != blkStatusOK || !bytes.Equal(in, want) {
				t.Fatalf("read back: status %d", st)
			}
			if st, _, n := q.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK || n != 1 {
				t.Fatalf("flush: status %d used %d", st, n)
			}
			st, in, n = q.blkReq(blkTypeGetID, 0, nil, 20)
			wantID := make([]byte, 20)
			copy(wantID, testSerial)
			if st != blkStatusOK || n != 21 || !bytes.Equal(in, wantID) {
				t.Fatalf("get id: status %d used %d id %q", st, n, in)
			}

			seg := func(sector uint64, num, flags uint32) []byte {
				b := binary.LittleEndian.AppendUint64(nil, sector)
				b = binary.LittleEndian.AppendUint32(b, num)
				return binary.LittleEndian.AppendUint32(b, flags)
			}
			// Discard 8 sectors of base data, write-zeroes (with and without unmap) over written data.
			if st, _, _ := q.blkReq(blkTypeDiscard, 0, seg(64, 8, 0), 0); st != blkStatusOK {
				t.Fatalf("discard: %d", st)
			}
			if st, _, _ := q.blkReq(blkTypeWriteZeroes, 0, seg(8, 8, blkFlagUnmap), 0); st != blkStatusOK {
				t.Fatalf("write zeroes unmap: %d", st)
			}
			if st, _, _ := q.blkReq(blkTypeWriteZeroes, 0, append(seg(17, 3, 0), seg(100, 1, 0)...), 0); st != blkStatusOK {
				t.Fatalf("write zeroes (two segments): %d", st)
			}
			st, in, _ = q.blkReq(blkTypeIn, 0, nil, 128*512)
			want = append(want, env.base[len(want):128*512]...)
			clear(want[64*512 : 72*512])
			clear(want[8*512 : 16*512])
			clear(want[17*512 : 20*512])
			clear(want[100*512 : 101*512])
			if st != blkStatusOK || !bytes.Equal(in, want) {
				t.Fatalf("read after discard/zeroes: status %d", st)
			}

			// Unsupported types.
			for _, typ := range []uint32{10, 14, 99, 0xffffffff} {
				if st, _, n := q.blkReq(typ, 0, nil, 0); st != blkStatusUnsupp || n != 1 {
					t.Fatalf("type %d: status %d used %d", typ, st, n)
				}
			}
		})
	}
}

// TestSegmentedWrites writes requests whose data spans many descriptors,
// at unaligned segment boundaries and with partial blocks at both ends,
// and reads them back.
func TestSegmentedWrites(t *testing.T) {
	for _, indirect := range []bool{false, true} {
		for _, share := range []bool{false, true} {
			t.Run(fmt.Sprintf("indirect=%t/shared-header=%t", indirect, share), func(t *testing.T) {
				env := newEnv(t, 4<<20, false, Options{})
				_, q := env.connect(t, 0)
				q.Indirect = indirect
				want := bytes.Clone(env.base[:1<<20])
				cases := []struct {
					sector uint64
					sizes  []int
				}{
					{0, []int{4096, 4096, 4096, 4096}},       // whole blocks, page-sized pieces
					{64, []int{1000, 3096, 8192, 512, 3584}}, // whole blocks, unaligned pieces
					{3, []int{512, 4096, 1, 2047, 2048}},     // partial block at both ends
					{1001, []int{9 * 512}},                   // one piece, partial at both ends
					{200, make([]int, 30)},                   // 30 x 4 KiB, over the lock units
				}
				cases[4].sizes = cases[4].sizes[:0]
				for range 30 {
					cases[4].sizes = append(cases[4].sizes, 4096)
				}
				for i, c := range cases {
					var segs [][]byte
					off := int(c.sector) * 512
					for k, n := range c.sizes {
						seg := randomBytes(uint64(100*i+k), n)
						segs = append(segs, seg)
						copy(want[off:], seg)
						off += n
					}
					p := q.prepareWrite(c.sector, segs, share)
					q.Kick()
					if id, n := q.WaitUsed(); id != uint32(p.head) || n != 1 {
						t.Fatalf("case %d: used id %d len %d, want head %d len 1", i, id, n, p.head)
					}
					if st, _ := q.result(p); st != blkStatusOK {
						t.Fatalf("case %d: status %d", i, st)
					}
				}
				var in []byte
				for sector := uint64(0); sector < 2048; sector += 128 {
					st, part, _ := q.blkReq(blkTypeIn, sector, nil, 128*512)
					if st != blkStatusOK {
						t.Fatalf("read back at sector %d: status %d", sector, st)
					}
					in = append(in, part...)
				}
				for i := range in {
					if in[i] != want[i] {
						t.Fatalf("read back: first difference at byte %d (sector %d)", i, i/512)
					}
				}
			})
		}
	}
}

// plainDevice hides the overlay's vectored methods: the server then reads
// and writes one guest buffer at a time, as it does for any BlockDevice.
type plainDevice struct{ BlockDevice }

// TestSegmentedReads reads into chains of many writable buffers, the
// status byte in its own descriptor or at the end of the last data one,
// through the vectored path and through the one-buffer-at-a-time path.
func TestSegmentedReads(t *testing.T) {
	for _, vectored := range []bool{true, false} {
		for _, shareStatus := range []bool{false, true} {
			t.Run(fmt.Sprintf("vectored=%t/shared-status=%t", vectored, shareStatus), func(t *testing.T) {
				env := newEnv(t, 4<<20, false, Options{})
				// Some dirty blocks, so a read crosses overlay and base runs.
				for _, b := range []int64{2, 3, 9} {
					p := randomBytes(uint64(b), 4096)
					if _, err := env.dev.WriteAt(p, b*4096); err != nil {
						t.Fatal(err)
					}
				}
				want := make([]byte, 64<<10)
				if _, err := env.dev.ReadAt(want, 0); err != nil {
					t.Fatal(err)
				}
				if !vectored {
					sock := filepath.Join(t.TempDir(), "vu", "plain.sock")
					srv, err := Serve(context.Background(), sock, plainDevice{env.dev}, Options{Logf: t.Logf})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { srv.Close() })
					env = &testEnv{srv: srv, dev: env.dev, base: env.base, sock: sock}
				}
				_, q := env.connect(t, 0)
				for i, sizes := range [][]int{
					{4096, 4096, 4096, 4096},
					{512, 3584, 1024, 7168, 512},
					{4096, 0, 8192, 4096},
					{16 << 10, 16 << 10, 16 << 10, 16 << 10},
				} {
					hdr := make([]byte, 16)
					binary.LittleEndian.PutUint32(hdr[0:], blkTypeIn)
					ha := q.Alloc(16, 16)
					q.Drv.Write(ha, hdr)
					bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
					var addrs []uint64
					total := 0
					for k, n := range sizes {
						l := n
						if shareStatus && k == len(sizes)-1 {
							l++
						}
						if l == 0 {
							continue
						}
						a := q.Alloc(uint64(l), 8)
						q.Drv.Write(a, bytes.Repeat([]byte{0xEE}, l))
						bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(l), Write: true})
						addrs = append(addrs, a)
						total += n
					}
					sa := addrs[len(addrs)-1] + uint64(sizes[len(sizes)-1])
					if !shareStatus {
						sa = q.Alloc(1, 1)
						bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
					}
					q.Drv.Write(sa, []byte{0xFF})
					head := q.Publish(bufs)
					q.Kick()
					if id, n := q.WaitUsed(); id != uint32(head) || n != uint32(total+1) {
						t.Fatalf("case %d: used id %d len %d, want head %d len %d", i, id, n, head, total+1)
					}
					if st := q.Drv.Read(sa, 1)[0]; st != blkStatusOK {
						t.Fatalf("case %d: status %d", i, st)
					}
					var got []byte
					k := 0
					for _, n := range sizes {
						if n == 0 {
							continue
						}
						got = append(got, q.Drv.Read(addrs[k], n)...)
						k++
					}
					if !bytes.Equal(got, want[:total]) {
						t.Fatalf("case %d: data differs from the device's", i)
					}
				}
			})
		}
	}
}

// serveHeld serves dev, a wrapper of e's device whose requests wait on
// held, in place of e's server; release lets them go (and cleanup does,
// if the test did not).
func (e *testEnv) serveHeld(t *testing.T, dev BlockDevice, held chan struct{}) (*testEnv, func()) {
	sock := filepath.Join(t.TempDir(), "vu", "held.sock")
	srv, err := Serve(context.Background(), sock, dev, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(func() {
		release()
		srv.Close()
	})
	return &testEnv{srv: srv, dev: e.dev, base: e.base, sock: sock}, release
}

// slowFlush is a device whose Flush waits until release is closed.
type slowFlush struct {
	BlockDevice
	entered chan struct{}
	release chan struct{}
}

func (d *slowFlush) Flush() error {
	close(d.entered)
	<-d.release
	return d.BlockDevice.Flush()
}

// TestSlowRequestDoesNotHoldOthers checks that requests complete one by
// one: a read submitted after a flush that is still running comes back
// first, and the flush when it ends.
func TestSlowRequestDoesNotHoldOthers(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	dev := &slowFlush{BlockDevice: env.dev, entered: make(chan struct{}), release: make(chan struct{})}
	env, release := env.serveHeld(t, dev, dev.release)
	_, q := env.connect(t, 0)
	flush := q.prepare(blkTypeFlush, 0, nil, 0)
	q.Kick()
	select {
	case <-dev.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("flush never reached the device")
	}
	read := q.prepare(blkTypeIn, 8, nil, 4096)
	q.Kick()
	if id, _ := q.WaitUsed(); id != uint32(read.head) {
		t.Fatalf("first completion is head %d, want the read (%d) while the flush (%d) runs", id, read.head, flush.head)
	}
	if st, in := q.result(read); st != blkStatusOK || !bytes.Equal(in, env.base[8*512:8*512+4096]) {
		t.Fatalf("read during the flush: status %d", st)
	}
	release()
	if id, _ := q.WaitUsed(); id != uint32(flush.head) {
		t.Fatalf("second completion is head %d, want the flush (%d)", id, flush.head)
	}
	if st, _ := q.result(flush); st != blkStatusOK {
		t.Fatalf("flush status %d", st)
	}
}

func TestMalformedRequests(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{SegMax: 4, MaxRequestBytes: 64 << 10})
	_, q := env.connect(t, 0)
	capSectors := uint64(1 << 20 / 512)

	check := func(what string, st byte, wantSt byte) {
		t.Helper()
		if st != wantSt {
			t.Errorf("%s: status %d, want %d", what, st, wantSt)
		}
	}
	st, _, _ := q.blkReq(blkTypeIn, capSectors, nil, 512)
	check("read at capacity", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeIn, capSectors-1, nil, 1024)
	check("read across the end", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeIn, 1<<62, nil, 512)
	check("read at huge sector", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeOut, capSectors-1, make([]byte, 1024), 0)
	check("write across the end", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeIn, 0, nil, 100)
	check("read of 100 bytes", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeOut, 0, make([]byte, 700), 0)
	check("write of 700 bytes", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeIn, 0, nil, 128<<10)
	check("oversized read", st, blkStatusIOErr)
	st, _, _ = q.blkReq(blkTypeDiscard, 0, make([]byte, 20), 0)
	check("discard payload not a multiple of 16", st, blkStatusIOErr)
	seg := binary.LittleEndian.AppendUint64(nil, 0)
	seg = binary.LittleEndian.AppendUint32(seg, 8)
	st, _, _ = q.blkReq(blkTypeDiscard, 0, binary.LittleEndian.AppendUint32(bytes.Clone(seg), blkFlagUnmap), 0)
	check("discard with unmap flag", st, blkStatusUnsupp)
	st, _, _ = q.blkReq(blkTypeWriteZeroes, 0, binary.LittleEndian.AppendUint32(bytes.Clone(seg), 2), 0)
	check("write zeroes with reserved flag", st, blkStatusUnsupp)
	over := binary.LittleEndian.AppendUint64(nil, capSectors-4)
	over = binary.LittleEndian.AppendUint32(over, 8)
	st, _, _ = q.blkReq(blkTypeWriteZeroes, 0, binary.LittleEndian.AppendUint32(over, 0), 0)
	check("write zeroes past the end", st, blkStatusIOErr)

	// Header too short: 8 readable bytes, then status.
	ha := q.Alloc(8, 8)
	sa := q.Alloc(1, 1)
	q.Drv.Write(sa, []byte{0xff})
	p := pendingReq{head: q.Publish([]testdriver.Buf{{Addr: ha, Len: 8}, {Addr: sa, Len: 1, Write: true}}), statusAddr: sa}
	q.Kick()
	if _, n := q.WaitUsed(); n != 1 {
		t.Errorf("short header: used %d", n)
	}
	st, _ = q.result(p)
	check("short header", st, blkStatusIOErr)

	// Too many segments: 6 data descriptors with seg_max 4.
	hdr := make([]byte, 16)
	ha = q.Alloc(16, 16)
	q.Drv.Write(ha, hdr)
	bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
	for range 6 {
		bufs = append(bufs, testdriver.Buf{Addr: q.Alloc(512, 512), Len: 512, Write: true})
	}
	sa = q.Alloc(1, 1)
	bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
	p = pendingReq{head: q.Publish(bufs), statusAddr: sa}
	q.Kick()
	q.WaitUsed()
	st, _ = q.result(p)
	check("too many segments", st, blkStatusIOErr)

	// No status byte: nothing writable; returned with used length 0.
	q.Publish([]testdriver.Buf{{Addr: ha, Len: 16}})
	q.Kick()
	if _, n := q.WaitUsed(); n != 0 {
		t.Errorf("no status byte: used %d", n)
	}

	// Descriptor outside guest memory: returned with length 0, queue still works.
	q.Publish([]testdriver.Buf{{Addr: ha, Len: 16}, {Addr: 0x7000000000, Len: 512, Write: true}, {Addr: sa, Len: 1, Write: true}})
	q.Kick()
	if _, n := q.WaitUsed(); n != 0 {
		t.Errorf("out-of-range descriptor: used %d", n)
	}
	// Looping chain.
	q.Drv.SetDesc(q.Drv.DescAddr, 100, ha, 16, 1, 101)
	q.Drv.SetDesc(q.Drv.DescAddr, 101, ha, 16, 1, 100)
	q.Drv.Publish(100)
	q.Kick()
	if id, n := q.WaitUsed(); id != 100 || n != 0 {
		t.Errorf("looping chain: used %d/%d", id, n)
	}
	if st, _, _ := q.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK {
		t.Fatalf("queue unusable after bad chains: %d", st)
	}

	// A head index out of range breaks the queue and signals the err eventfd.
	q.Drv.Publish(1000)
	q.Kick()
	fds := []unix.PollFd{{Fd: int32(q.ErrFd), Events: unix.POLLIN}}
	if n, err := unix.Poll(fds, int(feWait/time.Millisecond)); n != 1 || err != nil {
		t.Fatalf("err eventfd not signalled: %d %v", n, err)
	}
	// GET_VRING_BASE still answers and reports how far the queue got (the
	// corrupt entry is not consumed).
	b := q.F.Get(vhostuser.ReqGetVringBase, vhostusertest.State(0, 0))
	if idx, base := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:]); idx != 0 || base != uint32(q.Drv.UsedIdx()) {
		t.Errorf("GET_VRING_BASE = %d/%d, used idx %d", idx, base, q.Drv.UsedIdx())
	}
}

func TestEventIdx(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	f, q := env.connect(t, 0)
	if f.Feat&(1<<vhostuser.FeatEventIdx) == 0 {
		t.Fatal("EVENT_IDX not negotiated")
	}
	readCall := func() uint64 {
		var b [8]byte
		if n, err := unix.Read(q.CallFd, b[:]); n != 8 || err != nil {
			return 0
		}
		return binary.LittleEndian.Uint64(b[:])
	}
	// First completion always interrupts.
	q.blkReq(blkTypeFlush, 0, nil, 0)
	readCall()
	// The worker publishes avail_event when it re-enables notifications,
	// just after the used element: wait for it.
	eventually(t, "avail_event 1 after one request", func() bool { return q.Drv.AvailEvent() == 1 })
	// used_event 2: completing the 2nd request (used idx -> 2) must not interrupt...
	q.Drv.SetUsedEvent(2)
	p := q.prepare(blkTypeFlush, 0, nil, 0)
	q.Kick()
	eventually(t, "second request completed", func() bool { return q.Drv.UsedIdx() == 2 })
	q.waitUsedNoPoll(t, p.head)
	// ...the 3rd (used idx -> 3, passing used_event) must.
	p = q.prepare(blkTypeFlush, 0, nil, 0)
	q.Kick()
	fds := []unix.PollFd{{Fd: int32(q.CallFd), Events: unix.POLLIN}}
	if n, err := unix.Poll(fds, int(feWait/time.Millisecond)); n != 1 || err != nil {
		t.Fatalf("no interrupt after passing used_event: %d %v", n, err)
	}
	if c := readCall(); c != 1 {
		t.Fatalf("call eventfd counted %d interrupts for two completions, want 1 (the 2nd must be suppressed)", c)
	}
	q.waitUsedNoPoll(t, p.head)
	eventually(t, "avail_event 3 after three requests", func() bool { return q.Drv.AvailEvent() == 3 })
}

// eventually waits (bounded by feWait) for a condition the device makes
// true asynchronously; it asserts an outcome, not a duration.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, feWait, func() (bool, error) {
		return cond(), fmt.Errorf("never reached: %s", what)
	})
}

// waitUsedNoPoll consumes the next used element, which must already be there.
func (q *testQueue) waitUsedNoPoll(t *testing.T, head uint16) {
	t.Helper()
	id, _, ok := q.Drv.Used()
	if !ok || id != uint32(head) {
		t.Fatalf("used element %d %v, want head %d", id, ok, head)
	}
}

func TestMultiQueue(t *testing.T) {
	env := newEnv(t, 4<<20, false, Options{NumQueues: 2})
	f := vhostusertest.Dial(t, env.sock)
	f.Negotiate(0)
	if n := binary.LittleEndian.Uint64(f.Get(vhostuser.ReqGetQueueNum, nil)); n != 2 {
		t.Fatalf("GET_QUEUE_NUM = %d", n)
	}
	f.SetupMemory()
	qs := []*testQueue{startQueue(t, f, 0, 128), startQueue(t, f, 1, 128)}
	const rounds, batch = 8, 16
	want := make(map[uint64][]byte)
	for r := range rounds {
		var pend [2][]pendingReq
		for i, q := range qs {
			for k := range batch {
				sector := uint64(i*2048 + (r*batch+k)*8)
				data := randomBytes(sector+1, 4096)
				want[sector] = data
				pend[i] = append(pend[i], q.prepare(blkTypeOut, sector, data, 0))
			}
		}
		qs[0].Kick()
		qs[1].Kick()
		for i, q := range qs {
			for range pend[i] {
				q.WaitUsed()
			}
			for _, p := range pend[i] {
				if st, _ := q.result(p); st != blkStatusOK {
					t.Fatalf("queue %d write: %d", i, st)
				}
			}
		}
	}
	// Read everything back through both queues at once.
	var pend [2][]pendingReq
	var sectors [2][]uint64
	for i, q := range qs {
		for k := range batch {
			s := uint64(i*2048 + k*8*rounds/2)
			s -= s % 8
			sectors[i] = append(sectors[i], s)
			pend[i] = append(pend[i], q.prepare(blkTypeIn, s, nil, 4096))
		}
	}
	qs[0].Kick()
	qs[1].Kick()
	for i, q := range qs {
		for range pend[i] {
			q.WaitUsed()
		}
		for k, p := range pend[i] {
			st, in := q.result(p)
			w, ok := want[sectors[i][k]]
			if !ok {
				w = env.base[sectors[i][k]*512 : sectors[i][k]*512+4096]
			}
			if st != blkStatusOK || !bytes.Equal(in, w) {
				t.Fatalf("queue %d sector %d: status %d, data match %v", i, sectors[i][k], st, bytes.Equal(in, w))
			}
		}
	}
}

func TestConfigAndQueries(t *testing.T) {
	env := newEnv(t, 8<<20, false, Options{NumQueues: 3, SegMax: 60})
	f := vhostusertest.Dial(t, env.sock)
	f.Negotiate(0)
	cfgReq := func(off, size uint32) []byte {
		b := binary.LittleEndian.AppendUint32(nil, off)
		b = binary.LittleEndian.AppendUint32(b, size)
		b = binary.LittleEndian.AppendUint32(b, 0)
		return append(b, make([]byte, size)...)
	}
	p := f.Get(vhostuser.ReqGetConfig, cfgReq(0, 60))
	if len(p) != 72 || binary.LittleEndian.Uint32(p[4:]) != 60 {
		t.Fatalf("GET_CONFIG reply of %d bytes", len(p))
	}
	c := p[12:]
	le := binary.LittleEndian
	if got := le.Uint64(c[0:]); got != 8<<20/512 {
		t.Errorf("capacity %d", got)
	}
	if got := le.Uint32(c[12:]); got != 60 {
		t.Errorf("seg_max %d", got)
	}
	if got := le.Uint32(c[20:]); got != 512 {
		t.Errorf("blk_size %d", got)
	}
	if got := le.Uint16(c[34:]); got != 3 {
		t.Errorf("num_queues %d", got)
	}
	if le.Uint32(c[36:]) == 0 || le.Uint32(c[40:]) == 0 || le.Uint32(c[44:]) != 8 || le.Uint32(c[48:]) == 0 || le.Uint32(c[52:]) == 0 || c[56] != 1 {
		t.Errorf("discard/write-zeroes fields %x", c[36:60])
	}
	// A window in the middle.
	p = f.Get(vhostuser.ReqGetConfig, cfgReq(12, 4))
	if len(p) != 16 || le.Uint32(p[12:]) != 60 {
		t.Errorf("windowed GET_CONFIG = %x", p)
	}
	if n := le.Uint64(f.Get(vhostuser.ReqGetQueueNum, nil)); n != 3 {
		t.Errorf("GET_QUEUE_NUM = %d", n)
	}
	// SET_CONFIG is refused with a nack; the connection survives.
	if v := f.Set(vhostuser.ReqSetConfig, cfgReq(32, 1)); v == 0 {
		t.Error("SET_CONFIG acked")
	}
	// RESET_OWNER is ignored.
	f.MustSet(vhostuser.ReqResetOwner, nil)
	if f.Get(vhostuser.ReqGetFeatures, nil) == nil {
		t.Fatal("connection lost")
	}
	feat := le.Uint64(f.Get(vhostuser.ReqGetFeatures, nil))
	for _, b := range []int{vhostuser.FeatVersion1, vhostuser.FeatIndirectDesc, vhostuser.FeatEventIdx, vhostuser.FeatProtocolFeatures, featBlkSegMax, featBlkBlkSize, featBlkFlush, featBlkMQ, featBlkDiscard, featBlkWriteZeroes} {
		if feat&(1<<b) == 0 {
			t.Errorf("feature bit %d not offered", b)
		}
	}
	if feat&(1<<featBlkRO) != 0 {
		t.Error("RO offered on a writable device")
	}
}

func TestReadOnly(t *testing.T) {
	env := newEnv(t, 1<<20, true, Options{})
	f := vhostusertest.Dial(t, env.sock)
	feat := f.Negotiate(0)
	if feat&(1<<featBlkRO) == 0 || feat&(1<<featBlkDiscard) != 0 || feat&(1<<featBlkWriteZeroes) != 0 {
		t.Fatalf("read-only features %#x", feat)
	}
	f.SetupMemory()
	q := startQueue(t, f, 0, 64)
	if st, _, _ := q.blkReq(blkTypeOut, 0, make([]byte, 512), 0); st != blkStatusIOErr {
		t.Errorf("write on read-only: %d", st)
	}
	seg := make([]byte, 16)
	binary.LittleEndian.PutUint32(seg[8:], 8)
	if st, _, _ := q.blkReq(blkTypeDiscard, 0, seg, 0); st != blkStatusIOErr {
		t.Errorf("discard on read-only: %d", st)
	}
	st, in, _ := q.blkReq(blkTypeIn, 0, nil, 4096)
	if st != blkStatusOK || !bytes.Equal(in, env.base[:4096]) {
		t.Errorf("read on read-only: %d", st)
	}
	if st, _, _ := q.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK {
		t.Errorf("flush on read-only: %d", st)
	}
}

func TestReconnectAndVringBase(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	f, q := env.connect(t, 0)
	data := randomBytes(9, 8192)
	if st, _, _ := q.blkReq(blkTypeOut, 40, data, 0); st != blkStatusOK {
		t.Fatal(st)
	}
	// Stop and restart the ring: GET_VRING_BASE reports the consumed index.
	b := f.Get(vhostuser.ReqGetVringBase, vhostusertest.State(0, 0))
	if base := binary.LittleEndian.Uint32(b[4:]); base != 1 {
		t.Fatalf("GET_VRING_BASE = %d, want 1", base)
	}
	f.MustSet(vhostuser.ReqSetVringBase, vhostusertest.State(0, 1))
	f.MustSet(vhostuser.ReqSetVringKick, vhostusertest.Le64(0), q.KickFd)
	if st, _, _ := q.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK {
		t.Fatal("restarted queue does not work")
	}

	// Disconnect mid-stream: publish requests and hang up without waiting.
	for i := range 4 {
		q.prepare(blkTypeOut, uint64(100+8*i), data[:4096], 0)
	}
	q.Kick()
	f.Close()
	if _, err := env.srv.WaitStats(ctxT(t), func(s Stats) bool { return s.Disconnects >= 1 }); err != nil {
		t.Fatal(err)
	}

	f2, q2 := env.connect(t, 0)
	_ = f2
	st, in, _ := q2.blkReq(blkTypeIn, 40, nil, 8192)
	if st != blkStatusOK || !bytes.Equal(in, data) {
		t.Fatalf("data lost across reconnect: status %d", st)
	}
	if s := env.srv.Stats(); s.Connections != 2 || s.LastError != nil {
		t.Fatalf("stats %+v", s)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), feWait)
	t.Cleanup(cancel)
	return ctx
}

func openFds(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestMalformedMessages(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	hdr := func(req vhostuser.Request, flags, size uint32) []byte {
		b := make([]byte, vhostuser.HeaderSize)
		vhostuser.EncodeHeader(b, vhostuser.Header{Req: req, Flags: flags, Size: size})
		return b
	}
	msg := func(req vhostuser.Request, flags uint32, payload []byte) []byte {
		return append(hdr(req, flags, uint32(len(payload))), payload...)
	}
	efd := func() int {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	memTable := func(n uint32) []byte {
		b := binary.LittleEndian.AppendUint32(nil, n)
		b = binary.LittleEndian.AppendUint32(b, 0)
		for i := range n {
			for _, v := range []uint64{uint64(i) << 20, 1 << 20, 0x7f0000000000 + uint64(i)<<30, 0} {
				b = binary.LittleEndian.AppendUint64(b, v)
			}
		}
		return b
	}
	cases := []struct {
		name      string
		negotiate bool
		raw       []byte
		nfds      int
		closeW    bool
	}{
		{name: "bad version", raw: msg(vhostuser.ReqGetFeatures, 2, nil)},
		{name: "reply flag", raw: msg(vhostuser.ReqGetFeatures, vhostuser.FlagVersion|vhostuser.FlagReply, nil)},
		{name: "reserved flags", raw: msg(vhostuser.ReqGetFeatures, vhostuser.FlagVersion|0x100, nil)},
		{name: "unknown request", raw: msg(99, vhostuser.FlagVersion, nil)},
		{name: "request zero", raw: msg(0, vhostuser.FlagVersion, nil)},
		{name: "huge request number", raw: msg(0xffffffff, vhostuser.FlagVersion, nil)},
		{name: "size above 0x1000", raw: hdr(vhostuser.ReqSetFeatures, vhostuser.FlagVersion, 0x1001)},
		{name: "bad size", raw: msg(vhostuser.ReqSetFeatures, vhostuser.FlagVersion, make([]byte, 4))},
		{name: "payload on GET_FEATURES", raw: msg(vhostuser.ReqGetFeatures, vhostuser.FlagVersion, make([]byte, 8))},
		{name: "truncated payload", raw: append(hdr(vhostuser.ReqSetFeatures, vhostuser.FlagVersion, 8), 1, 2, 3, 4), closeW: true},
		{name: "truncated header", raw: []byte{1, 0, 0}, closeW: true},
		{name: "fd on GET_FEATURES", raw: msg(vhostuser.ReqGetFeatures, vhostuser.FlagVersion, nil), nfds: 1},
		{name: "kick without fd", raw: msg(vhostuser.ReqSetVringKick, vhostuser.FlagVersion, vhostusertest.Le64(0))},
		{name: "kick polling mode", raw: msg(vhostuser.ReqSetVringKick, vhostuser.FlagVersion, vhostusertest.Le64(vhostuser.VringNoFd))},
		{name: "call no-fd bit with fd", raw: msg(vhostuser.ReqSetVringCall, vhostuser.FlagVersion, vhostusertest.Le64(vhostuser.VringNoFd)), nfds: 1},
		{name: "call reserved bits", raw: msg(vhostuser.ReqSetVringCall, vhostuser.FlagVersion, vhostusertest.Le64(1<<20)), nfds: 1},
		{name: "mem table fd count", raw: msg(vhostuser.ReqSetMemTable, vhostuser.FlagVersion, memTable(2)), nfds: 1},
		{name: "mem table zero regions", raw: msg(vhostuser.ReqSetMemTable, vhostuser.FlagVersion, append(memTable(0), make([]byte, 32)...))},
		{name: "mem table size mismatch", raw: msg(vhostuser.ReqSetMemTable, vhostuser.FlagVersion, append(memTable(1), make([]byte, 32)...)), nfds: 1},
		{name: "too many fds", raw: msg(vhostuser.ReqSetMemTable, vhostuser.FlagVersion, memTable(8)), nfds: 9},
		{name: "mem table fd not mappable", raw: msg(vhostuser.ReqSetMemTable, vhostuser.FlagVersion, memTable(1)), nfds: 1},
		{name: "queue num before MQ", raw: msg(vhostuser.ReqGetQueueNum, vhostuser.FlagVersion, nil)},
		{name: "config before CONFIG", raw: msg(vhostuser.ReqGetConfig, vhostuser.FlagVersion, make([]byte, 12+4))},
		{name: "config window overflow", negotiate: true, raw: msg(vhostuser.ReqGetConfig, vhostuser.FlagVersion, append([]byte{0xfc, 0xff, 0xff, 0xff, 8, 0, 0, 0, 0, 0, 0, 0}, make([]byte, 8)...))},
		{name: "config declared size mismatch", negotiate: true, raw: msg(vhostuser.ReqGetConfig, vhostuser.FlagVersion, append([]byte{0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0}, make([]byte, 4)...))},
		{name: "unoffered features", raw: msg(vhostuser.ReqSetFeatures, vhostuser.FlagVersion, vhostusertest.Le64(1<<63))},
		{name: "unoffered protocol features", raw: msg(vhostuser.ReqSetProtocolFeatures, vhostuser.FlagVersion, vhostusertest.Le64(1<<5))},
		{name: "queue index out of range", raw: msg(vhostuser.ReqSetVringNum, vhostuser.FlagVersion, vhostusertest.State(200, 128))},
		{name: "queue size not power of two", raw: msg(vhostuser.ReqSetVringNum, vhostuser.FlagVersion, vhostusertest.State(0, 100))},
		{name: "queue size too large", raw: msg(vhostuser.ReqSetVringNum, vhostuser.FlagVersion, vhostusertest.State(0, 65536))},
		{name: "enable value", raw: msg(vhostuser.ReqSetVringEnable, vhostuser.FlagVersion, vhostusertest.State(0, 2))},
	}
	before := openFds(t)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := vhostusertest.Dial(t, env.sock)
			if c.negotiate {
				f.Negotiate(0)
				f.Proto = 0 // send the bad message without asking for an ack
			}
			var fds []int
			for range c.nfds {
				fds = append(fds, efd())
			}
			if err := f.SendRaw(c.raw, fds...); err != nil {
				t.Fatal(err)
			}
			for _, fd := range fds {
				unix.Close(fd)
			}
			if c.closeW {
				f.Conn.CloseWrite()
			}
			f.ExpectClosed()
			st, err := env.srv.WaitStats(ctxT(t), func(s Stats) bool { return s.Disconnects >= uint64(i+1) })
			if err != nil {
				t.Fatal(err)
			}
			if st.LastError == nil {
				t.Fatal("connection ended without an error")
			}
			t.Logf("server: %v", st.LastError)
		})
	}
	// Every descriptor the server received was closed.
	if after := openFds(t); after > before {
		t.Errorf("%d descriptors leaked", after-before)
	}
	// The server still accepts and works.
	_, q := env.connect(t, 0)
	if st, _, _ := q.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK {
		t.Fatal("server unusable after malformed messages")
	}
}

func TestSocketSetup(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	st, err := os.Stat(env.sock)
	if err != nil || st.Mode().Perm() != 0o600 || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket mode %v, %v", st.Mode(), err)
	}
	dst, _ := os.Stat(filepath.Dir(env.sock))
	if dst.Mode().Perm() != 0o700 {
		t.Fatalf("socket dir mode %v", dst.Mode())
	}
	dev := env.dev
	dir := t.TempDir()
	open := filepath.Join(dir, "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	if _, err := Serve(context.Background(), filepath.Join(open, "s"), dev, Options{}); err == nil {
		t.Error("world-writable socket directory accepted")
	}
	notSock := filepath.Join(dir, "file")
	os.WriteFile(notSock, nil, 0o600)
	if _, err := Serve(context.Background(), notSock, dev, Options{}); err == nil {
		t.Error("regular file at socket path replaced")
	}
	// A stale socket is replaced; context cancellation closes the server and removes the socket.
	ctx, cancel := context.WithCancel(context.Background())
	stale := filepath.Join(dir, "stale.sock")
	// A listener that leaves its socket behind, as a killed process does.
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	s2, err := Serve(ctx, stale, dev, Options{})
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	cancel()
	<-s2.Done()
	if _, err := os.Lstat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left behind after close: %v", err)
	}
}

func TestMemSlots(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	f := vhostusertest.Dial(t, env.sock)
	f.NegotiateProto(0, 1<<vhostuser.ProtoMemSlots)
	if n := binary.LittleEndian.Uint64(f.Get(vhostuser.ReqGetMaxMemSlots, nil)); n != vhostuser.MaxMemSlots {
		t.Fatalf("GET_MAX_MEM_SLOTS = %d", n)
	}
	enc := f.MakeRegions()
	reg := func(i int) []byte { return append(make([]byte, 8), enc[i]...) }
	f.MustSet(vhostuser.ReqAddMemReg, reg(0), f.Regions[0].FD)
	f.MustSet(vhostuser.ReqAddMemReg, reg(1), f.Regions[1].FD)
	q := startQueue(t, f, 0, 64)
	data := randomBytes(3, 8192)
	if st, _, _ := q.blkReq(blkTypeOut, 0, data, 0); st != blkStatusOK {
		t.Fatal("write after ADD_MEM_REG failed")
	}

	// Remove region 1 (QEMU attaches the fd; it must be closed, not kept).
	f.MustSet(vhostuser.ReqRemMemReg, reg(1), f.Regions[1].FD)
	hdr := make([]byte, 16) // IN at sector 0
	q.Drv.Write(0x90000, hdr)
	q.Drv.Write(0x90100, []byte{0xff})
	q.Publish([]testdriver.Buf{{Addr: 0x90000, Len: 16}, {Addr: 0x110000, Len: 4096, Write: true}, {Addr: 0x90100, Len: 1, Write: true}})
	q.Kick()
	if _, n := q.WaitUsed(); n != 0 {
		t.Fatalf("buffer in a removed region: used %d", n)
	}
	q.Publish([]testdriver.Buf{{Addr: 0x90000, Len: 16}, {Addr: 0xA0000, Len: 4096, Write: true}, {Addr: 0x90100, Len: 1, Write: true}})
	q.Kick()
	if _, n := q.WaitUsed(); n != 4097 || q.Drv.Read(0x90100, 1)[0] != blkStatusOK || !bytes.Equal(q.Drv.Read(0xA0000, 4096), data[:4096]) {
		t.Fatalf("read into the remaining region: used %d", n)
	}
	// Removing an unknown region is refused; the connection survives.
	if v := f.Set(vhostuser.ReqRemMemReg, reg(1)); v == 0 {
		t.Fatal("REM_MEM_REG of an unknown region acked")
	}
	// Re-adding region 1 makes it usable again.
	f.MustSet(vhostuser.ReqAddMemReg, reg(1), f.Regions[1].FD)
	if st, in, _ := q.blkReq(blkTypeIn, 0, nil, 8192); st != blkStatusOK || !bytes.Equal(in, data) {
		t.Fatal("read after re-adding the region failed")
	}
	// An overlapping region is a protocol error: nacked, then the connection closes.
	if v := f.Set(vhostuser.ReqAddMemReg, reg(1), f.Regions[1].FD); v == 0 {
		t.Fatal("overlapping ADD_MEM_REG acked")
	}
	f.ExpectClosed()
}

// TestMemTableSwapWhileRunning re-sends SET_MEM_TABLE (as QEMU does on
// memory hotplug) with a queue running: the queue is stopped, remapped and
// restarted without losing its position.
func TestMemTableSwapWhileRunning(t *testing.T) {
	env := newEnv(t, 1<<20, false, Options{})
	f, q := env.connect(t, 0)
	data := randomBytes(11, 4096)
	if st, _, _ := q.blkReq(blkTypeOut, 8, data, 0); st != blkStatusOK {
		t.Fatal(st)
	}
	payload := binary.LittleEndian.AppendUint32(nil, 2)
	payload = binary.LittleEndian.AppendUint32(payload, 0)
	for _, r := range f.Regions {
		for _, v := range []uint64{r.GPA, r.Size, r.VA, r.Off} {
			payload = binary.LittleEndian.AppendUint64(payload, v)
		}
	}
	for range 3 {
		f.MustSet(vhostuser.ReqSetMemTable, payload, f.Regions[0].FD, f.Regions[1].FD)
		st, in, _ := q.blkReq(blkTypeIn, 8, nil, 4096)
		if st != blkStatusOK || !bytes.Equal(in, data) {
			t.Fatalf("read after memory table swap: %d", st)
		}
	}
	b := f.Get(vhostuser.ReqGetVringBase, vhostusertest.State(0, 0))
	if base := binary.LittleEndian.Uint32(b[4:]); base != 4 {
		t.Fatalf("GET_VRING_BASE = %d after 4 requests", base)
	}
}

// stallingReads is a device whose reads below stallBelow wait until
// release is closed, as reads of a lazy image wait for a slow registry.
type stallingReads struct {
	BlockDevice
	stallBelow int64
	stalled    chan struct{} // one send per read that started waiting
	release    chan struct{}
}

func (d *stallingReads) ReadAt(p []byte, off int64) (int, error) {
	if off < d.stallBelow {
		d.stalled <- struct{}{}
		<-d.release
	}
	return d.BlockDevice.ReadAt(p, off)
}

// TestStalledReadsDoNotFillQueue: with more stalled reads in flight than
// the worker once had slots (32), a read of other blocks still completes.
func TestStalledReadsDoNotFillQueue(t *testing.T) {
	const stalledReads = 48
	env := newEnv(t, 1<<20, false, Options{})
	dev := &stallingReads{BlockDevice: env.dev, stallBelow: 64 << 10, stalled: make(chan struct{}, stalledReads), release: make(chan struct{})}
	env, release := env.serveHeld(t, dev, dev.release)
	_, q := env.connect(t, 0) // 128 entries
	q.Indirect = true         // one descriptor per request
	var stalled []pendingReq
	for i := 0; i < stalledReads; i++ {
		stalled = append(stalled, q.prepare(blkTypeIn, uint64(i%16)*8, nil, 4096))
	}
	q.Kick()
	for i := 0; i < stalledReads; i++ {
		select {
		case <-dev.stalled:
		case <-time.After(feWait):
			t.Fatalf("%d of %d stalled reads reached the device: the rest wait for a slot", i, stalledReads)
		}
	}
	read := q.prepare(blkTypeIn, 512, nil, 4096) // byte 256 KiB: not stalled
	q.Kick()
	if id, _ := q.WaitUsed(); id != uint32(read.head) {
		t.Fatalf("first completion is head %d, want the unstalled read (%d)", id, read.head)
	}
	if st, in := q.result(read); st != blkStatusOK || !bytes.Equal(in, env.base[512*512:512*512+4096]) {
		t.Fatalf("unstalled read: status %d", st)
	}
	release()
	for range stalled {
		q.WaitUsed()
	}
	for i, p := range stalled {
		off := (i % 16) * 8 * 512
		if st, in := q.result(p); st != blkStatusOK || !bytes.Equal(in, env.base[off:off+4096]) {
			t.Fatalf("stalled read %d: status %d", i, st)
		}
	}
}
