package vhostblk

import (
	"encoding/binary"
	"testing"
	"time"
)

// TestOpCounters sends known requests on two queues through the test
// frontend and checks the per-operation counts, bytes, errors and
// histograms the server reports.
func TestOpCounters(t *testing.T) {
	const size = 4 << 20
	env := newEnv(t, size, false, Options{NumQueues: 2})
	if got := ServerOps(env.srv); got != (OpStats{}) {
		t.Fatalf("counters before any request: %+v", got)
	}
	f, q0 := env.connect(t, 0)
	q1 := startQueue(t, f, 1, 128)
	seg := func(sector uint64, num, flags uint32) []byte {
		b := binary.LittleEndian.AppendUint64(nil, sector)
		b = binary.LittleEndian.AppendUint32(b, num)
		return binary.LittleEndian.AppendUint32(b, flags)
	}
	mustStatus := func(what string, st, want byte) {
		t.Helper()
		if st != want {
			t.Fatalf("%s: status %d, want %d", what, st, want)
		}
	}

	const reads, readLen, writes, writeLen, flushes = 7, 8192, 5, 4096, 3
	for i := range reads {
		q := []*testQueue{q0, q1}[i%2]
		st, _, _ := q.blkReq(blkTypeIn, uint64(i*16), nil, readLen)
		mustStatus("read", st, blkStatusOK)
	}
	for i := range writes {
		st, _, _ := q1.blkReq(blkTypeOut, uint64(i*8), randomBytes(uint64(i), writeLen), 0)
		mustStatus("write", st, blkStatusOK)
	}
	for range flushes {
		st, _, _ := q0.blkReq(blkTypeFlush, 0, nil, 0)
		mustStatus("flush", st, blkStatusOK)
	}
	st, _, _ := q0.blkReq(blkTypeDiscard, 0, append(seg(64, 8, 0), seg(128, 16, 0)...), 0)
	mustStatus("discard", st, blkStatusOK)
	st, _, _ = q0.blkReq(blkTypeWriteZeroes, 0, seg(8, 4, blkFlagUnmap), 0)
	mustStatus("write zeroes", st, blkStatusOK)
	st, _, _ = q0.blkReq(blkTypeGetID, 0, nil, 20)
	mustStatus("get id", st, blkStatusOK)
	st, _, _ = q0.blkReq(99, 0, nil, 0)
	mustStatus("unsupported", st, blkStatusUnsupp)
	// A read past the end fails: counted as a read with an error, no bytes.
	st, _, _ = q1.blkReq(blkTypeIn, size/512, nil, 4096)
	mustStatus("read past end", st, blkStatusIOErr)

	got := ServerOps(env.srv)
	want := map[Op]struct{ requests, bytes, errors uint64 }{
		OpRead:        {reads + 1, reads * readLen, 1},
		OpWrite:       {writes, writes * writeLen, 0},
		OpFlush:       {flushes, 0, 0},
		OpDiscard:     {1, 24 * 512, 0},
		OpWriteZeroes: {1, 4 * 512, 0},
		OpOther:       {2, 0, 1},
	}
	seen := 0
	for op, s := range got.All() {
		seen++
		w := want[op]
		if s.Requests != w.requests || s.Bytes != w.bytes || s.Errors != w.errors {
			t.Errorf("%s: requests %d bytes %d errors %d, want %d %d %d", op, s.Requests, s.Bytes, s.Errors, w.requests, w.bytes, w.errors)
		}
		if s.Latency.Count() != s.Requests {
			t.Errorf("%s: histogram holds %d requests, want %d", op, s.Latency.Count(), s.Requests)
		}
		if s.Requests > 0 && s.Latency.Sum <= 0 {
			t.Errorf("%s: latency sum %v for %d requests", op, s.Latency.Sum, s.Requests)
		}
	}
	if seen != int(NumOps) {
		t.Errorf("All yielded %d classes, want %d", seen, NumOps)
	}
	if got.Read.Requests != got.Op(OpRead).Requests || got.Other != got.Op(OpOther) {
		t.Error("named fields and Op disagree")
	}

	// Counters survive a reconnection: they belong to the device.
	f.Close()
	_, q := env.connect(t, 0)
	st, _, _ = q.blkReq(blkTypeIn, 0, nil, 512)
	mustStatus("read after reconnect", st, blkStatusOK)
	if after := ServerOps(env.srv); after.Read.Requests != reads+2 || after.Read.Bytes != reads*readLen+512 {
		t.Errorf("after reconnect: read requests %d bytes %d", after.Read.Requests, after.Read.Bytes)
	}
}

func TestOpCountersRecord(t *testing.T) {
	var s [2]counterShard
	bounds := LatencyBounds()
	s[0].record(OpRead, 4096, false, bounds[0])   // on the first bound: first bucket
	s[0].record(OpRead, 4096, false, bounds[0]+1) // just over: second
	s[1].record(OpRead, 4096, true, bounds[LatencyBuckets-1]+time.Second)
	s[1].record(OpRead, 0, false, -time.Second) // a clock step back: first bucket, adds nothing
	s[1].record(Op(-1), 10, false, 0)           // unknown class: other
	s[1].record(NumOps, 10, false, 0)
	got := snapshot(s[:])
	r := got.Read
	if r.Requests != 4 || r.Bytes != 8192 || r.Errors != 1 {
		t.Errorf("read: %+v", r)
	}
	if r.Latency.Counts[0] != 2 || r.Latency.Counts[1] != 1 || r.Latency.Counts[LatencyBuckets] != 1 {
		t.Errorf("read buckets: %v", r.Latency.Counts)
	}
	if want := 2*bounds[0] + 1 + bounds[LatencyBuckets-1] + time.Second; r.Latency.Sum != want {
		t.Errorf("read sum %v, want %v", r.Latency.Sum, want)
	}
	if got.Other.Requests != 2 || got.Other.Bytes != 20 {
		t.Errorf("other: %+v", got.Other)
	}
	var sum OpStats
	sum.Add(got)
	sum.Add(got)
	if sum.Read.Requests != 8 || sum.Read.Latency.Counts[0] != 4 || sum.Read.Latency.Sum != 2*r.Latency.Sum {
		t.Errorf("Add: %+v", sum.Read)
	}
	for i := 1; i < LatencyBuckets; i++ {
		if bounds[i] <= bounds[i-1] {
			t.Errorf("bounds not ascending at %d: %v", i, bounds)
		}
	}
	if Op(42).String() != "unknown" || OpWriteZeroes.String() != "write_zeroes" {
		t.Error("Op names")
	}
}

// BenchmarkOpRecord is what counting adds to every request: two clock
// reads and the counter updates.
func BenchmarkOpRecord(b *testing.B) {
	var s counterShard
	for b.Loop() {
		start := time.Now()
		s.record(OpRead, 4096, false, time.Since(start))
	}
}
