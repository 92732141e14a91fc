package tarlayer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// ReadFile is Read for a layer tar stored as a file, such as a blob in the
// cache, read through a buffer that still seeks.
func ReadFile(ctx context.Context, path string, src index.Source, max int, layer string) (*index.Index, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", layer, err)
	}
	defer f.Close()
	return Read(ctx, newBufferedSeeker(f), src, max, layer)
}

// bufferedSeeker is a read buffer that still answers Seek, so archive/tar
// can report data offsets and skip file data without a syscall per header.
type bufferedSeeker struct {
	f    io.ReadSeeker
	buf  []byte
	r, w int
	pos  int64 // file offset of buf[w]
}

func newBufferedSeeker(f io.ReadSeeker) *bufferedSeeker {
	return &bufferedSeeker{f: f, buf: make([]byte, 256<<10)}
}

func (b *bufferedSeeker) Read(p []byte) (int, error) {
	if b.r == b.w {
		if len(p) >= len(b.buf) {
			n, err := b.f.Read(p)
			b.pos += int64(n)
			return n, err
		}
		n, err := b.f.Read(b.buf)
		b.r, b.w = 0, n
		b.pos += int64(n)
		if n == 0 {
			return 0, err
		}
	}
	n := copy(p, b.buf[b.r:b.w])
	b.r += n
	return n, nil
}

func (b *bufferedSeeker) Seek(off int64, whence int) (int64, error) {
	cur := b.pos - int64(b.w-b.r)
	if whence == io.SeekCurrent {
		if off >= 0 && off <= int64(b.w-b.r) {
			b.r += int(off)
			return cur + off, nil
		}
		off, whence = cur+off, io.SeekStart
	}
	if whence != io.SeekStart {
		return 0, errors.New("bufferedSeeker: unsupported whence")
	}
	if off < 0 {
		return 0, errors.New("bufferedSeeker: negative offset")
	}
	p, err := b.f.Seek(off, io.SeekStart)
	if err != nil {
		return 0, err
	}
	b.pos, b.r, b.w = p, 0, 0
	return p, nil
}
