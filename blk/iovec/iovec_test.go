package iovec

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func split(rng *rand.Rand, data []byte) [][]byte {
	var out [][]byte
	for len(data) > 0 {
		n := min(len(data), rng.IntN(600))
		out = append(out, data[:n:n])
		data = data[n:]
	}
	return out
}

// TestPwritevPreadvRoundTrip moves more buffers than one system call takes
// (Max), of random sizes including empty ones, both ways through a file.
func TestPwritevPreadvRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 700_000)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	bufs := split(rng, data)
	if len(bufs) <= Max {
		t.Fatalf("only %d buffers: the test must cross the %d-iovec limit", len(bufs), Max)
	}
	c := NewCursor(bufs)
	iov := c.Iovecs(nil, int64(len(data)))
	if n, err := Pwritev(int(f.Fd()), &iov, 100); err != nil || n != int64(len(data)) || len(iov) != 0 {
		t.Fatalf("Pwritev = %d, %v, %d iovecs left", n, err, len(iov))
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[100:], data) || !bytes.Equal(got[:100], make([]byte, 100)) {
		t.Fatal("file differs from what Pwritev wrote")
	}

	back := split(rng, make([]byte, len(data)))
	c = NewCursor(back)
	iov = c.Iovecs(nil, int64(len(data)))
	if n, err := Preadv(int(f.Fd()), &iov, 100); err != nil || n != int64(len(data)) {
		t.Fatalf("Preadv = %d, %v", n, err)
	}
	if !bytes.Equal(bytes.Join(back, nil), data) {
		t.Fatal("Preadv read other bytes")
	}

	// Past the end of the file: what exists, then ErrUnexpectedEOF.
	tail := make([]byte, 300)
	iov = []unix.Iovec{{Base: &tail[0]}}
	iov[0].SetLen(len(tail))
	n, err := Preadv(int(f.Fd()), &iov, int64(len(got))-50)
	if n != 50 || !errors.Is(err, io.ErrUnexpectedEOF) || !bytes.Equal(tail[:50], data[len(data)-50:]) {
		t.Fatalf("Preadv at the end = %d, %v", n, err)
	}
	if len(iov) != 1 || iov[0].Len != 250 {
		t.Fatalf("after a short read %d iovecs remain (first %d bytes), want the 250 unread bytes", len(iov), iov[0].Len)
	}
	iov = []unix.Iovec{{Base: &tail[0]}}
	iov[0].SetLen(1)
	if _, err := Preadv(-1, &iov, 0); !errors.Is(err, unix.EBADF) {
		t.Fatalf("Preadv on a bad fd: %v", err)
	}
}

func TestCursor(t *testing.T) {
	bufs := [][]byte{make([]byte, 3), {}, make([]byte, 5), make([]byte, 2)}
	c := NewCursor(bufs)
	c.CopyIn([]byte("abcd"))
	c.Zero(2)
	c.CopyIn([]byte("wxyz"))
	if got := string(bytes.Join(bufs, nil)); got != "abcd\x00\x00wxyz" {
		t.Fatalf("buffers hold %q", got)
	}
	c = NewCursor(bufs)
	out := make([]byte, 7)
	c.CopyOut(out)
	if string(out) != "abcd\x00\x00w" {
		t.Fatalf("CopyOut gave %q", out)
	}
	if b := c.Next(10); string(b) != "x" {
		t.Fatalf("Next after 7 bytes = %q, want the rest of the third buffer", b)
	}
	iov := c.Iovecs(nil, 2)
	if len(iov) != 1 || Len(iov) != 2 {
		t.Fatalf("Iovecs = %d iovecs of %d bytes", len(iov), Len(iov))
	}
}
