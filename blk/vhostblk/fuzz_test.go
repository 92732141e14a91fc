package vhostblk

import (
	"encoding/binary"
	"testing"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// Layout of the fuzzed guest: one 64 KiB region holding a 16-entry queue
// at 0, an area the fuzzer fills at fuzzData (headers, segments, data,
// indirect tables) and a 4 KiB-aligned buffer area after it.
const (
	fuzzMem     = 0x10000
	fuzzQueue   = 16
	fuzzData    = 0x1000
	fuzzDataLen = 0x2000
	fuzzDisk    = 64 << 10
)

// checkDevice is a RAM disk that fails the fuzz run on any call the
// handler should never make (outside the disk, a discard or zeroing larger
// than the limits the device advertises), and that plays a hostile guest:
// before every call it flips every byte of the request area, so a field the
// handler checked and then read again from guest memory would reach the
// device unchecked.
type checkDevice struct {
	t        *testing.T
	data     []byte
	maxZero  int64
	hostile  []byte // guest memory the guest rewrites under the device
	readOnly bool
	calls    int
}

func (d *checkDevice) race() {
	d.calls++
	for i := range d.hostile {
		d.hostile[i] ^= 0xff
	}
}

func (d *checkDevice) span(what string, off, n int64) []byte {
	if off < 0 || n < 0 || off > int64(len(d.data)) || n > int64(len(d.data))-off {
		d.t.Fatalf("%s of %d bytes at %d: outside the %d-byte disk", what, n, off, len(d.data))
	}
	if off%sectorSize != 0 || n%sectorSize != 0 {
		d.t.Fatalf("%s of %d bytes at %d: not sector aligned", what, n, off)
	}
	d.race()
	return d.data[off : off+n]
}

func (d *checkDevice) ReadAt(p []byte, off int64) (int, error) {
	return copy(p, d.span("read", off, int64(len(p)))), nil
}

func (d *checkDevice) WriteAt(p []byte, off int64) (int, error) {
	if d.readOnly {
		d.t.Fatal("write to a read-only device")
	}
	return copy(d.span("write", off, int64(len(p))), p), nil
}

func (d *checkDevice) Discard(off, n int64) error { return d.WriteZeroes(off, n, true) }

func (d *checkDevice) WriteZeroes(off, n int64, unmap bool) error {
	if d.readOnly {
		d.t.Fatal("zeroing a read-only device")
	}
	if n > d.maxZero {
		d.t.Fatalf("zeroing %d bytes, more than the %d a segment may ask", n, d.maxZero)
	}
	clear(d.span("zero", off, n))
	return nil
}

func (d *checkDevice) Flush() error   { d.race(); return nil }
func (d *checkDevice) Size() int64    { return int64(len(d.data)) }
func (d *checkDevice) ReadOnly() bool { return d.readOnly }
func (d *checkDevice) ID() string     { return "fuzz-disk" }

// fuzzSeed lays out a guest for FuzzBlkRequest: the available index and
// ring, the descriptor table, then the request area.
func fuzzSeed(descs []testdriver.Buf, chains [][]int, area []byte) []byte {
	b := make([]byte, 4+2*fuzzQueue+16*fuzzQueue)
	binary.LittleEndian.PutUint16(b[0:], uint16(len(chains)))
	for i, ch := range chains {
		binary.LittleEndian.PutUint16(b[4+2*i:], uint16(ch[0]))
		for k, di := range ch {
			d := descs[di]
			e := b[4+2*fuzzQueue+16*di:]
			binary.LittleEndian.PutUint64(e[0:], d.Addr)
			binary.LittleEndian.PutUint32(e[8:], d.Len)
			var flags uint16
			if d.Write {
				flags |= virtq.DescFWrite
			}
			if k+1 < len(ch) {
				flags |= virtq.DescFNext
				binary.LittleEndian.PutUint16(e[14:], uint16(ch[k+1]))
			}
			binary.LittleEndian.PutUint16(e[12:], flags)
		}
	}
	return append(b, area...)
}

func blkHeader(typ uint32, sector uint64) []byte {
	h := binary.LittleEndian.AppendUint32(nil, typ)
	h = binary.LittleEndian.AppendUint32(h, 0)
	return binary.LittleEndian.AppendUint64(h, sector)
}

// blkFuzzSeeds are well-formed requests of every type, and a few hostile ones.
func blkFuzzSeeds() [][]byte {
	var seeds [][]byte
	hdrAt := uint64(fuzzData)
	segAt := uint64(fuzzData + 0x100)
	bufAt := uint64(fuzzData + fuzzDataLen)
	statusAt := uint64(fuzzData + 0x300)
	area := make([]byte, fuzzDataLen)
	withHeaders := func(typ uint32, sector uint64, segs ...[]byte) []byte {
		a := append([]byte(nil), area...)
		copy(a, blkHeader(typ, sector))
		var s []byte
		for _, seg := range segs {
			s = append(s, seg...)
		}
		copy(a[0x100:], s)
		return a
	}
	rw := []testdriver.Buf{{Addr: hdrAt, Len: 16}, {Addr: bufAt, Len: 4096}, {Addr: statusAt, Len: 1, Write: true}}
	rd := []testdriver.Buf{{Addr: hdrAt, Len: 16}, {Addr: bufAt, Len: 4096, Write: true}, {Addr: statusAt, Len: 1, Write: true}}
	seeds = append(seeds, fuzzSeed(rw, [][]int{{0, 1, 2}}, withHeaders(blkTypeOut, 8)))
	seeds = append(seeds, fuzzSeed(rd, [][]int{{0, 1, 2}}, withHeaders(blkTypeIn, 120)))
	seeds = append(seeds, fuzzSeed([]testdriver.Buf{{Addr: hdrAt, Len: 16}, {Addr: statusAt, Len: 1, Write: true}}, [][]int{{0, 1}}, withHeaders(blkTypeFlush, 0)))
	seeds = append(seeds, fuzzSeed([]testdriver.Buf{{Addr: hdrAt, Len: 16}, {Addr: bufAt, Len: 20, Write: true}, {Addr: statusAt, Len: 1, Write: true}},
		[][]int{{0, 1, 2}}, withHeaders(blkTypeGetID, 0)))
	segs := []testdriver.Buf{{Addr: hdrAt, Len: 16}, {Addr: segAt, Len: 32}, {Addr: statusAt, Len: 1, Write: true}}
	seeds = append(seeds, fuzzSeed(segs, [][]int{{0, 1, 2}}, withHeaders(blkTypeDiscard, 0, segment(0, 8, 0), segment(64, 16, 0))))
	seeds = append(seeds, fuzzSeed(segs, [][]int{{0, 1, 2}}, withHeaders(blkTypeWriteZeroes, 0, segment(8, 8, blkFlagUnmap), segment(1<<55, 8, 0))))
	seeds = append(seeds, fuzzSeed(segs, [][]int{{0, 1, 2}}, withHeaders(blkTypeWriteZeroes, 0, segment(0, 0xffffffff, 0), segment(0, 1, 0xfe))))
	// Two requests sharing a header, and a partial-sector write.
	seeds = append(seeds, fuzzSeed(append(rw, testdriver.Buf{Addr: bufAt, Len: 100}), [][]int{{0, 1, 2}, {3}}, withHeaders(blkTypeOut, 1)))
	return seeds
}

// FuzzBlkRequest drives the virtio-blk request handler itself with hostile
// guest memory: the fuzzer writes the available ring, the descriptor table
// and the request area (headers, discard segments, data), and the guest
// rewrites the request area whenever the device is called. Whatever the
// input, the handler must not panic, must call the device only inside the
// disk and within the advertised limits, and must never report more used
// bytes than the chain's writable length.
//
// It runs several thousand inputs per second: all in memory, no files.
func FuzzBlkRequest(f *testing.F) {
	for _, s := range blkFuzzSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) { fuzzBlk(t, data) })
}

// fuzzBlk runs one FuzzBlkRequest input and returns how many device calls it made.
func fuzzBlk(t *testing.T, data []byte) int {
	ram := make([]byte, fuzzMem)
	mem, err := virtq.NewMemory([]virtq.Region{{GuestAddr: 0, Size: fuzzMem, UserAddr: 0x7f0000000000, Data: ram}})
	if err != nil {
		t.Fatal(err)
	}
	desc, avail, used, end := testdriver.Layout(0, fuzzQueue)
	if end > fuzzData {
		t.Fatalf("queue layout ends at %#x, past the request area", end)
	}
	drv := testdriver.New(mem, fuzzQueue, desc, avail, used)
	if len(data) >= 4 {
		drv.Write(avail+2, data[0:2]) // avail idx
		data = data[4:]
	}
	ringEntries, _ := mem.Range(avail+4, 2*fuzzQueue)
	data = data[copy(ringEntries, data):]
	table, _ := mem.Range(desc, 16*fuzzQueue)
	data = data[copy(table, data):]
	reqArea := ram[fuzzData : fuzzData+fuzzDataLen]
	copy(reqArea, data)

	dev := &checkDevice{t: t, data: make([]byte, fuzzDisk), hostile: reqArea}
	d, err := newBlkDevice(dev, &Options{SegMax: 8, MaxRequestBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	dev.maxZero = int64(d.h.cfg.maxDiscardSectors) * sectorSize
	q, err := virtq.New(mem, virtq.Config{Size: fuzzQueue, DescAddr: desc, AvailAddr: avail, UsedAddr: used, EventIdx: true})
	if err != nil {
		t.Fatal(err)
	}
	var c virtq.Chain
	for range 2 * fuzzQueue {
		ok, err := q.Pop(&c)
		if !ok {
			break
		}
		n := uint32(0)
		if err == nil {
			n = d.h.handle(&c, &d.h.shards[0])
			if n > c.WriteLen {
				t.Fatalf("used length %d exceeds the chain's %d writable bytes", n, c.WriteLen)
			}
		}
		if err := q.PushUsed(c.Head, n); err != nil {
			t.Fatalf("PushUsed: %v", err)
		}
	}
	return dev.calls
}

// TestBlkFuzzSeeds checks that FuzzBlkRequest's well-formed seeds reach the
// device: a corpus the handler refuses outright would fuzz only refusals.
func TestBlkFuzzSeeds(t *testing.T) {
	// GET_ID (3) answers without the device; 5 and 6 carry a segment
	// the handler must refuse before touching the device.
	want := []bool{true, true, true, false, true, false, false, true}
	for i, s := range blkFuzzSeeds() {
		if n := fuzzBlk(t, s); (n > 0) != want[i] {
			t.Errorf("seed %d made %d device calls, want any: %t", i, n, want[i])
		}
	}
}
