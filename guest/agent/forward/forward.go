// Package forward serves the host's port-forward requests in the guest
// (agent/portfwd): it lists the pod's listening TCP ports from the
// kernel's socket tables and opens streams to them. The pod's containers
// share the guest's network namespace, so the agent reaches every one of
// their listeners from where it runs.
package forward

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kata-fsx/kata-fsx/agent/portfwd"
)

const (
	// requestWait bounds how long a connection may take to send its
	// request line.
	requestWait = 10 * time.Second
	// dialWait bounds the dial of a guest listener.
	dialWait = 10 * time.Second
	// tcpListen is the TCP_LISTEN state in /proc/net/tcp.
	tcpListen = "0A"
	// DefaultWatchInterval is how often a watch reads the socket tables:
	// a server's port is forwarded within about this long of its listen.
	DefaultWatchInterval = 100 * time.Millisecond
)

// Server answers port-forward connections.
type Server struct {
	// Tables are the kernel's TCP socket tables; nil means /proc/net/tcp
	// and /proc/net/tcp6.
	Tables []string
	// Logf logs what goes wrong; nil means log.Printf.
	Logf func(format string, args ...any)
	// WatchInterval is how often a watch reads the tables; zero means
	// DefaultWatchInterval.
	WatchInterval time.Duration
}

// Serve answers connections from l until l is closed or ctx ends.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("port-forward: accept: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.handle(ctx, c)
		}()
	}
}

func (s *Server) logf(format string, args ...any) {
	if s.Logf != nil {
		s.Logf(format, args...)
		return
	}
	log.Printf(format, args...)
}

func (s *Server) tables() []string {
	if s.Tables != nil {
		return s.Tables
	}
	return []string{"/proc/net/tcp", "/proc/net/tcp6"}
}

func (s *Server) handle(ctx context.Context, c net.Conn) {
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(requestWait))
	req, err := portfwd.ReadRequest(c)
	_ = c.SetReadDeadline(time.Time{})
	if err != nil {
		s.logf("port-forward: %v", err)
		_, _ = c.Write(portfwd.MarshalError(err.Error()))
		return
	}
	if req.Watch {
		s.watch(ctx, c)
		return
	}
	ls, err := Listeners(s.tables())
	if err != nil {
		s.logf("port-forward: %v", err)
		_, _ = c.Write(portfwd.MarshalError(err.Error()))
		return
	}
	dctx, cancel := context.WithTimeout(ctx, dialWait)
	conn, err := dialListener(dctx, ls, req.Port)
	cancel()
	if err != nil {
		_, _ = c.Write(portfwd.MarshalError(err.Error()))
		return
	}
	defer conn.Close()
	if _, err := c.Write(portfwd.MarshalOK(nil)); err != nil {
		return
	}
	portfwd.Splice(c, conn)
}

// watch writes the listening ports, then again each time they change,
// until the host closes the connection or a write fails.
func (s *Server) watch(ctx context.Context, c net.Conn) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		// The host sends nothing more: a read returns only when it closes.
		_, _ = c.Read(make([]byte, 1))
		cancel()
	}()
	every := s.WatchInterval
	if every <= 0 {
		every = DefaultWatchInterval
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var last []uint16
	for first := true; ; first = false {
		ls, err := Listeners(s.tables())
		if err != nil {
			s.logf("port-forward: %v", err)
			_, _ = c.Write(portfwd.MarshalError(err.Error()))
			return
		}
		if ports := Ports(ls); first || !slices.Equal(ports, last) {
			if _, err := c.Write(portfwd.MarshalOK(ports)); err != nil {
				return
			}
			last = ports
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Listener is a TCP socket in the LISTEN state.
type Listener struct {
	Addr netip.AddrPort
}

// Listeners reads the listening sockets of the given socket tables
// (/proc/net/tcp's format); a table that does not exist (no IPv6) is
// skipped.
func Listeners(tables []string) ([]Listener, error) {
	var out []Listener
	for _, path := range tables {
		f, err := os.Open(path)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listening sockets: %w", err)
		}
		ls, err := ParseTable(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("listening sockets: %s: %w", path, err)
		}
		out = append(out, ls...)
	}
	return out, nil
}

// ParseTable reads the LISTEN entries of one socket table: a header line,
// then per socket "sl local_address rem_address st ...", where an address
// is the IP's bytes in hex, each 32-bit word in the host's (little-endian)
// order, a colon and the port in hex.
func ParseTable(r io.Reader) ([]Listener, error) {
	sc := bufio.NewScanner(r)
	var out []Listener
	for first := true; sc.Scan(); first = false {
		f := strings.Fields(sc.Text())
		if first || len(f) < 4 || f[3] != tcpListen {
			continue
		}
		ap, err := parseAddr(f[1])
		if err != nil {
			return nil, err
		}
		out = append(out, Listener{Addr: ap})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

func parseAddr(s string) (netip.AddrPort, error) {
	ipHex, portHex, ok := strings.Cut(s, ":")
	if !ok || len(portHex) != 4 || (len(ipHex) != 8 && len(ipHex) != 32) {
		return netip.AddrPort{}, fmt.Errorf("socket address %q", s)
	}
	raw, err := hex.DecodeString(ipHex)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("socket address %q: %w", s, err)
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("socket address %q: %w", s, err)
	}
	// Each 32-bit word is printed as the host holds it: reverse its bytes.
	for w := 0; w < len(raw); w += 4 {
		raw[w], raw[w+1], raw[w+2], raw[w+3] = raw[w+3], raw[w+2], raw[w+1], raw[w]
	}
	ip, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(ip.Unmap(), uint16(port)), nil
}

// Ports are the distinct ports of ls, ascending, at most portfwd.MaxPorts.
func Ports(ls []Listener) []uint16 {
	var ports []uint16
	for _, l := range ls {
		if l.Addr.Port() != 0 {
			ports = append(ports, l.Addr.Port())
		}
	}
	slices.Sort(ports)
	ports = slices.Compact(ports)
	if len(ports) > portfwd.MaxPorts {
		ports = ports[:portfwd.MaxPorts]
	}
	return ports
}

// dialListener connects to port as the pod's own loopback would reach
// it: 127.0.0.1 or ::1 for a wildcard or loopback listener, else the one
// address the listener is bound to.
func dialListener(ctx context.Context, ls []Listener, port uint16) (net.Conn, error) {
	var targets []netip.AddrPort
	add := func(a netip.Addr) {
		ap := netip.AddrPortFrom(a, port)
		if !slices.Contains(targets, ap) {
			targets = append(targets, ap)
		}
	}
	for _, l := range ls {
		if l.Addr.Port() != port {
			continue
		}
		a := l.Addr.Addr()
		switch {
		case a.Is4() && (a.IsUnspecified() || a.IsLoopback()):
			add(netip.AddrFrom4([4]byte{127, 0, 0, 1}))
		case a.IsUnspecified() || a.IsLoopback():
			add(netip.IPv6Loopback())
		default:
			add(a)
		}
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("nothing in the pod listens on TCP port %d", port)
	}
	// Loopback first: that is what a client inside the pod would use.
	slices.SortStableFunc(targets, func(x, y netip.AddrPort) int {
		return boolInt(!x.Addr().IsLoopback()) - boolInt(!y.Addr().IsLoopback())
	})
	var errs []error
	var d net.Dialer
	for _, t := range targets {
		c, err := d.DialContext(ctx, "tcp", t.String())
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
