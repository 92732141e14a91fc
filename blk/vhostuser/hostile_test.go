package vhostuser

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// recordDevice is a BlockDevice of fixed size that records the discard and
// write-zeroes calls it gets, and runs hook before each, so a test can play
// a guest that rewrites its request while the device works on it.
type recordDevice struct {
	size  int64
	calls []string
	hook  func(call int)
}

func (d *recordDevice) ReadAt(p []byte, off int64) (int, error)  { clear(p); return len(p), nil }
func (d *recordDevice) WriteAt(p []byte, off int64) (int, error) { return len(p), nil }
func (d *recordDevice) Flush() error                             { return nil }
func (d *recordDevice) Size() int64                              { return d.size }
func (d *recordDevice) ReadOnly() bool                           { return false }
func (d *recordDevice) ID() string                               { return "record" }

func (d *recordDevice) Discard(off, n int64) error {
	return d.record(fmt.Sprintf("discard %d+%d", off, n))
}

func (d *recordDevice) WriteZeroes(off, n int64, unmap bool) error {
	return d.record(fmt.Sprintf("zero %d+%d unmap=%t", off, n, unmap))
}

func (d *recordDevice) record(call string) error {
	if d.hook != nil {
		d.hook(len(d.calls))
	}
	d.calls = append(d.calls, call)
	return nil
}

func segment(sector uint64, num, flags uint32) []byte {
	b := binary.LittleEndian.AppendUint64(nil, sector)
	b = binary.LittleEndian.AppendUint32(b, num)
	return binary.LittleEndian.AppendUint32(b, flags)
}

// TestSegmentsReadOnce plays a guest that rewrites the second segment of a
// write-zeroes request after the device checked it: a sector whose byte
// offset wraps to 0 (2^55 * 512 = 2^64), 2^32-1 sectors (past the
// per-segment limit and the disk) and reserved flags. The device must act
// on the segments it checked, never on what the guest wrote afterwards.
func TestSegmentsReadOnce(t *testing.T) {
	for _, typ := range []uint32{blkTypeWriteZeroes, blkTypeDiscard} {
		t.Run(fmt.Sprint(typ), func(t *testing.T) {
			const size = 1 << 20
			dev := &recordDevice{size: size}
			d, err := newBlkDevice(dev, &Options{})
			if err != nil {
				t.Fatal(err)
			}
			hdr := binary.LittleEndian.AppendUint32(nil, typ)
			hdr = append(hdr, make([]byte, 12)...)
			segs := append(segment(0, 8, 0), segment(8, 8, 0)...)
			status := []byte{0xff}
			dev.hook = func(call int) {
				if call == 0 {
					copy(segs[16:], segment(1<<55, 0xffffffff, 0xff))
				}
			}
			c := &virtq.Chain{Readable: [][]byte{hdr, segs}, Writable: [][]byte{status},
				ReadLen: 48, WriteLen: 1, Descriptors: 3}
			if used := d.h.handle(c); used != 1 || status[0] != blkStatusOK {
				t.Fatalf("used %d, status %d; want 1, OK", used, status[0])
			}
			want := []string{"zero 0+4096 unmap=false", "zero 4096+4096 unmap=false"}
			if typ == blkTypeDiscard {
				want = []string{"discard 0+4096", "discard 4096+4096"}
			}
			if fmt.Sprint(dev.calls) != fmt.Sprint(want) {
				t.Fatalf("device calls %q, want %q (the checked segments)", dev.calls, want)
			}
		})
	}
}
