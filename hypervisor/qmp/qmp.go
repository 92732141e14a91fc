// Package qmp is a small QEMU Machine Protocol client: one reader goroutine,
// commands matched to replies by their "id" member, per-command contexts,
// typed errors carrying QMP's error class, and events both on a buffered
// channel and waitable by name with a filter.
package qmp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
)

// ErrClosed reports that the connection to QEMU is gone; commands that were
// still waiting for their reply fail with an error wrapping it.
var ErrClosed = errors.New("qmp: connection closed")

// ErrProtocol reports a malformed message from QEMU.
var ErrProtocol = errors.New("qmp: protocol error")

// DefaultMaxLine bounds one QMP message; query-qmp-schema is a few hundred KiB,
// far above bufio.Scanner's 64 KiB default.
const DefaultMaxLine = 16 << 20

// DefaultEventBuffer is the capacity of the Events channel.
const DefaultEventBuffer = 128

// Error is a QMP error reply.
type Error struct {
	// Command is the command that failed.
	Command string
	// Class is QMP's error class, e.g. "GenericError", "DeviceNotFound", "CommandNotFound".
	Class string
	// Desc is QEMU's human-readable description.
	Desc string
}

// Error formats the command, class and description.
func (e *Error) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// Version is QEMU's version from the QMP greeting.
type Version struct {
	Major   int    `json:"major"`
	Minor   int    `json:"minor"`
	Micro   int    `json:"micro"`
	Package string `json:"-"`
}

// String formats the version as major.minor.micro.
func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Micro) }

// Event is an asynchronous QMP event.
type Event struct {
	Name string
	// Data is the raw "data" member (may be nil).
	Data json.RawMessage
	// Time is QEMU's timestamp of the event.
	Time time.Time
}

// Options tunes a Client; the zero value uses the defaults.
type Options struct {
	// MaxLine bounds one incoming message (default DefaultMaxLine).
	MaxLine int
	// EventBuffer is the Events channel capacity (default DefaultEventBuffer).
	EventBuffer int
}

// Client is a connected, negotiated QMP monitor. All methods are safe for concurrent use.
type Client struct {
	conn    net.Conn
	version Version
	caps    []string
	events  chan Event

	// writeSem holds one token while a command is written: writes must
	// not interleave. A write waits for the one before it, which that
	// command's context bounds, and gives up when its own context ends
	// rather than wait for that bound (QEMU may have stopped reading
	// under a command with no deadline).
	writeSem chan struct{}

	// mu guards the fields below; it and writeSem are never held
	// together. Nothing waits under mu: replies and subscription events
	// go to channels with room for them, and Events() is sent to without
	// blocking.
	mu        sync.Mutex
	nextID    uint64
	pending   map[uint64]chan reply
	waiters   map[*Subscription]struct{}
	dropped   uint64
	closedErr error

	done chan struct{} // closed when the reader goroutine exits
}

type reply struct {
	ret json.RawMessage
	err *Error
}

// wire is one incoming message; exactly one of Return, Error, Event or QMP is set.
type wire struct {
	QMP *struct {
		Version struct {
			QEMU    Version `json:"qemu"`
			Package string  `json:"package"`
		} `json:"version"`
		Capabilities []string `json:"capabilities"`
	} `json:"QMP"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	Event     string          `json:"event"`
	Data      json.RawMessage `json:"data"`
	Timestamp *struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
	ID json.RawMessage `json:"id"`
}

// NewClient reads the greeting on conn, sends qmp_capabilities and starts the
// reader. The client owns conn from then on; on error the caller closes it.
func NewClient(ctx context.Context, conn net.Conn, opts Options) (*Client, error) {
	if opts.MaxLine <= 0 {
		opts.MaxLine = DefaultMaxLine
	}
	if opts.EventBuffer <= 0 {
		opts.EventBuffer = DefaultEventBuffer
	}
	c := &Client{
		conn:     conn,
		events:   make(chan Event, opts.EventBuffer),
		pending:  map[uint64]chan reply{},
		waiters:  map[*Subscription]struct{}{},
		done:     make(chan struct{}),
		writeSem: make(chan struct{}, 1),
	}
	r := bufio.NewReaderSize(conn, 64<<10)

	// The handshake runs synchronously, bounded by ctx through the deadline.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	err := c.handshake(r, opts.MaxLine)
	if !stop() {
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		return nil, err
	}
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("qmp: clear deadline: %w", err)
	}
	go c.readLoop(r, opts.MaxLine)
	return c, nil
}

func (c *Client) handshake(r *bufio.Reader, maxLine int) error {
	line, err := readLine(r, maxLine)
	if err != nil {
		return fmt.Errorf("qmp: read greeting: %w", err)
	}
	var g wire
	if err := json.Unmarshal(line, &g); err != nil || g.QMP == nil {
		return fmt.Errorf("%w: greeting %q", ErrProtocol, truncate(line))
	}
	c.version = g.QMP.Version.QEMU
	c.version.Package = g.QMP.Version.Package
	c.caps = g.QMP.Capabilities
	if err := c.writeMsg(context.Background(), map[string]any{"execute": "qmp_capabilities", "id": 0}); err != nil {
		return err
	}
	// Events cannot arrive before capabilities are negotiated, so the next
	// message is the reply.
	line, err = readLine(r, maxLine)
	if err != nil {
		return fmt.Errorf("qmp: read qmp_capabilities reply: %w", err)
	}
	var m wire
	if err := json.Unmarshal(line, &m); err != nil {
		return fmt.Errorf("%w: qmp_capabilities reply %q", ErrProtocol, truncate(line))
	}
	if m.Error != nil {
		return &Error{Command: "qmp_capabilities", Class: m.Error.Class, Desc: m.Error.Desc}
	}
	if m.Return == nil {
		return fmt.Errorf("%w: qmp_capabilities reply %q", ErrProtocol, truncate(line))
	}
	return nil
}

// readLine reads one newline-terminated message of at most max bytes.
func readLine(r *bufio.Reader, max int) ([]byte, error) {
	var buf []byte
	for {
		chunk, err := r.ReadSlice('\n')
		if len(buf)+len(chunk) > max {
			return nil, fmt.Errorf("%w: message longer than %d bytes", ErrProtocol, max)
		}
		// ReadSlice's result is only valid until the next read: copy it.
		buf = append(buf, chunk...)
		switch {
		case err == nil:
			return bytes.TrimSpace(buf), nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF) && len(bytes.TrimSpace(buf)) > 0:
			return nil, fmt.Errorf("%w: connection closed mid-message", ErrProtocol)
		default:
			return nil, err
		}
	}
}

// Version returns QEMU's version from the greeting.
func (c *Client) Version() Version { return c.version }

// Capabilities returns the capabilities QEMU offered in its greeting.
func (c *Client) Capabilities() []string { return append([]string(nil), c.caps...) }

// Events delivers every event. It is buffered; when the buffer is full new
// events are dropped from it (see Dropped) so a slow consumer never stalls
// replies. It is closed when the connection ends. Use Subscribe/WaitEvent to
// wait for a specific event reliably.
func (c *Client) Events() <-chan Event { return c.events }

// Dropped returns how many events did not fit in the Events buffer.
func (c *Client) Dropped() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dropped
}

// Done is closed when the connection to QEMU has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns why the connection ended, or nil while it is up.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closedErr
}

// Close closes the connection; outstanding commands fail with ErrClosed.
func (c *Client) Close() error {
	err := c.conn.Close()
	<-c.done
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func (c *Client) readLoop(r *bufio.Reader, maxLine int) {
	var err error
	for {
		var line []byte
		line, err = readLine(r, maxLine)
		if err != nil {
			break
		}
		if len(line) == 0 {
			continue
		}
		var m wire
		if jerr := json.Unmarshal(line, &m); jerr != nil {
			err = fmt.Errorf("%w: %v in %q", ErrProtocol, jerr, truncate(line))
			break
		}
		switch {
		case m.Event != "":
			c.dispatchEvent(&m)
		case m.Return != nil || m.Error != nil:
			c.dispatchReply(&m)
		default:
			err = fmt.Errorf("%w: unexpected message %q", ErrProtocol, truncate(line))
		}
		if err != nil {
			break
		}
	}
	c.shutdown(err)
}

func (c *Client) dispatchReply(m *wire) {
	id, perr := strconv.ParseUint(string(m.ID), 10, 64)
	c.mu.Lock()
	ch, ok := c.pending[id]
	if ok {
		delete(c.pending, id)
	}
	c.mu.Unlock()
	// A reply nobody waits for belongs to a cancelled command (or QEMU could
	// not parse our request and had no id to echo): discard it.
	if perr != nil || !ok {
		return
	}
	rep := reply{ret: m.Return}
	if m.Error != nil {
		rep.err = &Error{Class: m.Error.Class, Desc: m.Error.Desc}
	}
	ch <- rep // buffered with capacity 1, never blocks
}

func (c *Client) dispatchEvent(m *wire) {
	ev := Event{Name: m.Event, Data: m.Data}
	if m.Timestamp != nil && m.Timestamp.Seconds >= 0 && m.Timestamp.Microseconds >= 0 && m.Timestamp.Microseconds < 1e6 {
		ev.Time = time.Unix(m.Timestamp.Seconds, m.Timestamp.Microseconds*1000)
	}
	c.mu.Lock()
	for s := range c.waiters {
		if s.match(ev) {
			delete(c.waiters, s)
			s.ch <- ev
		}
	}
	select {
	case c.events <- ev:
	default:
		c.dropped++
	}
	c.mu.Unlock()
}

func (c *Client) shutdown(err error) {
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		err = ErrClosed
	} else {
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	c.conn.Close()
	c.mu.Lock()
	c.closedErr = err
	for id, ch := range c.pending {
		delete(c.pending, id)
		close(ch)
	}
	for s := range c.waiters {
		delete(c.waiters, s)
		close(s.ch)
	}
	close(c.events)
	c.mu.Unlock()
	close(c.done)
}

// writeMsg sends one command line. If ctx ends while QEMU is not reading,
// the write is abandoned; a half-written command would desynchronise the
// stream, so the connection is then closed and every command fails.
func (c *Client) writeMsg(ctx context.Context, msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return fmt.Errorf("qmp: encode command: %w", err)
	}
	b = append(b, '\n')
	select {
	case c.writeSem <- struct{}{}:
	case <-ctx.Done():
		// Nothing was written: the stream is intact for the others.
		return fmt.Errorf("wait for an earlier command's write: %w", ctx.Err())
	}
	defer func() { <-c.writeSem }()
	stop := context.AfterFunc(ctx, func() { c.conn.SetWriteDeadline(time.Unix(1, 0)) })
	_, err = c.conn.Write(b)
	if !stop() {
		c.conn.SetWriteDeadline(time.Time{})
	}
	if err != nil {
		c.conn.Close()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("%w: write abandoned: %w", ErrClosed, ctxErr)
		}
		return fmt.Errorf("%w: write: %w", ErrClosed, err)
	}
	return nil
}

// Execute runs command with args (nil or a JSON object value) and decodes the
// "return" member into result (may be nil). A QMP error is returned as *Error.
// If ctx ends first, Execute returns ctx's error and QEMU's late reply is discarded.
func (c *Client) Execute(ctx context.Context, command string, args any, result any) error {
	raw, err := c.execute(ctx, command, args)
	if err != nil {
		return err
	}
	if result == nil {
		return nil
	}
	if err := json.Unmarshal(raw, result); err != nil {
		return fmt.Errorf("%w: %s reply: %v", ErrProtocol, command, err)
	}
	return nil
}

func (c *Client) execute(ctx context.Context, command string, args any) (json.RawMessage, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	ch := make(chan reply, 1)
	c.mu.Lock()
	if c.closedErr != nil {
		err := c.closedErr
		c.mu.Unlock()
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	c.nextID++
	id := c.nextID
	c.pending[id] = ch
	c.mu.Unlock()

	msg := map[string]any{"execute": command, "id": id}
	if args != nil {
		msg["arguments"] = args
	}
	if err := c.writeMsg(ctx, msg); err != nil {
		c.forget(id)
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("qmp %s: %w", command, c.Err())
		}
		if rep.err != nil {
			rep.err.Command = command
			return nil, rep.err
		}
		return rep.ret, nil
	case <-ctx.Done():
		c.forget(id)
		return nil, fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
}

func (c *Client) forget(id uint64) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// Subscription waits for one event; create it before the action that causes the event.
type Subscription struct {
	c      *Client
	name   string
	filter func(Event) bool
	ch     chan Event
}

func (s *Subscription) match(ev Event) bool {
	return ev.Name == s.name && (s.filter == nil || s.filter(ev))
}

// Subscribe registers interest in the next event called name for which filter
// (nil: any) returns true. Filters run on the reader goroutine and must not
// call back into the client.
func (c *Client) Subscribe(name string, filter func(Event) bool) *Subscription {
	s := &Subscription{c: c, name: name, filter: filter, ch: make(chan Event, 1)}
	c.mu.Lock()
	if c.closedErr != nil {
		close(s.ch)
	} else {
		c.waiters[s] = struct{}{}
	}
	c.mu.Unlock()
	return s
}

// Wait returns the matching event, ctx's error, or an error wrapping ErrClosed.
func (s *Subscription) Wait(ctx context.Context) (Event, error) {
	select {
	case ev, ok := <-s.ch:
		if !ok {
			return Event{}, fmt.Errorf("qmp: waiting for %s: %w", s.name, s.c.Err())
		}
		return ev, nil
	case <-ctx.Done():
		s.Cancel()
		return Event{}, fmt.Errorf("qmp: waiting for %s: %w", s.name, ctx.Err())
	}
}

// Cancel drops the subscription if it has not fired.
func (s *Subscription) Cancel() {
	s.c.mu.Lock()
	delete(s.c.waiters, s)
	s.c.mu.Unlock()
}

// WaitEvent waits for the next event called name matching filter (nil: any).
// Only events arriving after the call are seen; to avoid missing an event
// caused by your own command, Subscribe before sending it.
func (c *Client) WaitEvent(ctx context.Context, name string, filter func(Event) bool) (Event, error) {
	return c.Subscribe(name, filter).Wait(ctx)
}

func truncate(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + "..."
	}
	return string(b)
}
