package virtq_test

import (
	"errors"
	"testing"
	"unsafe"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// Fake guest memory: two adjacent regions (a buffer may cross them) and a
// third one after a hole.
const (
	regA   = 0x0
	regB   = 0x10000
	regC   = 0x100000
	regLen = 0x10000
)

func fakeMemory(t testing.TB) *virtq.Memory {
	t.Helper()
	m, err := virtq.NewMemory([]virtq.Region{
		{GuestAddr: regA, Size: regLen, UserAddr: 0x7f0000000000, Data: make([]byte, regLen)},
		{GuestAddr: regB, Size: regLen, UserAddr: 0x7f1000000000, Data: make([]byte, regLen)},
		{GuestAddr: regC, Size: regLen, UserAddr: 0x7f2000000000, MmapOffset: 4096, Data: make([]byte, regLen)},
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func setup(t testing.TB, size uint16, eventIdx bool) (*virtq.Memory, *testdriver.Driver, *virtq.Queue) {
	t.Helper()
	mem := fakeMemory(t)
	desc, avail, used, _ := testdriver.Layout(regA, size)
	drv := testdriver.New(mem, size, desc, avail, used)
	q, err := virtq.New(mem, virtq.Config{Size: size, DescAddr: desc, AvailAddr: avail, UsedAddr: used, EventIdx: eventIdx})
	if err != nil {
		t.Fatal(err)
	}
	return mem, drv, q
}

func TestMemoryTranslation(t *testing.T) {
	m := fakeMemory(t)
	b, err := m.Slice(regA+regLen-10, 100)
	if err != nil || len(b) != 10 {
		t.Fatalf("Slice clamps to region end: len %d, %v", len(b), err)
	}
	if _, err := m.Range(regA+regLen-10, 100); !errors.Is(err, virtq.ErrBadAddress) {
		t.Fatalf("Range across regions: %v", err)
	}
	bufs, err := m.AppendBuffers(nil, regA+regLen-10, 100)
	if err != nil || len(bufs) != 2 || len(bufs[0]) != 10 || len(bufs[1]) != 90 {
		t.Fatalf("AppendBuffers split: %d bufs, %v", len(bufs), err)
	}
	if _, err := m.AppendBuffers(nil, regB+regLen-10, 100); !errors.Is(err, virtq.ErrBadAddress) {
		t.Fatalf("buffer running into a hole accepted: %v", err)
	}
	for _, gpa := range []uint64{regC + regLen, 1 << 63, ^uint64(0)} {
		if _, err := m.Slice(gpa, 1); !errors.Is(err, virtq.ErrBadAddress) {
			t.Errorf("Slice(%#x) = %v", gpa, err)
		}
	}
	if _, err := m.Range(^uint64(0)-1, 4); !errors.Is(err, virtq.ErrBadAddress) {
		t.Errorf("overflowing Range accepted: %v", err)
	}
	if _, err := m.AppendBuffers(nil, ^uint64(0)-1, 4); !errors.Is(err, virtq.ErrBadAddress) {
		t.Errorf("overflowing AppendBuffers accepted: %v", err)
	}
	if g, err := m.UserToGuest(0x7f1000000000 + 5); err != nil || g != regB+5 {
		t.Errorf("UserToGuest = %#x, %v", g, err)
	}
	if _, err := m.UserToGuest(0x7f1000000000 + regLen); err == nil {
		t.Error("UserToGuest past region end accepted")
	}

	bad := [][]virtq.Region{
		{{GuestAddr: 0, Size: 0}},
		{{GuestAddr: 0, Size: 10, Data: make([]byte, 9)}},
		{{GuestAddr: ^uint64(0) - 4, Size: 10, Data: make([]byte, 10)}},
		{{GuestAddr: 0, Size: 10, UserAddr: ^uint64(0) - 4, Data: make([]byte, 10)}},
		{{GuestAddr: 0, Size: 10, MmapOffset: ^uint64(0) - 4, Data: make([]byte, 10)}},
		{{GuestAddr: 0, Size: 10, Data: make([]byte, 10)}, {GuestAddr: 9, Size: 10, UserAddr: 100, Data: make([]byte, 10)}},
		{{GuestAddr: 0, Size: 10, Data: make([]byte, 10)}, {GuestAddr: 10, Size: 10, UserAddr: 5, Data: make([]byte, 10)}},
	}
	for i, rs := range bad {
		if _, err := virtq.NewMemory(rs); err == nil {
			t.Errorf("bad region set %d accepted", i)
		}
	}
}

func TestQueueLayoutValidation(t *testing.T) {
	mem := fakeMemory(t)
	desc, avail, used, _ := testdriver.Layout(regA, 16)
	cases := []virtq.Config{
		{Size: 0, DescAddr: desc, AvailAddr: avail, UsedAddr: used},
		{Size: 12, DescAddr: desc, AvailAddr: avail, UsedAddr: used},
		{Size: 16, DescAddr: desc + 8, AvailAddr: avail, UsedAddr: used},
		{Size: 16, DescAddr: desc, AvailAddr: avail + 1, UsedAddr: used},
		{Size: 16, DescAddr: desc, AvailAddr: avail, UsedAddr: used + 2},
		{Size: 16, DescAddr: 0x50000000, AvailAddr: avail, UsedAddr: used},         // table far outside memory
		{Size: 16, DescAddr: regA + regLen - 16, AvailAddr: avail, UsedAddr: used}, // crosses into B
		{Size: 16, DescAddr: desc, AvailAddr: regC + regLen - 4, UsedAddr: used},
		{Size: 16, DescAddr: desc, AvailAddr: avail, UsedAddr: ^uint64(0) - 3},
		{Size: 32768, DescAddr: desc, AvailAddr: avail, UsedAddr: used}, // table larger than the region
	}
	for i, c := range cases {
		if _, err := virtq.New(mem, c); err == nil {
			t.Errorf("case %d %+v accepted", i, c)
		}
	}
}

func TestNormalChain(t *testing.T) {
	_, drv, q := setup(t, 16, false)
	drv.Write(0x2000, []byte("header-bytes"))
	head := drv.Chain(
		testdriver.Buf{Addr: 0x2000, Len: 12},
		testdriver.Buf{Addr: 0x3000, Len: 512},
		testdriver.Buf{Addr: 0x4000, Len: 1, Write: true},
	)
	drv.Publish(head)
	var c virtq.Chain
	ok, err := q.Pop(&c)
	if !ok || err != nil {
		t.Fatalf("Pop = %v, %v", ok, err)
	}
	if c.Head != head || len(c.Readable) != 2 || len(c.Writable) != 1 || c.ReadLen != 524 || c.WriteLen != 1 || c.Descriptors != 3 {
		t.Fatalf("chain = %+v", c)
	}
	if string(c.Readable[0]) != "header-bytes" {
		t.Fatalf("readable[0] = %q", c.Readable[0])
	}
	c.Writable[0][0] = 0x5a
	if ok, err := q.Pop(&c); ok || err != nil {
		t.Fatalf("second Pop = %v, %v", ok, err)
	}
	if err := q.PushUsed(head, 1); err != nil {
		t.Fatal(err)
	}
	id, n, ok := drv.Used()
	if !ok || id != uint32(head) || n != 1 {
		t.Fatalf("used = %d %d %v", id, n, ok)
	}
	if drv.Read(0x4000, 1)[0] != 0x5a {
		t.Fatal("write to guest buffer not visible")
	}
	if err := q.PushUsed(16, 0); !errors.Is(err, virtq.ErrBroken) {
		t.Fatalf("PushUsed of out-of-range head: %v", err)
	}
}

func TestIndirectChain(t *testing.T) {
	_, drv, q := setup(t, 8, false)
	head := drv.IndirectChain(0x5000,
		testdriver.Buf{Addr: 0x2000, Len: 16},
		testdriver.Buf{Addr: 0x3000, Len: 4096, Write: true},
		testdriver.Buf{Addr: 0x6000, Len: 1, Write: true},
	)
	drv.Publish(head)
	var c virtq.Chain
	if ok, err := q.Pop(&c); !ok || err != nil {
		t.Fatalf("Pop = %v, %v", ok, err)
	}
	if c.Head != head || len(c.Readable) != 1 || len(c.Writable) != 2 || c.WriteLen != 4097 {
		t.Fatalf("chain = %+v", c)
	}
}

func TestCrossRegionBuffer(t *testing.T) {
	_, drv, q := setup(t, 8, false)
	drv.Write(regB-3, []byte("abcdef"))
	drv.Publish(drv.Chain(testdriver.Buf{Addr: regB - 3, Len: 6}))
	var c virtq.Chain
	if ok, err := q.Pop(&c); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if len(c.Readable) != 2 || string(c.Readable[0]) != "abc" || string(c.Readable[1]) != "def" {
		t.Fatalf("split = %q", c.Readable)
	}
}

// badChain publishes a chain built by fn and expects Pop to report ErrBadChain
// with the head consumed, and the queue still usable.
func badChain(t *testing.T, fn func(drv *testdriver.Driver) uint16) {
	t.Helper()
	_, drv, q := setup(t, 8, false)
	head := fn(drv)
	drv.Publish(head)
	var c virtq.Chain
	ok, err := q.Pop(&c)
	if !ok || !errors.Is(err, virtq.ErrBadChain) || c.Head != head {
		t.Fatalf("Pop = %v, %v, head %d (want %d)", ok, err, c.Head, head)
	}
	if q.Broken() {
		t.Fatal("queue broken by a bad chain")
	}
	if err := q.PushUsed(c.Head, 0); err != nil {
		t.Fatal(err)
	}
	// The queue keeps working.
	drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 1}))
	if ok, err := q.Pop(&c); !ok || err != nil {
		t.Fatalf("Pop after bad chain = %v, %v", ok, err)
	}
}

func TestBadChains(t *testing.T) {
	t.Run("next too large", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, 0x2000, 4, virtq.DescFNext, 8)
			return 0
		})
	})
	t.Run("loop", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, 0x2000, 4, virtq.DescFNext, 1)
			d.SetDesc(d.DescAddr, 1, 0x2000, 4, virtq.DescFNext, 0)
			return 0
		})
	})
	t.Run("full-table chain then wrap", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			for i := range uint16(8) {
				d.SetDesc(d.DescAddr, i, 0x2000, 4, virtq.DescFNext, (i+1)%8)
			}
			return 3
		})
	})
	t.Run("indirect with next", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(0x5000, 0, 0x2000, 4, 0, 0)
			d.SetDesc(d.DescAddr, 0, 0x5000, 16, virtq.DescFIndirect|virtq.DescFNext, 1)
			d.SetDesc(d.DescAddr, 1, 0x2000, 4, 0, 0)
			return 0
		})
	})
	t.Run("unaligned indirect table", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(0x5008, 0, 0x2000, 4, 0, 0)
			d.SetDesc(d.DescAddr, 0, 0x5008, 16, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("indirect length not multiple of 16", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, 0x5000, 20, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("indirect table larger than queue", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, 0x5000, 16*9, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("nested indirect", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(0x6000, 0, 0x2000, 4, 0, 0)
			d.SetDesc(0x5000, 0, 0x6000, 16, virtq.DescFIndirect, 0)
			d.SetDesc(d.DescAddr, 0, 0x5000, 16, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("indirect loop", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(0x5000, 0, 0x2000, 4, virtq.DescFNext, 1)
			d.SetDesc(0x5000, 1, 0x2000, 4, virtq.DescFNext, 0)
			d.SetDesc(d.DescAddr, 0, 0x5000, 32, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("indirect table outside memory", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, 0x90000000, 32, virtq.DescFIndirect, 0)
			return 0
		})
	})
	t.Run("buffer outside memory", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			d.SetDesc(d.DescAddr, 0, ^uint64(0)-2, 16, 0, 0)
			return 0
		})
	})
	t.Run("readable after writable", func(t *testing.T) {
		badChain(t, func(d *testdriver.Driver) uint16 {
			return d.Chain(testdriver.Buf{Addr: 0x2000, Len: 4, Write: true}, testdriver.Buf{Addr: 0x2000, Len: 4})
		})
	})
}

func TestHeadOutOfRangeBreaks(t *testing.T) {
	_, drv, q := setup(t, 8, false)
	drv.Publish(8)
	var c virtq.Chain
	if _, err := q.Pop(&c); !errors.Is(err, virtq.ErrBroken) || !q.Broken() {
		t.Fatalf("Pop = %v, broken %v", err, q.Broken())
	}
	if _, err := q.Pop(&c); !errors.Is(err, virtq.ErrBroken) {
		t.Fatal("broken queue popped again")
	}
}

func TestAvailWindowTooLargeBreaks(t *testing.T) {
	_, drv, q := setup(t, 8, false)
	drv.SetAvailIdx(9)
	var c virtq.Chain
	if _, err := q.Pop(&c); !errors.Is(err, virtq.ErrBroken) {
		t.Fatalf("Pop = %v", err)
	}
	if q.EnableNotification() {
		t.Fatal("broken queue reports work")
	}
}

func TestIndexWrap(t *testing.T) {
	mem := fakeMemory(t)
	desc, avail, used, _ := testdriver.Layout(regA, 4)
	drv := testdriver.New(mem, 4, desc, avail, used)
	drv.SetAvailIdx(65534)
	q, err := virtq.New(mem, virtq.Config{Size: 4, DescAddr: desc, AvailAddr: avail, UsedAddr: used, LastAvail: 65534})
	if err != nil {
		t.Fatal(err)
	}
	var c virtq.Chain
	for i := range 6 {
		h := drv.Chain(testdriver.Buf{Addr: 0x2000, Len: uint32(i + 1)})
		drv.Publish(h)
		ok, err := q.Pop(&c)
		if !ok || err != nil || c.ReadLen != uint32(i+1) {
			t.Fatalf("pop %d: %v %v %+v", i, ok, err, c)
		}
		if err := q.PushUsed(c.Head, 0); err != nil {
			t.Fatal(err)
		}
	}
	if q.LastAvail() != 4 {
		t.Fatalf("LastAvail = %d, want 4 after wrap", q.LastAvail())
	}
}

func TestNeedEventArithmetic(t *testing.T) {
	// The driver asks for an interrupt once the used index passes used_event.
	_, drv, q := setup(t, 8, true)
	var c virtq.Chain
	push := func(k int) {
		for range k {
			drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 1}))
			if ok, err := q.Pop(&c); !ok || err != nil {
				t.Fatal(ok, err)
			}
			if err := q.PushUsed(c.Head, 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	push(1)
	if !q.NeedsNotification() {
		t.Fatal("first notification must always be sent")
	}
	drv.SetUsedEvent(3) // notify when used idx moves past 3, i.e. reaches 4
	push(1)             // used idx 2
	if q.NeedsNotification() {
		t.Fatal("notified before reaching used_event")
	}
	push(1) // 3
	if q.NeedsNotification() {
		t.Fatal("notified at used_event, before passing it")
	}
	push(2) // 5: crossed 4
	if !q.NeedsNotification() {
		t.Fatal("not notified after passing used_event")
	}
	if q.NeedsNotification() {
		t.Fatal("notified with nothing new")
	}
	// Wrapped arithmetic: used_event behind by a wrap.
	drv.SetUsedEvent(65535)
	push(1)
	if q.NeedsNotification() {
		t.Fatal("stale used_event far behind must not trigger")
	}

	// avail_event: EnableNotification publishes the last available index and reports pending work.
	if q.EnableNotification() {
		t.Fatal("pending work reported on an empty ring")
	}
	if drv.AvailEvent() != q.LastAvail() {
		t.Fatalf("avail_event = %d, want %d", drv.AvailEvent(), q.LastAvail())
	}
	drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 1}))
	if !q.EnableNotification() {
		t.Fatal("published buffer not noticed by EnableNotification")
	}
}

func TestFlagNotifications(t *testing.T) {
	_, drv, q := setup(t, 8, false)
	var c virtq.Chain
	q.DisableNotification()
	if drv.UsedFlags()&virtq.UsedFNoNotify == 0 {
		t.Fatal("NO_NOTIFY not set")
	}
	if q.EnableNotification() || drv.UsedFlags()&virtq.UsedFNoNotify != 0 {
		t.Fatal("NO_NOTIFY not cleared")
	}
	drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 1}))
	q.Pop(&c)
	q.PushUsed(c.Head, 0)
	drv.SetAvailFlags(virtq.AvailFNoInterrupt)
	if q.NeedsNotification() {
		t.Fatal("notified despite NO_INTERRUPT")
	}
	drv.SetAvailFlags(0)
	if q.NeedsNotification() {
		t.Fatal("notified with nothing new")
	}
	drv.Publish(drv.Chain(testdriver.Buf{Addr: 0x2000, Len: 1}))
	q.Pop(&c)
	q.PushUsed(c.Head, 0)
	if !q.NeedsNotification() {
		t.Fatal("not notified")
	}
}

func inRegions(m *virtq.Memory, b []byte) bool {
	if len(b) == 0 {
		return true
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	for _, r := range m.Regions() {
		s := uintptr(unsafe.Pointer(&r.Data[0]))
		if p >= s && p+uintptr(len(b)) <= s+uintptr(len(r.Data)) {
			return true
		}
	}
	return false
}

// FuzzChain lets the fuzzer write the descriptor table, an indirect area and
// the available ring; popping must never panic, and every buffer handed out
// must lie inside a region.
func FuzzChain(f *testing.F) {
	seed := func(descs [][4]uint64, availIdx uint16, heads ...uint16) []byte {
		b := make([]byte, 4+2*16+16*16)
		b[0], b[1] = byte(availIdx), byte(availIdx>>8)
		for i, h := range heads {
			b[4+2*i], b[5+2*i] = byte(h), byte(h>>8)
		}
		for i, d := range descs {
			e := b[36+16*i:]
			for k := range 8 {
				e[k] = byte(d[0] >> (8 * k))
			}
			for k := range 4 {
				e[8+k] = byte(d[1] >> (8 * k))
			}
			e[12], e[13], e[14], e[15] = byte(d[2]), byte(d[2]>>8), byte(d[3]), byte(d[3]>>8)
		}
		return b
	}
	f.Add(seed([][4]uint64{{0x2000, 16, 1, 1}, {0x3000, 512, 2, 0}}, 1, 0))
	f.Add(seed([][4]uint64{{0x5000, 48, 4, 0}}, 1, 0))
	f.Add(seed([][4]uint64{{0x2000, 16, 1, 1}, {0x3000, 512, 1, 0}}, 2, 0, 1))
	f.Add(seed([][4]uint64{{regB - 8, 16, 0, 0}}, 1, 0))
	f.Add(seed(nil, 17, 3))
	f.Add(seed([][4]uint64{{0x2000, 16, 1, 16}}, 1, 0))
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := fakeMemory(t)
		desc, avail, used, _ := testdriver.Layout(regA, 16)
		drv := testdriver.New(mem, 16, desc, avail, used)
		if len(data) >= 4 {
			drv.Write(avail+2, data[0:2]) // avail idx
			data = data[4:]
		}
		ring, _ := mem.Range(avail+4, 32)
		data = data[copy(ring, data):]
		table, _ := mem.Range(desc, 256)
		data = data[copy(table, data):]
		ind, _ := mem.Range(0x5000, 4096) // where fuzzed indirect tables may point
		copy(ind, data)
		q, err := virtq.New(mem, virtq.Config{Size: 16, DescAddr: desc, AvailAddr: avail, UsedAddr: used, EventIdx: true})
		if err != nil {
			t.Fatal(err)
		}
		var c virtq.Chain
		for range 20 {
			ok, err := q.Pop(&c)
			if !ok {
				break
			}
			for _, b := range append(append([][]byte(nil), c.Readable...), c.Writable...) {
				if !inRegions(mem, b) {
					t.Fatalf("buffer outside guest memory")
				}
			}
			if err == nil && c.Descriptors > 32 {
				t.Fatalf("chain of %d descriptors exceeds the ttl bound", c.Descriptors)
			}
			if err := q.PushUsed(c.Head, c.WriteLen); err != nil {
				t.Fatalf("PushUsed of a popped head: %v", err)
			}
			q.NeedsNotification()
			q.EnableNotification()
		}
	})
}
