package store

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func sampleTrace() Trace {
	a, b := "sha256:"+strings.Repeat("12", 32), "sha256:"+strings.Repeat("ef", 32)
	return Trace{Entries: []TraceEntry{{a, 3}, {a, 4}, {b, 0}, {a, 0}, {b, 1 << 30}}}
}

func TestTraceEncoding(t *testing.T) {
	tr := sampleTrace()
	enc, err := tr.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeTrace(enc)
	if err != nil || len(got.Entries) != len(tr.Entries) {
		t.Fatalf("%v %v", got, err)
	}
	for i := range got.Entries {
		if got.Entries[i] != tr.Entries[i] {
			t.Fatalf("entry %d: %v, want %v", i, got.Entries[i], tr.Entries[i])
		}
	}
	empty, _ := Trace{}.MarshalBinary()
	if got, err := DecodeTrace(empty); err != nil || len(got.Entries) != 0 {
		t.Fatalf("empty trace: %v %v", got, err)
	}
	for name, b := range map[string][]byte{
		"empty":     nil,
		"truncated": enc[:len(enc)-1],
		"not trace": []byte("KFSXLZI\n0123456789abcdef"),
		"flipped":   func() []byte { c := bytes.Clone(enc); c[20] ^= 1; return c }(),
		"huge":      make([]byte, MaxTraceSize+1),
	} {
		if _, err := DecodeTrace(b); !errors.Is(err, ErrBadTrace) {
			t.Errorf("%s: %v, want ErrBadTrace", name, err)
		}
	}
	if _, err := (Trace{Entries: []TraceEntry{{"md5:00", 1}}}).MarshalBinary(); err == nil {
		t.Error("trace naming a non-sha256 layer encoded")
	}
}

// FuzzDecodeTrace: hostile input is refused with ErrBadTrace or decodes
// to a trace that encodes back to the same bytes.
func FuzzDecodeTrace(f *testing.F) {
	enc, _ := sampleTrace().MarshalBinary()
	empty, _ := Trace{}.MarshalBinary()
	f.Add(enc)
	f.Add(empty)
	f.Add(enc[:len(enc)/2])
	f.Add([]byte(traceMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, err := DecodeTrace(b)
		if err != nil {
			if !errors.Is(err, ErrBadTrace) {
				t.Fatalf("error %v does not wrap ErrBadTrace", err)
			}
			return
		}
		re, err := tr.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded trace does not encode: %v", err)
		}
		tr2, err := DecodeTrace(re)
		if err != nil || len(tr2.Entries) != len(tr.Entries) {
			t.Fatalf("re-encoded trace: %v", err)
		}
		for i := range tr.Entries {
			if tr.Entries[i] != tr2.Entries[i] {
				t.Fatalf("entry %d changed: %v, %v", i, tr.Entries[i], tr2.Entries[i])
			}
		}
	})
}
