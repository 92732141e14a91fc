package ext4

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// patternBlob is a synthetic content blob whose byte at offset o is a
// function of o, so any misplaced read shows.
type patternBlob struct{ size int64 }

func patternByte(o int64) byte { return byte(o*131>>3 ^ o>>11 ^ 0x5a) }

func (p patternBlob) ReadAt(b []byte, off int64) (int, error) {
	n := 0
	for ; n < len(b) && off+int64(n) < p.size; n++ {
		b[n] = patternByte(off + int64(n))
	}
	if n < len(b) {
		return n, io.EOF
	}
	return n, nil
}

type blobOpener struct{ size int64 }

func (o blobOpener) Open(src index.Source, path string) (io.ReaderAt, error) {
	if src.Kind != index.SourceBlob || path != "" {
		return nil, fmt.Errorf("blobOpener: unexpected source %v %q", src, path)
	}
	return patternBlob(o), nil
}

// TestBlobSource maps files onto offsets of a single blob and checks file
// content and that the tail of each last block reads as zeros although the
// blob continues there.
func TestBlobSource(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	testenv.Tool(t, "debugfs", "e2fsprogs")
	idx := syntheticIndex(20000, 200)
	last := &idx.Entries[len(idx.Entries)-1]
	blobSize := last.Data.Offset + last.Size + 4096
	img, err := Build(context.Background(), idx, Options{Time: time.Unix(testTime, 0)})
	must(t, err)
	defer img.Close()
	raw := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(raw)
	must(t, err)
	must(t, Export(context.Background(), img, blobOpener{blobSize}, f))
	must(t, f.Close())
	fsck(t, raw)
	mnt := mountRO(t, raw)
	for _, i := range []int{201, 202, 5000, 12345, len(idx.Entries) - 1} {
		e := &idx.Entries[i]
		got, err := os.ReadFile(filepath.Join(mnt, e.Path))
		must(t, err)
		want := make([]byte, e.Size)
		patternBlob{blobSize}.ReadAt(want, e.Data.Offset)
		if !bytes.Equal(got, want) {
			t.Errorf("%s: content differs", e.Path)
		}
		if e.Size%4096 == 0 {
			continue
		}
		out, err := exec.Command("debugfs", "-R", "blocks /"+e.Path, raw).CombinedOutput()
		must(t, err)
		fields := strings.Fields(string(out))
		lastBlk, err := strconv.ParseInt(fields[len(fields)-1], 10, 64)
		must(t, err)
		tail := make([]byte, 4096-e.Size%4096)
		rf, err := os.Open(raw)
		must(t, err)
		_, err = rf.ReadAt(tail, lastBlk*4096+e.Size%4096)
		rf.Close()
		must(t, err)
		if !bytes.Equal(tail, make([]byte, len(tail))) {
			t.Errorf("%s: bytes past the end of the file in block %d are not zero", e.Path, lastBlk)
		}
	}
}
