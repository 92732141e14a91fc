// Package vhostuser is the device-generic server side of the vhost-user
// protocol (QEMU docs/interop/vhost-user.rst): it listens on a unix socket,
// accepts one front-end (QEMU) at a time, checks every message through one
// gate (acked protocol features, exact sizes, attached descriptors),
// negotiates features, maps the guest memory QEMU shares (which must be
// share=on), sets up the vrings and hands each started queue to a Device,
// which processes it on a goroutine the server owns.
//
// A Device is what differs between virtio devices: its feature bits, its
// configuration space, its number of queues and what it does with a
// queue's descriptor chains. blk/vhostblk (virtio-blk) and vsock (virtio
// socket) are the devices built on this package.
//
// When the front-end goes away (QEMU quits or reconnects) every queue
// stops, the device's Disconnect runs, guest memory is unmapped, the
// received descriptors are closed and the next connection is accepted.
//
// The core offers VERSION_1, INDIRECT_DESC, EVENT_IDX and the protocol
// features MQ, REPLY_ACK, CONFIG and CONFIGURE_MEM_SLOTS. Not supported:
// inflight tracking (GET/SET_INFLIGHT_FD), dirty logging (migration),
// backend requests, SET_CONFIG (configuration spaces are read-only), and
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
)

// ErrProtocol marks a message that violates the protocol; the connection is dropped.
var ErrProtocol = errors.New("vhost-user protocol error")

// Device is the virtio device a Server serves. The server calls its methods
// from the session goroutine, except RunQueue, which runs on a goroutine of
// its own per started queue; implementations must allow RunQueue of
// different queues to run at the same time.
type Device interface {
	// Features returns the device-specific virtio feature bits to offer;
	// the server adds VERSION_1, INDIRECT_DESC, EVENT_IDX and
	// VHOST_USER_F_PROTOCOL_FEATURES.
	Features() uint64
	// NumQueues returns how many virtqueues the device has (1..256).
	NumQueues() int
	// ReadConfig copies the configuration space starting at byte offset
	// into p, which arrives zeroed: bytes past the device's configuration
	// are left zero. offset+len(p) never exceeds 256.
	ReadConfig(offset uint32, p []byte)
	// RunQueue processes q until q.Done() is closed, finishes or abandons
	// what it popped (pushing used entries only before it returns), and
	// returns. Nothing the queue uses is changed or unmapped until it has
	// returned. It may return early when the queue breaks.
	RunQueue(q *Queue)
	// Disconnect tells the device that the front-end connection ended:
	// every RunQueue has returned and guest memory is about to be
	// unmapped. State tied to the guest's view of the device is lost.
	Disconnect()
}

// Options tune Serve; zero values pick the defaults.
type Options struct {
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

// Server is a running vhost-user backend serving one Device.
type Server struct {
	ln   *net.UnixListener
	path string
	dev  Device
	opts Options

	// offered is every virtio feature bit of the device, the core's included.
	offered   uint64
	numQueues int

	// mu guards the fields below. It is taken with no other lock held and
	// never held across a session, a wait or I/O: Close takes the current
	// connection under it and closes it, and waits for the accept loop,
	// after releasing it.
	mu     sync.Mutex
	cur    *net.UnixConn
	closed bool
	stats  Stats
	change chan struct{} // closed and replaced whenever stats change

	counts [len(specs)]atomic.Uint64 // requests handled, by request number

	done chan struct{}
}

// coreFeatures are the transport features every device gets.
const coreFeatures = 1<<FeatVersion1 | 1<<FeatIndirectDesc | 1<<FeatEventIdx | 1<<FeatProtocolFeatures

// Serve listens on socketPath and serves dev until ctx ends or Close is
// called. The socket's directory is created mode 0700 if missing; if it
// exists it must be a directory owned by this user and not writable by
// group or others, because the socket itself grants full access to the
// device and the directory is what keeps other users out. The socket is
// created mode 0600.
func Serve(ctx context.Context, socketPath string, dev Device, opts Options) (*Server, error) {
	s, err := newServer(dev, opts)
	if err != nil {
		return nil, err
	}
	ln, err := Listen(socketPath)
	if err != nil {
		return nil, err
	}
	s.ln, s.path = ln, socketPath
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

// newServer checks the device and builds a server without a listener.
func newServer(dev Device, opts Options) (*Server, error) {
	if dev == nil {
		return nil, errors.New("vhostuser: nil device")
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	n := dev.NumQueues()
	if n < 1 || n > 256 {
		return nil, fmt.Errorf("vhostuser: device has %d queues, want 1..256", n)
	}
	return &Server{dev: dev, opts: opts, offered: dev.Features() | coreFeatures, numQueues: n,
		done: make(chan struct{}), change: make(chan struct{})}, nil
}

// Listen creates a unix socket for a device's clients with Serve's checks:
// the directory is created mode 0700 or must be owned by this user and
// not writable by group or others, a stale socket is replaced (any other
// file is refused), and the socket is mode 0600. The listener removes the
// socket when closed.
func Listen(socketPath string) (*net.UnixListener, error) {
	if err := prepareDir(filepath.Dir(socketPath)); err != nil {
		return nil, err
	}
	if err := removeStaleSocket(socketPath); err != nil {
		return nil, err
	}
	return listen(socketPath)
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

// Device returns the device the server serves, for its own counters.
func (s *Server) Device() Device { return s.dev }

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

// Done is closed once the server has stopped (Close, or ctx ended) and
// its last connection is torn down.
func (s *Server) Done() <-chan struct{} { return s.done }

// Requests returns how many requests of kind r the server has handled.
func (s *Server) Requests(r Request) uint64 {
	if uint64(r) >= uint64(len(s.counts)) {
		return 0
	}
	return s.counts[r].Load()
}

// RequestSummary lists the requests handled so far (diagnostics).
func (s *Server) RequestSummary() string {
	var b []byte
	for i := range s.counts {
		if n := s.counts[i].Load(); n > 0 {
			b = fmt.Appendf(b, "%v=%d ", Request(i), n)
		}
	}
	return string(b)
}
