package vhostuser

import (
	"testing"
)

// BenchmarkRead4K drives one queue with 4 KiB reads of clean (base) blocks
// as fast as the test frontend can, in batches of 32, and reports reads/s.
func BenchmarkRead4K(b *testing.B) {
	const size, batch = 64 << 20, 32
	env := newEnv(b, size, false, Options{Logf: func(string, ...any) {}})
	f := dialFrontend(b, env.sock)
	f.negotiate(0)
	f.setupMemory()
	q := f.startQueue(0, 256)
	pend := make([]pendingReq, 0, batch)
	sector := uint64(0)
	b.ResetTimer()
	for done := 0; done < b.N; {
		pend = pend[:0]
		for k := 0; k < batch && done+k < b.N; k++ {
			pend = append(pend, q.prepare(blkTypeIn, sector, nil, 4096))
			sector = (sector + 8) % (size / 512)
		}
		q.kickIt()
		for range pend {
			q.waitUsed()
		}
		done += len(pend)
	}
	b.StopTimer()
	if st, _ := q.result(pend[len(pend)-1]); st != blkStatusOK {
		b.Fatalf("read status %d", st)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reads/s")
}
