package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// hangLimit bounds waits that only a broken client would make block for
// ever (a lost reply, an ignored cancellation, a missed close); it is a
// failure message, not a speed assertion.
const hangLimit = 10 * time.Second

// recvWithin returns what ch delivers (or its closing), failing the test
// with what if nothing comes within hangLimit.
func recvWithin[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangLimit):
	}
	t.Fatalf("%s within %v", what, hangLimit)
	var zero T
	return zero
}

// bounded is a context that ends after hangLimit, for calls that would
// otherwise wait for ever on a reply the client lost.
func bounded(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	t.Cleanup(cancel)
	return ctx
}

const greeting = `{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "Debian 1:7.2+dfsg-7"}, "capabilities": ["oob"]}}`

// fakeMonitor is a scripted QMP server on one end of a unix socketpair (a
// fake: the real QEMU is exercised in real_test.go). Script failures are
// reported with t.Errorf, which is safe off the test goroutine.
type fakeMonitor struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
	wg   sync.WaitGroup
}

type command struct {
	Execute   string          `json:"execute"`
	Arguments json.RawMessage `json:"arguments"`
	ID        json.RawMessage `json:"id"`
}

func socketpair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	return conns[0], conns[1]
}

func newFake(t *testing.T) (*fakeMonitor, net.Conn) {
	server, client := socketpair(t)
	f := &fakeMonitor{t: t, conn: server, r: bufio.NewReader(server)}
	t.Cleanup(func() {
		scripts := make(chan struct{})
		go func() { f.wg.Wait(); close(scripts) }()
		select {
		case <-scripts:
		case <-time.After(hangLimit):
			t.Errorf("fake monitor script still running %v after the test (waiting for a command the client never sent?)", hangLimit)
			server.Close() // ends the script's read
			select {
			case <-scripts:
			case <-time.After(hangLimit):
			}
		}
		server.Close()
		client.Close()
	})
	return f, client
}

// run executes script concurrently with the test.
func (f *fakeMonitor) run(script func(f *fakeMonitor)) {
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		script(f)
	}()
}

func (f *fakeMonitor) send(s string) {
	if _, err := f.conn.Write([]byte(s + "\r\n")); err != nil {
		f.t.Errorf("fake: write: %v", err)
	}
}

func (f *fakeMonitor) recv(want string) command {
	line, err := f.r.ReadBytes('\n')
	if err != nil {
		f.t.Errorf("fake: waiting for %s: %v", want, err)
		return command{}
	}
	var c command
	if err := json.Unmarshal(line, &c); err != nil {
		f.t.Errorf("fake: bad command %q: %v", line, err)
	}
	if c.Execute != want {
		f.t.Errorf("fake: got command %q, want %q", c.Execute, want)
	}
	if len(c.ID) == 0 {
		f.t.Errorf("fake: command %s without id", c.Execute)
	}
	return c
}

func (f *fakeMonitor) reply(c command, ret string) {
	f.send(fmt.Sprintf(`{"return": %s, "id": %s}`, ret, c.ID))
}

func (f *fakeMonitor) handshake() {
	f.send(greeting)
	f.reply(f.recv("qmp_capabilities"), "{}")
}

func connect(t *testing.T, f *fakeMonitor, client net.Conn, opts Options) *Client {
	t.Helper()
	f.run((*fakeMonitor).handshake)
	c, err := NewClient(context.Background(), client, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestHandshakeAndQueryStatus(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	if v := c.Version(); v.String() != "7.2.22" || v.Package != "Debian 1:7.2+dfsg-7" {
		t.Errorf("version %+v", v)
	}
	if caps := c.Capabilities(); len(caps) != 1 || caps[0] != "oob" {
		t.Errorf("caps %v", caps)
	}
	f.run(func(f *fakeMonitor) {
		f.reply(f.recv("query-status"), `{"status": "prelaunch", "singlestep": false, "running": false}`)
	})
	st, err := c.QueryStatus(context.Background())
	if err != nil || st.Status != "prelaunch" || st.Running {
		t.Fatalf("status %+v %v", st, err)
	}
}

func TestRepliesMatchedByID(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	// The fake answers the second command first; each caller must still get its own reply.
	gotFirst := make(chan command, 1)
	f.run(func(f *fakeMonitor) {
		a := f.recv("cmd-a")
		gotFirst <- a
		b := f.recv("cmd-b")
		f.reply(b, `"b"`)
		f.reply(a, `"a"`)
	})
	var wg sync.WaitGroup
	results := make([]string, 2)
	errs := make([]error, 2)
	ctx := bounded(t)
	wg.Add(1)
	go func() {
		defer wg.Done()
		errs[0] = c.Execute(ctx, "cmd-a", nil, &results[0])
	}()
	recvWithin(t, gotFirst, "the fake did not receive cmd-a") // cmd-a is on the wire before cmd-b
	errs[1] = c.Execute(ctx, "cmd-b", nil, &results[1])
	wg.Wait()
	if errs[0] != nil || errs[1] != nil || results[0] != "a" || results[1] != "b" {
		t.Fatalf("results %v errs %v", results, errs)
	}
}

func TestErrorClass(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	f.run(func(f *fakeMonitor) {
		cmd := f.recv("device_del")
		var args struct{ ID string }
		json.Unmarshal(cmd.Arguments, &args)
		if args.ID != "nope" {
			f.t.Errorf("args %s", cmd.Arguments)
		}
		f.send(fmt.Sprintf(`{"error": {"class": "DeviceNotFound", "desc": "Device 'nope' not found"}, "id": %s}`, cmd.ID))
	})
	err := c.DeviceDel(context.Background(), "nope")
	var qe *Error
	if !errors.As(err, &qe) || qe.Class != "DeviceNotFound" || qe.Command != "device_del" || !strings.Contains(qe.Desc, "nope") {
		t.Fatalf("err = %#v", err)
	}
}

func TestCancelledCommandLateReplyDiscarded(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	received := make(chan command, 1)
	release := make(chan struct{})
	f.run(func(f *fakeMonitor) {
		slow := f.recv("slow")
		received <- slow
		<-release
		// The late reply to the cancelled command comes first and must not
		// be mistaken for the reply to "fast".
		f.reply(slow, `"late"`)
		f.reply(f.recv("fast"), `"fast"`)
	})
	errc := make(chan error, 1)
	go func() { errc <- c.Execute(ctx, "slow", nil, nil) }()
	recvWithin(t, received, "the fake did not receive slow")
	cancel()
	if err := recvWithin(t, errc, "Execute did not return after its context was cancelled"); !errors.Is(err, context.Canceled) {
		t.Fatalf("slow: %v", err)
	}
	close(release)
	var got string
	if err := c.Execute(bounded(t), "fast", nil, &got); err != nil || got != "fast" {
		t.Fatalf("fast = %q, %v", got, err)
	}
}

func TestDeviceDelWaitsForItsEvent(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	f.run(func(f *fakeMonitor) {
		cmd := f.recv("device_del")
		// The event for our device arrives before the reply: the
		// subscription made before sending must still catch it.
		f.send(`{"timestamp": {"seconds": 1700000000, "microseconds": 5}, "event": "DEVICE_DELETED", "data": {"device": "other", "path": "/machine/peripheral/other"}}`)
		f.send(`{"timestamp": {"seconds": 1700000001, "microseconds": 5}, "event": "DEVICE_DELETED", "data": {"device": "blk1", "path": "/machine/peripheral/blk1"}}`)
		f.reply(cmd, "{}")
	})
	if err := c.DeviceDel(bounded(t), "blk1"); err != nil {
		t.Fatal(err)
	}
	// Both events are also on the Events channel, in order.
	for _, want := range []string{"other", "blk1"} {
		ev := recvWithin(t, c.Events(), "no DEVICE_DELETED for "+want+" on the Events channel")
		var d struct{ Device string }
		if err := json.Unmarshal(ev.Data, &d); err != nil || ev.Name != "DEVICE_DELETED" || d.Device != want || ev.Time.IsZero() {
			t.Errorf("event %+v (%v), want device %s", ev, err, want)
		}
	}
}

func TestWaitEventFilterAndCancel(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	sub := c.Subscribe("SHUTDOWN", func(ev Event) bool { return strings.Contains(string(ev.Data), `"guest": true`) })
	f.run(func(f *fakeMonitor) {
		f.send(`{"event": "SHUTDOWN", "data": {"guest": false, "reason": "host-qmp-quit"}}`)
		f.send(`{"event": "STOP"}`)
		f.send(`{"event": "SHUTDOWN", "data": {"guest": true, "reason": "guest-shutdown"}}`)
	})
	ev, err := sub.Wait(bounded(t))
	if err != nil || !strings.Contains(string(ev.Data), "guest-shutdown") {
		t.Fatalf("ev %+v %v", ev, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.WaitEvent(ctx, "NEVER", nil); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled wait: %v", err)
	}
}

func TestLargeLine(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	big := strings.Repeat("x", 3<<20)
	f.run(func(f *fakeMonitor) { f.reply(f.recv("query-qmp-schema"), `"`+big+`"`) })
	var got string
	if err := c.Execute(context.Background(), "query-qmp-schema", nil, &got); err != nil || got != big {
		t.Fatalf("len %d err %v", len(got), err)
	}
}

func TestLineOverLimitFailsOutstanding(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{MaxLine: 1024})
	f.run(func(f *fakeMonitor) { f.reply(f.recv("query-qmp-schema"), `"`+strings.Repeat("y", 4096)+`"`) })
	err := c.Execute(bounded(t), "query-qmp-schema", nil, nil)
	if !errors.Is(err, ErrClosed) || !errors.Is(err, ErrProtocol) {
		t.Fatalf("err = %v", err)
	}
	recvWithin(t, c.Done(), "the client did not close after an over-long line")
	if _, ok := <-c.Events(); ok {
		t.Error("events channel still open")
	}
}

func TestDisconnectFailsOutstandingCommands(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	sub := c.Subscribe("DEVICE_DELETED", nil)
	f.run(func(f *fakeMonitor) {
		f.recv("query-status")
		f.conn.Close()
	})
	if _, err := c.QueryStatus(bounded(t)); !errors.Is(err, ErrClosed) {
		t.Fatalf("outstanding: %v", err)
	}
	if _, err := sub.Wait(bounded(t)); !errors.Is(err, ErrClosed) {
		t.Errorf("subscription: %v", err)
	}
	recvWithin(t, c.Done(), "the client did not close after the monitor hung up")
	if err := c.Cont(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("after close: %v", err)
	}
	if !errors.Is(c.Err(), ErrClosed) {
		t.Errorf("Err() = %v", c.Err())
	}
}

func TestQuitTreatsDisconnectAsSuccess(t *testing.T) {
	for _, withReply := range []bool{true, false} {
		f, conn := newFake(t)
		c := connect(t, f, conn, Options{})
		f.run(func(f *fakeMonitor) {
			cmd := f.recv("quit")
			if withReply {
				f.reply(cmd, "{}")
				f.send(`{"event": "SHUTDOWN", "data": {"guest": false, "reason": "host-qmp-quit"}}`)
			}
			f.conn.Close()
		})
		if err := c.Quit(bounded(t)); err != nil {
			t.Errorf("withReply=%v: %v", withReply, err)
		}
		recvWithin(t, c.Done(), fmt.Sprintf("withReply=%v: the client did not close after quit", withReply))
	}
}

func TestEventBufferOverflowDoesNotBlockReplies(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{EventBuffer: 1})
	f.run(func(f *fakeMonitor) {
		cmd := f.recv("query-status")
		for i := 0; i < 3; i++ {
			f.send(`{"event": "RTC_CHANGE", "data": {"offset": 1}}`)
		}
		f.reply(cmd, `{"status": "running", "running": true, "singlestep": false}`)
	})
	if _, err := c.QueryStatus(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d := c.Dropped(); d != 2 {
		t.Errorf("dropped %d, want 2", d)
	}
}

func TestHandshakeErrors(t *testing.T) {
	cases := map[string]struct {
		script func(f *fakeMonitor)
		check  func(error) bool
	}{
		"not a greeting": {func(f *fakeMonitor) { f.send(`{"return": {}}`) }, func(err error) bool { return errors.Is(err, ErrProtocol) }},
		"garbage":        {func(f *fakeMonitor) { f.send(`hello`) }, func(err error) bool { return errors.Is(err, ErrProtocol) }},
		"capabilities refused": {func(f *fakeMonitor) {
			f.send(greeting)
			cmd := f.recv("qmp_capabilities")
			f.send(fmt.Sprintf(`{"error": {"class": "CommandNotFound", "desc": "nope"}, "id": %s}`, cmd.ID))
		}, func(err error) bool {
			var qe *Error
			return errors.As(err, &qe) && qe.Class == "CommandNotFound" && qe.Command == "qmp_capabilities"
		}},
		"closed before greeting": {func(f *fakeMonitor) { f.conn.Close() }, func(err error) bool { return err != nil }},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			f, conn := newFake(t)
			f.run(tc.script)
			c, err := NewClient(context.Background(), conn, Options{})
			if c != nil || !tc.check(err) {
				t.Fatalf("err = %v", err)
			}
		})
	}
}

func TestHandshakeHonoursContext(t *testing.T) {
	_, conn := newFake(t) // never sends a greeting
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := NewClient(ctx, conn, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
}

func TestGarbageAfterHandshakeClosesClient(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	f.run(func(f *fakeMonitor) {
		f.recv("query-status")
		f.send(`{"neither": "reply nor event"}`)
	})
	if _, err := c.QueryStatus(context.Background()); !errors.Is(err, ErrProtocol) {
		t.Fatalf("err = %v", err)
	}
}

func TestDeviceAddArguments(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	f.run(func(f *fakeMonitor) {
		cmd := f.recv("chardev-add")
		var ca map[string]any
		json.Unmarshal(cmd.Arguments, &ca)
		if !strings.Contains(string(cmd.Arguments), `"path":"/run/blk.sock"`) || ca["id"] != "char-blk1" || !strings.Contains(string(cmd.Arguments), `"server":false`) {
			f.t.Errorf("chardev-add args %s", cmd.Arguments)
		}
		f.reply(cmd, "{}")
		cmd = f.recv("device_add")
		var da map[string]any
		json.Unmarshal(cmd.Arguments, &da)
		if da["driver"] != "vhost-user-blk-pci" || da["id"] != "blk1" || da["chardev"] != "char-blk1" || da["bus"] != "pci-bridge-0" || da["addr"] != "0x1" {
			f.t.Errorf("device_add args %s", cmd.Arguments)
		}
		f.reply(cmd, "{}")
		f.reply(f.recv("chardev-remove"), "{}")
	})
	ctx := context.Background()
	if err := c.ChardevAddSocket(ctx, "char-blk1", "/run/blk.sock"); err != nil {
		t.Fatal(err)
	}
	if err := c.DeviceAdd(ctx, "vhost-user-blk-pci", "blk1", map[string]any{"chardev": "char-blk1", "bus": "pci-bridge-0", "addr": "0x1"}); err != nil {
		t.Fatal(err)
	}
	if err := c.DeviceAdd(ctx, "x", "y", map[string]any{"driver": "z"}); err == nil {
		t.Error("driver override accepted")
	}
	if err := c.ChardevRemove(ctx, "char-blk1"); err != nil {
		t.Fatal(err)
	}
}

func TestFindPCIPath(t *testing.T) {
	var buses []PCIBus
	raw := `[{"bus":0,"devices":[{"bus":0,"slot":2,"function":0,"qdev_id":"pci-bridge-0","pci_bridge":{"bus":{"number":1},"devices":[{"bus":1,"slot":1,"function":0,"qdev_id":"blk1"}]}},{"bus":0,"slot":3,"function":0,"qdev_id":"serial0"}]}]`
	if err := json.Unmarshal([]byte(raw), &buses); err != nil {
		t.Fatal(err)
	}
	if p, ok := FindPCIPath(buses, "blk1"); !ok || fmt.Sprint(p) != "[2 1]" {
		t.Errorf("blk1: %v %v", p, ok)
	}
	if p, ok := FindPCIPath(buses, "serial0"); !ok || fmt.Sprint(p) != "[3]" {
		t.Errorf("serial0: %v %v", p, ok)
	}
	if _, ok := FindPCIPath(buses, "none"); ok {
		t.Error("found missing device")
	}
}

// FuzzReader feeds arbitrary bytes to a negotiated client: it must never
// panic or hang, and must end with ErrClosed once the stream ends.
func FuzzReader(f *testing.F) {
	f.Add([]byte(`{"event":"X","data":{}}` + "\n" + `{"return":{},"id":1}` + "\n"))
	f.Add([]byte(`{"return":{},"id":"abc"}` + "\n" + `{"error":{"class":"C"}}` + "\n"))
	f.Add([]byte(`{"event":"SHUTDOWN","timestamp":{"seconds":-1,"microseconds":99999999}}` + "\n"))
	f.Add([]byte("\n\n{\"return\": 1, \"id\": 18446744073709551615}\r\n{"))
	f.Fuzz(func(t *testing.T, data []byte) {
		server, client := socketpair(t)
		defer server.Close()
		go func() {
			w := bufio.NewWriter(server)
			w.WriteString(greeting + "\n")
			w.Flush()
			bufio.NewReader(server).ReadBytes('\n')
			w.WriteString(`{"return": {}, "id": 0}` + "\n")
			w.Write(data)
			w.Flush()
			server.Close()
		}()
		c, err := NewClient(context.Background(), client, Options{MaxLine: 4096, EventBuffer: 4})
		if err != nil {
			t.Fatal(err)
		}
		sub := c.Subscribe("SHUTDOWN", nil)
		drained := make(chan struct{})
		go func() {
			for range c.Events() {
			}
			close(drained)
		}()
		recvWithin(t, drained, "the Events channel was not closed after the stream ended")
		recvWithin(t, c.Done(), "the client did not close after the stream ended")
		if !errors.Is(c.Err(), ErrClosed) {
			t.Fatalf("Err() = %v", c.Err())
		}
		sub.Cancel()
		c.Close()
	})
}

func TestWriteAbandonedWhenQEMUDoesNotRead(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	// The fake reads the start of a command far larger than the socket
	// buffer and then stops reading, so the write is blocked when ctx ends;
	// the half-sent stream must then be closed, not left desynchronised.
	started := make(chan struct{})
	f.run(func(f *fakeMonitor) {
		buf := make([]byte, 16)
		if _, err := io.ReadFull(f.r, buf); err != nil {
			f.t.Errorf("fake: %v", err)
		}
		close(started)
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Execute(ctx, "huge", map[string]any{"x": strings.Repeat("z", 32<<20)}, nil) }()
	recvWithin(t, started, "the fake did not receive the start of the command")
	cancel()
	err := recvWithin(t, errc, "Execute did not return after its context was cancelled mid-write")
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrClosed) {
		t.Fatalf("err = %v", err)
	}
	recvWithin(t, c.Done(), "the client did not close its half-written stream")
}

// TestCommandGivesUpWaitingForAStuckWrite: a command queued behind a write
// QEMU is not reading (one whose caller set no deadline) ends when its own
// context does, and leaves the stream as it was.
func TestCommandGivesUpWaitingForAStuckWrite(t *testing.T) {
	f, conn := newFake(t)
	c := connect(t, f, conn, Options{})
	started := make(chan struct{})
	f.run(func(f *fakeMonitor) {
		buf := make([]byte, 16)
		if _, err := io.ReadFull(f.r, buf); err != nil {
			f.t.Errorf("fake: %v", err)
		}
		close(started)
	})
	go c.Execute(context.Background(), "huge", map[string]any{"x": strings.Repeat("z", 32<<20)}, nil)
	recvWithin(t, started, "the fake did not receive the start of the command")
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Execute(ctx, "query-status", nil, nil) }()
	// Both commands are registered: the second is past its context check
	// and on its way to the write.
	limit := bounded(t)
	for {
		c.mu.Lock()
		n := len(c.pending)
		c.mu.Unlock()
		if n == 2 {
			break
		}
		select {
		case <-limit.Done():
			t.Fatal("the second command was never registered")
		default:
			runtime.Gosched()
		}
	}
	cancel()
	err := recvWithin(t, errc, "a command waiting for another's stuck write did not return when its context was cancelled")
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrClosed) {
		t.Fatalf("err = %v, want context.Canceled without closing the stream", err)
	}
	select {
	case <-c.Done():
		t.Fatal("the client closed its stream for a command that wrote nothing")
	default:
	}
}
