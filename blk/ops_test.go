package blk

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// A disk's Ops counts the virtio-blk requests its server answered: the
// test frontend reads the superblock and writes a block, as a guest would.
func TestDiskOps(t *testing.T) {
	layer := t.TempDir()
	if err := os.WriteFile(filepath.Join(layer, "f"), bytes.Repeat([]byte("x"), 10000), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := Create(context.Background(), []string{layer}, filepath.Join(t.TempDir(), "disk"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Remove()
	f := vhostusertest.Dial(t, d.Socket)
	defer f.Close()
	f.Negotiate(0)
	f.SetupMemory()
	q := f.StartQueue(0, 64)
	req := func(typ uint32, sector uint64, out []byte, inLen int) byte {
		t.Helper()
		hdr := binary.LittleEndian.AppendUint32(nil, typ)
		hdr = binary.LittleEndian.AppendUint32(hdr, 0)
		hdr = binary.LittleEndian.AppendUint64(hdr, sector)
		ha := q.Alloc(16, 16)
		q.Drv.Write(ha, hdr)
		bufs := []testdriver.Buf{{Addr: ha, Len: 16}}
		if len(out) > 0 {
			a := q.Alloc(uint64(len(out)), 8)
			q.Drv.Write(a, out)
			bufs = append(bufs, testdriver.Buf{Addr: a, Len: uint32(len(out))})
		}
		if inLen > 0 {
			bufs = append(bufs, testdriver.Buf{Addr: q.Alloc(uint64(inLen), 8), Len: uint32(inLen), Write: true})
		}
		sa := q.Alloc(1, 1)
		bufs = append(bufs, testdriver.Buf{Addr: sa, Len: 1, Write: true})
		q.Publish(bufs)
		q.Kick()
		q.WaitUsed()
		return q.Drv.Read(sa, 1)[0]
	}
	for i := range 3 {
		if st := req(0, uint64(i*8), nil, 4096); st != 0 {
			t.Fatalf("read %d: status %d", i, st)
		}
	}
	if st := req(1, 64, bytes.Repeat([]byte{1}, 4096), 0); st != 0 {
		t.Fatalf("write: status %d", st)
	}
	ops := d.Ops()
	if ops.Read.Requests != 3 || ops.Read.Bytes != 3*4096 || ops.Write.Requests != 1 || ops.Write.Bytes != 4096 {
		t.Fatalf("ops after 3 reads and a write of 4 KiB: read %+v write %+v", ops.Read, ops.Write)
	}
	if ops.Flush.Requests != 0 || ops.Read.Errors != 0 {
		t.Fatalf("flush %+v, read errors %d", ops.Flush, ops.Read.Errors)
	}
}
