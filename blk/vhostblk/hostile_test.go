package vhostblk

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
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
			if used := d.h.handle(c, &d.h.shards[0]); used != 1 || status[0] != blkStatusOK {
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

// TestGuestMemoryFaultFailsRequest runs requests whose header, data or
// status byte lies in guest memory without backing: each must fail (IOERR,
// or used length 0 without a status byte) and leave the device usable,
// instead of killing the process with SIGBUS.
func TestGuestMemoryFaultFailsRequest(t *testing.T) {
	const size = 1 << 20
	base := randomBytes(1, size)
	ov, err := overlay.Open(bytes.NewReader(base), size, filepath.Join(t.TempDir(), "overlay"), overlay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ov.Close()
	var logged []string
	d, err := newBlkDevice(ov, &Options{Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }})
	if err != nil {
		t.Fatal(err)
	}
	bad := testdriver.FaultingPage(t)
	header := func(typ uint32, sector uint64) []byte {
		h := binary.LittleEndian.AppendUint32(nil, typ)
		h = binary.LittleEndian.AppendUint32(h, 0)
		return binary.LittleEndian.AppendUint64(h, sector)
	}
	run := func(name string, c *virtq.Chain, status []byte, wantUsed uint32, wantStatus byte) {
		t.Helper()
		c.ReadLen, c.WriteLen, c.Descriptors = 0, 0, len(c.Readable)+len(c.Writable)
		for _, b := range c.Readable {
			c.ReadLen += uint32(len(b))
		}
		for _, b := range c.Writable {
			c.WriteLen += uint32(len(b))
		}
		used := d.h.handle(c, &d.h.shards[0])
		if used != wantUsed {
			t.Errorf("%s: used %d, want %d", name, used, wantUsed)
		}
		if status != nil && status[0] != wantStatus {
			t.Errorf("%s: status %d, want %d", name, status[0], wantStatus)
		}
	}
	status := []byte{0xff}
	run("header in faulting memory", &virtq.Chain{Readable: [][]byte{bad[:16]}, Writable: [][]byte{status}}, status, 1, blkStatusIOErr)
	// A partial-block write copies the guest's bytes in Go (read-modify-write).
	status[0] = 0xff
	run("partial-block write from faulting memory", &virtq.Chain{Readable: [][]byte{header(blkTypeOut, 1), bad[:512]}, Writable: [][]byte{status}}, status, 1, blkStatusIOErr)
	status[0] = 0xff
	run("read into faulting memory", &virtq.Chain{Readable: [][]byte{header(blkTypeIn, 0)}, Writable: [][]byte{bad[:4096], status}}, status, 1, blkStatusIOErr)
	run("status byte in faulting memory", &virtq.Chain{Readable: [][]byte{header(blkTypeFlush, 0)}, Writable: [][]byte{bad[:1]}}, nil, 0, 0)
	t.Logf("logged: %q", logged)
	if len(logged) != 4 {
		t.Errorf("%d faults logged, want 4: %q", len(logged), logged)
	}

	// The device still works, including the block whose write faulted
	// (its stripe lock was released).
	data := randomBytes(2, 512)
	status[0] = 0xff
	run("write after the faults", &virtq.Chain{Readable: [][]byte{header(blkTypeOut, 1), data}, Writable: [][]byte{status}}, status, 1, blkStatusOK)
	got := make([]byte, 4096)
	status[0] = 0xff
	run("read after the faults", &virtq.Chain{Readable: [][]byte{header(blkTypeIn, 0)}, Writable: [][]byte{got, status}}, status, 4097, blkStatusOK)
	if !bytes.Equal(got[512:1024], data) || !bytes.Equal(got[:512], base[:512]) || !bytes.Equal(got[1024:], base[1024:4096]) {
		t.Error("data read back after the faults differs from what was written")
	}
}
