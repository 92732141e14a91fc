// Package vhostuser serves a virtio-blk device to QEMU over the vhost-user
// protocol (QEMU docs/interop/vhost-user.rst) on a unix socket: QEMU's
// `-chardev socket,path=SOCK -device vhost-user-blk-pci,chardev=...`
// connects, shares guest RAM (which must be share=on), and this backend
// processes the virtqueues in-process, one goroutine per started queue.
//
// One front-end connection is served at a time; when it goes away (QEMU
// quits or reconnects) queues stop, guest memory is unmapped, descriptors
// are closed and the next connection is accepted.
//
// Typical use, with the copy-on-write overlay as the device:
//
//	dev, err := overlay.Open(base, size, "/var/lib/kata-fsx/<sandbox>/disk.overlay", overlay.Options{Serial: id})
//	srv, err := vhostuser.Serve(ctx, "/run/kata-fsx/<sandbox>/blk/disk.sock", dev, vhostuser.Options{NumQueues: vcpus})
//	// qemu ... -object memory-backend-memfd,...,share=on -numa node,memdev=...
//	//      -chardev socket,id=c,path=/run/kata-fsx/<sandbox>/blk/disk.sock
//	//      -device vhost-user-blk-pci,chardev=c,num-queues=<vcpus>
//	defer srv.Close()
//	defer dev.Close()
//
// Supported: VERSION_1, INDIRECT_DESC, EVENT_IDX, BLK_F_SEG_MAX, BLK_SIZE,
// FLUSH, MQ, DISCARD, WRITE_ZEROES (RO instead of the last two when the
// device is read-only); protocol features MQ, REPLY_ACK, CONFIG,
// CONFIGURE_MEM_SLOTS. Not supported: inflight tracking
// (GET/SET_INFLIGHT_FD), dirty logging (migration), backend requests,
// polling mode without a kick eventfd.
package vhostuser

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/kata-fsx/kata-fsx/virtio/virtq"
)

// errProtocol marks a message that violates the protocol; the connection is dropped.
var errProtocol = errors.New("vhost-user protocol error")

// Defaults for Options fields left zero.
const (
	DefaultNumQueues        = 8
	DefaultSegMax           = 126
	DefaultLogicalBlockSize = 512
	DefaultMaxRequestBytes  = 32 << 20
	defaultMaxDiscard       = 1 << 21 // sectors (1 GiB)
	defaultMaxDiscardSeg    = 32
)

// Options tune Serve; zero values pick the defaults.
type Options struct {
	// NumQueues is the most queues the device offers (GET_QUEUE_NUM, config
	// num_queues); QEMU's num-queues must not exceed it. Default 8.
	NumQueues int
	// SegMax is the most data segments per request (config seg_max). Default 126.
	SegMax int
	// LogicalBlockSize is reported as blk_size (512 or a larger power of two). Default 512.
	LogicalBlockSize int
	// DiscardAlignment is the discard granularity in bytes (config
	// discard_sector_alignment); default 4096, the overlay's block size.
	DiscardAlignment int
	// MaxRequestBytes caps the data of one read or write request; larger
	// requests fail with IOERR. Default 32 MiB.
	MaxRequestBytes int
	// Logf receives diagnostics (protocol errors, broken queues); nil discards them.
	Logf func(format string, args ...any)
}

// Stats counts connections for monitoring and tests.
type Stats struct {
	// Connections is the number of front-end connections accepted.
	Connections uint64
	// Disconnects is the number of connections fully torn down.
	Disconnects uint64
	// LastError is why the most recent connection ended (nil for a clean hang-up).
	LastError error
}

// Server is a running vhost-user-blk backend.
type Server struct {
	ln   *net.UnixListener
	path string
	dev  BlockDevice
	cfg  blkConfig
	opts Options

	mu     sync.Mutex
	cur    *net.UnixConn
	closed bool
	stats  Stats
	change chan struct{} // closed and replaced whenever stats change

	counts [len(specs)]atomic.Uint64 // requests handled, by request number

	done chan struct{}
}

// Serve listens on socketPath and serves dev until ctx ends or Close is
// called. The socket's directory is created mode 0700 if missing; if it
// exists it must be a directory owned by this user and not writable by
// group or others, because the socket itself grants full access to the
// disk and the directory is what keeps other users out. The socket is
// created mode 0600.
func Serve(ctx context.Context, socketPath string, dev BlockDevice, opts Options) (*Server, error) {
	if dev == nil {
		return nil, errors.New("vhostuser: nil device")
	}
	cfg, err := buildConfig(dev, &opts)
	if err != nil {
		return nil, err
	}
	if err := prepareDir(filepath.Dir(socketPath)); err != nil {
		return nil, err
	}
	if err := removeStaleSocket(socketPath); err != nil {
		return nil, err
	}
	ln, err := listen(socketPath)
	if err != nil {
		return nil, err
	}
	s := &Server{ln: ln, path: socketPath, dev: dev, cfg: cfg, opts: opts, done: make(chan struct{}), change: make(chan struct{})}
	go s.acceptLoop()
	go func() {
		select {
		case <-ctx.Done():
			s.Close()
		case <-s.done:
		}
	}()
	return s, nil
}

func buildConfig(dev BlockDevice, o *Options) (blkConfig, error) {
	if o.NumQueues == 0 {
		o.NumQueues = DefaultNumQueues
	}
	if o.SegMax == 0 {
		o.SegMax = DefaultSegMax
	}
	if o.LogicalBlockSize == 0 {
		o.LogicalBlockSize = DefaultLogicalBlockSize
	}
	if o.DiscardAlignment == 0 {
		o.DiscardAlignment = 4096
	}
	if o.MaxRequestBytes == 0 {
		o.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	switch {
	case o.NumQueues < 1 || o.NumQueues > 256:
		return blkConfig{}, fmt.Errorf("vhostuser: %d queues, want 1..256", o.NumQueues)
	case o.SegMax < 1 || o.SegMax > virtq.MaxSize:
		return blkConfig{}, fmt.Errorf("vhostuser: seg_max %d out of range", o.SegMax)
	case o.LogicalBlockSize < 512 || o.LogicalBlockSize&(o.LogicalBlockSize-1) != 0 || o.LogicalBlockSize > 1<<16:
		return blkConfig{}, fmt.Errorf("vhostuser: logical block size %d is not a power of two in 512..65536", o.LogicalBlockSize)
	case o.DiscardAlignment < 512 || o.DiscardAlignment%512 != 0:
		return blkConfig{}, fmt.Errorf("vhostuser: discard alignment %d is not a multiple of 512", o.DiscardAlignment)
	case o.MaxRequestBytes < 4096 || o.MaxRequestBytes > 1<<30:
		return blkConfig{}, fmt.Errorf("vhostuser: max request %d out of range", o.MaxRequestBytes)
	}
	size := dev.Size()
	if size <= 0 || size%int64(o.LogicalBlockSize) != 0 {
		return blkConfig{}, fmt.Errorf("vhostuser: device size %d is not a positive multiple of %d", size, o.LogicalBlockSize)
	}
	return blkConfig{
		capacity:          uint64(size) / sectorSize,
		segMax:            uint32(o.SegMax),
		blkSize:           uint32(o.LogicalBlockSize),
		numQueues:         uint16(o.NumQueues),
		maxDiscardSectors: defaultMaxDiscard,
		maxDiscardSeg:     defaultMaxDiscardSeg,
		discardAlign:      uint32(o.DiscardAlignment / sectorSize),
		maxWZSectors:      defaultMaxDiscard,
		maxWZSeg:          defaultMaxDiscardSeg,
		maxRequestBytes:   uint64(o.MaxRequestBytes),
		readOnly:          dev.ReadOnly(),
	}, nil
}

func prepareDir(dir string) error {
	err := os.Mkdir(dir, 0o700)
	if err == nil {
		return nil
	}
	if !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("vhostuser: create socket directory: %w", err)
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("vhostuser: socket directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("vhostuser: socket directory %s is not a directory", dir)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("vhostuser: socket directory %s is not owned by uid %d", dir, os.Geteuid())
	}
	if st.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("vhostuser: socket directory %s is writable by group or others (%v)", dir, st.Mode().Perm())
	}
	return nil
}

func removeStaleSocket(path string) error {
	st, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vhostuser: socket path: %w", err)
	}
	if st.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("vhostuser: %s exists and is not a socket", path)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("vhostuser: remove stale socket: %w", err)
	}
	return nil
}

// listen binds with a restrictive umask so the socket is never, even
// briefly, accessible to others. The umask is process-wide; it is restored
// right after bind, and the directory check above is the real guard.
func listen(path string) (*net.UnixListener, error) {
	old := syscall.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("vhostuser: listen: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("vhostuser: chmod socket: %w", err)
	}
	return ln, nil
}

// Path returns the socket path.
func (s *Server) Path() string { return s.path }

// Stats returns connection counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// WaitStats blocks until cond holds for the current stats or ctx ends.
func (s *Server) WaitStats(ctx context.Context, cond func(Stats) bool) (Stats, error) {
	for {
		s.mu.Lock()
		st, ch := s.stats, s.change
		s.mu.Unlock()
		if cond(st) {
			return st, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return st, ctx.Err()
		}
	}
}

func (s *Server) bump(f func(*Stats)) {
	s.mu.Lock()
	f(&s.stats)
	close(s.change)
	s.change = make(chan struct{})
	s.mu.Unlock()
}

func (s *Server) acceptLoop() {
	defer close(s.done)
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if !closed {
				s.opts.Logf("vhostuser: accept: %v", err)
			}
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.cur = c
		s.mu.Unlock()
		s.bump(func(st *Stats) { st.Connections++ })

		sess := newSession(s, c)
		err = sess.serve()
		sess.teardown()
		c.Close()
		s.mu.Lock()
		s.cur = nil
		closing := s.closed
		s.mu.Unlock()
		if err != nil && !closing {
			s.opts.Logf("vhostuser: connection ended: %v", err)
		}
		s.bump(func(st *Stats) { st.Disconnects++; st.LastError = err })
	}
}

// Close stops accepting, drops the current connection (stopping its queues
// and unmapping guest memory) and waits for everything to finish.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return nil
	}
	s.closed = true
	cur := s.cur
	s.mu.Unlock()
	err := s.ln.Close()
	if cur != nil {
		cur.Close()
	}
	<-s.done
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("vhostuser: close listener: %w", err)
	}
	return nil
}

// countSummary lists the requests handled so far (diagnostics).
func (s *Server) countSummary() string {
	var b []byte
	for i := range s.counts {
		if n := s.counts[i].Load(); n > 0 {
			b = fmt.Appendf(b, "%v=%d ", request(i), n)
		}
	}
	return string(b)
}
