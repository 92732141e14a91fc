package vhostblk

import (
	"iter"
	"sync/atomic"
	"time"
)

// Op is a class of virtio-blk request, as the device counts them.
type Op int

// The request classes. OpOther is GET_ID, request types the device does
// not support, and chains too short to carry a type.
const (
	OpRead Op = iota
	OpWrite
	OpFlush
	OpDiscard
	OpWriteZeroes
	OpOther
	// NumOps is the number of request classes.
	NumOps
)

// String returns the class's metric label: read, write, flush, discard,
// write_zeroes or other.
func (o Op) String() string {
	switch o {
	case OpRead:
		return "read"
	case OpWrite:
		return "write"
	case OpFlush:
		return "flush"
	case OpDiscard:
		return "discard"
	case OpWriteZeroes:
		return "write_zeroes"
	case OpOther:
		return "other"
	}
	return "unknown"
}

// LatencyBuckets is the number of finite buckets of the latency histograms.
const LatencyBuckets = 20

// latencyBoundsNs are the buckets' upper bounds, from a page-cache hit
// (microseconds) to a lazy image's read from a slow registry (seconds).
// A constant table: never written.
var latencyBoundsNs = [LatencyBuckets]int64{
	5e3, 10e3, 25e3, 50e3, 100e3, 250e3, 500e3,
	1e6, 2.5e6, 5e6, 10e6, 25e6, 50e6, 100e6, 250e6, 500e6,
	1e9, 2.5e9, 5e9, 10e9,
}

// LatencyBounds returns the upper bounds of the latency buckets, ascending.
func LatencyBounds() [LatencyBuckets]time.Duration {
	var b [LatencyBuckets]time.Duration
	for i, ns := range latencyBoundsNs {
		b[i] = time.Duration(ns)
	}
	return b
}

// Histogram is a snapshot of one latency histogram.
type Histogram struct {
	// Counts[i] is the number of requests that took more than bound i-1
	// and at most bound i (LatencyBounds); Counts[LatencyBuckets] is those
	// slower than the last bound. Per bucket, not cumulative.
	Counts [LatencyBuckets + 1]uint64
	// Sum is the time all requests took together.
	Sum time.Duration
}

// Count is the number of requests in the histogram.
func (h Histogram) Count() uint64 {
	var n uint64
	for _, c := range h.Counts {
		n += c
	}
	return n
}

// OpStat is a snapshot of one request class's counters since the device
// was created (connections and reconnections included).
type OpStat struct {
	// Requests is the number of requests completed, failed ones included.
	Requests uint64
	// Bytes is the data the successful requests moved: read into the
	// guest, written from it, or the ranges discarded or zeroed.
	Bytes uint64
	// Errors is the number of requests answered with an error status
	// (IOERR or UNSUPP) or without a status the driver could read.
	Errors uint64
	// Latency is the time the device spent on each request, from taking
	// it off the queue to writing its status.
	Latency Histogram
}

// OpStats is a snapshot of a device's counters, by request class.
type OpStats struct {
	Read, Write, Flush, Discard, WriteZeroes, Other OpStat
}

// Op returns class o's counters (zero for an unknown class).
func (s OpStats) Op(o Op) OpStat {
	if p := s.field(o); p != nil {
		return *p
	}
	return OpStat{}
}

func (s *OpStats) field(o Op) *OpStat {
	switch o {
	case OpRead:
		return &s.Read
	case OpWrite:
		return &s.Write
	case OpFlush:
		return &s.Flush
	case OpDiscard:
		return &s.Discard
	case OpWriteZeroes:
		return &s.WriteZeroes
	case OpOther:
		return &s.Other
	}
	return nil
}

// All yields every class with its counters, in Op order.
func (s OpStats) All() iter.Seq2[Op, OpStat] {
	return func(yield func(Op, OpStat) bool) {
		for o := range NumOps {
			if !yield(o, s.Op(o)) {
				return
			}
		}
	}
}

// Add adds t's counters to s (a pod's disks summed, for instance).
func (s *OpStats) Add(t OpStats) {
	for o := range NumOps {
		a, b := s.field(o), t.field(o)
		a.Requests += b.Requests
		a.Bytes += b.Bytes
		a.Errors += b.Errors
		for i := range a.Latency.Counts {
			a.Latency.Counts[i] += b.Latency.Counts[i]
		}
		a.Latency.Sum += b.Latency.Sum
	}
}

// opCounters are one class's live counters. Padded to four cache lines
// so that two classes never share a line.
type opCounters struct {
	requests, bytes, errors, sumNs atomic.Uint64
	buckets                        [LatencyBuckets + 1]atomic.Uint64
	_                              [256 - (4+LatencyBuckets+1)*8]byte
}

// counterShard is one queue's counters: executors of different queues
// (different vCPUs' requests) never write the same cache line.
type counterShard struct {
	ops [NumOps]opCounters
}

// record counts one finished request: atomics only, no lock, no allocation.
func (s *counterShard) record(op Op, n uint64, failed bool, took time.Duration) {
	if op < 0 || op >= NumOps {
		op = OpOther
	}
	c := &s.ops[op]
	c.requests.Add(1)
	if failed {
		c.errors.Add(1)
	} else if n > 0 {
		c.bytes.Add(n)
	}
	ns := max(int64(took), 0)
	c.sumNs.Add(uint64(ns))
	i := 0
	for i < LatencyBuckets && ns > latencyBoundsNs[i] {
		i++
	}
	c.buckets[i].Add(1)
}

// snapshot sums the shards. Each counter is read atomically; the set is
// not a consistent cut (a request may be in Requests and not yet in its
// bucket), which a scrape tolerates.
func snapshot(shards []counterShard) OpStats {
	var s OpStats
	for k := range shards {
		for o := range NumOps {
			c, st := &shards[k].ops[o], s.field(o)
			st.Requests += c.requests.Load()
			st.Bytes += c.bytes.Load()
			st.Errors += c.errors.Load()
			st.Latency.Sum += time.Duration(c.sumNs.Load())
			for i := range c.buckets {
				st.Latency.Counts[i] += c.buckets[i].Load()
			}
		}
	}
	return s
}

// ServerOps returns the request counters of a server Serve started (zero
// for any other server).
func ServerOps(srv *Server) OpStats {
	if srv == nil {
		return OpStats{}
	}
	d, ok := srv.Device().(*blkDevice)
	if !ok {
		return OpStats{}
	}
	return d.Ops()
}

// Ops returns the device's request counters.
func (d *blkDevice) Ops() OpStats { return snapshot(d.h.shards) }
