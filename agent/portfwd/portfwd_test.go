package portfwd

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
)

func TestRequestRoundTrip(t *testing.T) {
	for _, r := range []Request{{Watch: true}, {Port: 1}, {Port: 80}, {Port: 65535}} {
		in := bytes.NewReader(append(r.Marshal(), "stream bytes"...))
		got, err := ReadRequest(iotest.OneByteReader(in))
		if err != nil || got != r {
			t.Errorf("%q: got %+v, %v", r.Marshal(), got, err)
		}
		// The stream's bytes are left for the caller.
		if rest, _ := io.ReadAll(in); string(rest) != "stream bytes" {
			t.Errorf("%q: left %q, want the stream's bytes", r.Marshal(), rest)
		}
	}
}

func TestReadRequestRefuses(t *testing.T) {
	for _, in := range []string{
		"", "WATCH", "watch\n", "LIST\n", "TCP\n", "TCP 0\n", "TCP 65536\n", "TCP -1\n", "TCP 080\n",
		"TCP 80 \n", "TCP  80\n", "UDP 53\n", "TCP 8o\n", strings.Repeat("L", 100) + "\n",
	} {
		if r, err := ReadRequest(strings.NewReader(in)); err == nil {
			t.Errorf("%q: accepted as %+v", in, r)
		}
	}
}

func TestReadReply(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint16
	}{
		{"OK\n", nil},
		{"OK 80\n", []uint16{80}},
		{"OK 22 80 8080 65535\n", []uint16{22, 80, 8080, 65535}},
	} {
		got, err := ReadReply(strings.NewReader(c.in))
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("%q: got %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	_, err := ReadReply(strings.NewReader("ERR dial tcp 127.0.0.1:81: connection refused\n"))
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("ERR reply: %v, want ErrRefused with the reason", err)
	}
	for _, in := range []string{
		"", "OK", "OK \n", "OK 80 80\n", "OK 80 22\n", "OK 0\n", "OK 70000\n", "OK80\n", "KO\n",
		"OK " + strings.Repeat("1 ", MaxPorts) + "2\n",
		"ERR " + strings.Repeat("x", maxReply) + "\n",
	} {
		if ports, err := ReadReply(strings.NewReader(in)); err == nil {
			t.Errorf("%.40q: accepted as %v", in, ports)
		}
	}
	many := make([]uint16, MaxPorts)
	for i := range many {
		many[i] = uint16(60000 + i)
	}
	if got, err := ReadReply(bytes.NewReader(MarshalOK(many))); err != nil || !slices.Equal(got, many) {
		t.Errorf("a reply of MaxPorts ports: %v, %v", len(got), err)
	}
}

func TestMarshalErrorOneLine(t *testing.T) {
	b := MarshalError("a\nb\r" + strings.Repeat("x", 2*maxReason))
	if bytes.Count(b, []byte("\n")) != 1 || len(b) > maxReply {
		t.Fatalf("error reply %q is not one bounded line", b)
	}
	if _, err := ReadReply(bytes.NewReader(b)); !errors.Is(err, ErrRefused) {
		t.Fatalf("error reply read back: %v", err)
	}
}

// FuzzReadReply: whatever the guest writes, the host's reader ends with
// an error or ports that are ascending, distinct, in range and bounded.
func FuzzReadReply(f *testing.F) {
	for _, s := range []string{"OK\n", "OK 80 443\n", "ERR no\n", "OK 0\n", "OK 2 1\n", "OK 99999\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ports, err := ReadReply(bytes.NewReader(b))
		if err != nil {
			return
		}
		if len(ports) > MaxPorts {
			t.Fatalf("%d ports", len(ports))
		}
		for i, p := range ports {
			if p == 0 || i > 0 && p <= ports[i-1] {
				t.Fatalf("ports %v", ports)
			}
		}
		if again, err := ReadReply(bytes.NewReader(MarshalOK(ports))); err != nil || !slices.Equal(again, ports) {
			t.Fatalf("ports %v do not round-trip: %v, %v", ports, again, err)
		}
	})
}

// FuzzReadRequest: a request read back is one that marshals to the line read.
func FuzzReadRequest(f *testing.F) {
	for _, s := range []string{"WATCH\n", "TCP 80\n", "TCP 0\n", "TCP 65536\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ReadRequest(bytes.NewReader(b))
		if err != nil {
			return
		}
		if !bytes.HasPrefix(b, r.Marshal()) {
			t.Fatalf("%q read as %+v", b, r)
		}
	})
}
