package blk

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/vhostblk/blktest"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
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
		return blktest.Request(q, typ, sector, out, inLen)
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
