// Package portfwd is the wire format of kata-fsx's port-forward service:
// a guest vsock port beside the agent's on which the host follows which
// TCP ports the pod listens on, or opens a stream to one of them.
//
// It is kata-fsx's own, not Kata's protocol. containerd's CRI serves a
// port-forward by dialling localhost:PORT inside the pod's network
// namespace on the host, where a VM runtime has only a tap; the shim
// listens there for the guest's ports and carries each connection to the
// guest over this service.
//
// A connection carries one request line and its replies:
//
//	WATCH\n       ->  OK[ <port>]*\n   the guest's listening TCP ports, ascending,
//	                                 then the same line again each time they change,
//	                                 until the host closes
//	TCP <port>\n  ->  OK\n             then the stream, both ways, until each side closes
//	either        ->  ERR <reason>\n   and the connection ends
//
// containerd dials the moment a client asks, and clients such as kubectl
// give up on the first refused connection, so the host must listen for a
// port as soon as the pod's server does: the guest watches its own socket
// table, a cheap read in the guest, and the host waits for its lines.
//
// Both sides read the lines one byte at a time, so nothing after a reply's
// newline (the stream's first bytes) is consumed with it; both bound what
// they read, and the host treats every byte of a reply as hostile.
package portfwd

import (
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
)

// VsockPort is the guest vsock port of the service; the agent's own is
// 1024 and Kata's debug console 1026.
const VsockPort = 1027

// MaxPorts bounds the ports a WATCH reply may name: a pod that listens on
// more has the lowest forwarded.
const MaxPorts = 256

const (
	// maxRequest is longer than "TCP 65535\n".
	maxRequest = 32
	// maxReply holds "OK" and MaxPorts ports of five digits, or an error
	// reason of the same length.
	maxReply = 3 + MaxPorts*6
	// maxReason bounds the reason an ERR reply carries.
	maxReason = 512
)

// Request is one request: Watch, or a stream to Port.
type Request struct {
	// Watch asks for the listening ports and each change of them.
	Watch bool
	// Port is the guest TCP port to open a stream to when Watch is false.
	Port uint16
}

// String is the request's line without its newline.
func (r Request) String() string {
	if r.Watch {
		return "WATCH"
	}
	return "TCP " + strconv.Itoa(int(r.Port))
}

// Marshal returns the request's line.
func (r Request) Marshal() []byte { return []byte(r.String() + "\n") }

// ReadRequest reads and parses one request line.
func ReadRequest(r io.Reader) (Request, error) {
	line, err := readLine(r, maxRequest)
	if err != nil {
		return Request{}, fmt.Errorf("port-forward request: %w", err)
	}
	if line == "WATCH" {
		return Request{Watch: true}, nil
	}
	arg, ok := strings.CutPrefix(line, "TCP ")
	if !ok {
		return Request{}, fmt.Errorf("port-forward request %q: want WATCH or TCP <port>", line)
	}
	p, err := parsePort(arg)
	if err != nil {
		return Request{}, fmt.Errorf("port-forward request %q: %w", line, err)
	}
	return Request{Port: p}, nil
}

// MarshalOK returns a success reply; ports are a WATCH reply's.
func MarshalOK(ports []uint16) []byte {
	var b strings.Builder
	b.WriteString("OK")
	for _, p := range ports {
		b.WriteByte(' ')
		b.WriteString(strconv.Itoa(int(p)))
	}
	b.WriteByte('\n')
	return []byte(b.String())
}

// MarshalError returns an error reply; the reason is cut to what a reply
// may carry and kept on one line.
func MarshalError(reason string) []byte {
	reason = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\r' {
			return ' '
		}
		return r
	}, reason)
	if len(reason) > maxReason {
		reason = reason[:maxReason]
	}
	return []byte("ERR " + reason + "\n")
}

// ErrRefused is wrapped by ReadReply's error for an ERR reply: the guest
// answered but would not do what was asked.
var ErrRefused = errors.New("the guest refused")

// ReadReply reads one reply line. It returns the ports of an OK reply
// (none for a TCP request's), ascending and distinct, at most MaxPorts,
// each from 1 to 65535; an ERR reply's error wraps ErrRefused; anything
// else is an error naming what was wrong.
func ReadReply(r io.Reader) ([]uint16, error) {
	line, err := readLine(r, maxReply)
	if err != nil {
		return nil, fmt.Errorf("port-forward reply: %w", err)
	}
	if reason, ok := strings.CutPrefix(line, "ERR "); ok {
		return nil, fmt.Errorf("%w: %s", ErrRefused, strconv.Quote(reason))
	}
	rest, ok := strings.CutPrefix(line, "OK")
	if !ok {
		return nil, fmt.Errorf("port-forward reply %.64q: want OK or ERR", line)
	}
	if rest == "" {
		return nil, nil
	}
	if rest[0] != ' ' {
		return nil, fmt.Errorf("port-forward reply %.64q: want OK or ERR", line)
	}
	fields := strings.Split(rest[1:], " ")
	if len(fields) > MaxPorts {
		return nil, fmt.Errorf("port-forward reply: %d ports, at most %d", len(fields), MaxPorts)
	}
	ports := make([]uint16, 0, len(fields))
	for _, f := range fields {
		p, err := parsePort(f)
		if err != nil {
			return nil, fmt.Errorf("port-forward reply: %w", err)
		}
		if len(ports) > 0 && p <= ports[len(ports)-1] {
			return nil, fmt.Errorf("port-forward reply: port %d after %d: want distinct ports in ascending order", p, ports[len(ports)-1])
		}
		ports = append(ports, p)
	}
	return slices.Clip(ports), nil
}

// parsePort accepts a decimal port from 1 to 65535 with no sign or
// leading zero.
func parsePort(s string) (uint16, error) {
	if s == "" || len(s) > 5 || s[0] == '0' {
		return 0, fmt.Errorf("port %.8q: want a decimal from 1 to 65535", s)
	}
	for _, c := range []byte(s) {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("port %.8q: want a decimal from 1 to 65535", s)
		}
	}
	n, _ := strconv.Atoi(s)
	if n > 65535 {
		return 0, fmt.Errorf("port %s: want a decimal from 1 to 65535", s)
	}
	return uint16(n), nil
}

// readLine reads up to and including a newline, one byte at a time, and
// returns the line without it; a line longer than limit is an error, not
// a larger allocation.
func readLine(r io.Reader, limit int) (string, error) {
	buf := make([]byte, 0, 64)
	var b [1]byte
	for {
		n, err := r.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				return string(buf), nil
			}
			if len(buf) == limit {
				return "", fmt.Errorf("line longer than %d bytes", limit)
			}
			buf = append(buf, b[0])
			continue
		}
		if errors.Is(err, io.EOF) {
			return "", fmt.Errorf("connection closed after %d bytes of a line: %w", len(buf), io.ErrUnexpectedEOF)
		}
		if err != nil {
			return "", err
		}
	}
}

// Splice copies both ways between a and b until both directions are done,
// passing each side's end of data on as a half-close where the connection
// has one; an error either way closes both, as the other way cannot go on.
func Splice(a, b net.Conn) {
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		defer func() { done <- struct{}{} }()
		if _, err := io.Copy(dst, src); err != nil {
			a.Close()
			b.Close()
			return
		}
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			dst.Close()
		}
	}
	go pipe(a, b)
	go pipe(b, a)
	<-done
	<-done
}
