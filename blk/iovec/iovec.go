// Package iovec provides vectored I/O over scattered buffers: a cursor that
// walks a virtio request's data buffers (one per guest page, typically) and
// the preadv/pwritev loops that resume after short transfers, so a request
// of many pages costs one system call instead of one per page.
package iovec

import (
	"fmt"
	"io"
	"math/bits"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Max is the most iovecs one preadv or pwritev takes (IOV_MAX on Linux).
const Max = 1024

// Cursor walks a list of buffers as one byte stream. The zero Cursor over
// no buffers is empty; callers never ask it for more bytes than remain.
type Cursor struct {
	bufs [][]byte
	i    int // current buffer
	at   int // bytes of bufs[i] already consumed
}

// NewCursor returns a cursor at the first byte of bufs.
func NewCursor(bufs [][]byte) Cursor { return Cursor{bufs: bufs} }

// Next returns the next piece of at most max (> 0) bytes, skipping empty
// buffers, and moves past it.
func (c *Cursor) Next(max int64) []byte {
	for c.at == len(c.bufs[c.i]) {
		c.i, c.at = c.i+1, 0
	}
	b := c.bufs[c.i][c.at:]
	if int64(len(b)) > max {
		b = b[:max]
	}
	c.at += len(b)
	return b
}

// CopyOut fills dst with the next len(dst) bytes of the cursor.
func (c *Cursor) CopyOut(dst []byte) {
	for len(dst) > 0 {
		n := copy(dst, c.Next(int64(len(dst))))
		dst = dst[n:]
	}
}

// CopyIn copies src into the next len(src) bytes of the cursor.
func (c *Cursor) CopyIn(src []byte) {
	for len(src) > 0 {
		n := copy(c.Next(int64(len(src))), src)
		src = src[n:]
	}
}

// Zero clears the next n bytes of the cursor.
func (c *Cursor) Zero(n int64) {
	for n > 0 {
		b := c.Next(n)
		clear(b)
		n -= int64(len(b))
	}
}

// Iovecs appends the next n bytes to iov as iovecs, without copying.
func (c *Cursor) Iovecs(iov []unix.Iovec, n int64) []unix.Iovec {
	for n > 0 {
		b := c.Next(n)
		v := unix.Iovec{Base: &b[0]}
		v.SetLen(len(b))
		iov = append(iov, v)
		n -= int64(len(b))
	}
	return iov
}

// Len is the byte count of iov.
func Len(iov []unix.Iovec) uint64 {
	var n uint64
	for _, v := range iov {
		n += v.Len
	}
	return n
}

// Pwritev writes all of *iovp at off, in chunks of Max, resuming after
// short writes and EINTR; on return *iovp holds what was not written and
// done says how much was.
func Pwritev(fd int, iovp *[]unix.Iovec, off int64) (done int64, err error) {
	return transfer(unix.SYS_PWRITEV, "pwritev", fd, iovp, off)
}

// Preadv fills all of *iovp from off, as Pwritev writes; end of file
// before the buffers are full is io.ErrUnexpectedEOF.
func Preadv(fd int, iovp *[]unix.Iovec, off int64) (done int64, err error) {
	return transfer(unix.SYS_PREADV, "preadv", fd, iovp, off)
}

func transfer(trap uintptr, name string, fd int, iovp *[]unix.Iovec, off int64) (done int64, err error) {
	iov := *iovp
	defer func() { *iovp = iov }()
	for len(iov) > 0 {
		chunk := iov[:min(len(iov), Max)]
		// The offset goes as two longs, low then high (ignored by 64-bit kernels).
		hi := uintptr(uint64(off) >> (bits.UintSize - 1) >> 1)
		n, _, errno := unix.Syscall6(trap, uintptr(fd), uintptr(unsafe.Pointer(&chunk[0])), uintptr(len(chunk)), uintptr(off), hi, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return done, fmt.Errorf("%s %d bytes at %d: %w", name, Len(chunk), off, errno)
		}
		if n == 0 {
			if trap == unix.SYS_PREADV {
				return done, fmt.Errorf("%s %d bytes at %d: %w", name, Len(chunk), off, io.ErrUnexpectedEOF)
			}
			return done, fmt.Errorf("%s at %d: %w", name, off, io.ErrShortWrite)
		}
		off += int64(n)
		done += int64(n)
		// Drop what was transferred; a short transfer may end inside an iovec.
		for n > 0 {
			if l := uintptr(iov[0].Len); n >= l {
				n -= l
				iov = iov[1:]
				continue
			}
			iov[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(iov[0].Base), n))
			iov[0].SetLen(int(uintptr(iov[0].Len) - n))
			n = 0
		}
	}
	return done, nil
}
