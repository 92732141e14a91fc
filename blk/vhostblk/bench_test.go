package vhostblk

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
)

// BenchmarkRead4K drives one queue with 4 KiB reads as fast as the test
// frontend can, in batches of 32, and reports reads/s: against our server
// (an overlay over a raw file, every block clean) and, with the same
// frontend and the same file, against qemu-storage-daemon's vhost-user-blk
// export. Both read the file through the host page cache.
func BenchmarkRead4K(b *testing.B) {
	const size = 64 << 20
	raw := filepath.Join(b.TempDir(), "disk.raw")
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(4, 4))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	if err := os.WriteFile(raw, data, 0o600); err != nil {
		b.Fatal(err)
	}
	b.Run("imagefs-blk", func(b *testing.B) {
		f, err := os.Open(raw)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		dir := b.TempDir()
		dev, err := overlay.Open(f, size, filepath.Join(dir, "overlay"), overlay.Options{})
		if err != nil {
			b.Fatal(err)
		}
		defer dev.Close()
		sock := filepath.Join(dir, "vu", "blk.sock")
		srv, err := Serve(context.Background(), sock, dev, Options{Logf: func(string, ...any) {}})
		if err != nil {
			b.Fatal(err)
		}
		defer srv.Close()
		read4K(b, sock, size)
	})
	b.Run("qemu-storage-daemon", func(b *testing.B) {
		qsd := testenv.Tool(b, "qemu-storage-daemon", "qemu-system-common")
		sock := filepath.Join(b.TempDir(), "qsd.sock")
		cmd := exec.Command(qsd,
			"--blockdev", "driver=file,node-name=file0,filename="+raw+",cache.direct=off",
			"--export", "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path="+sock+",writable=on,num-queues=1")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		defer func() {
			cmd.Process.Kill()
			cmd.Wait()
		}()
		testenv.Eventually(b, 10*time.Second, func() (bool, error) {
			_, err := os.Stat(sock)
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				b.Fatalf("qemu-storage-daemon socket %s: %v; stderr: %s", sock, err, stderr.String())
			}
			return err == nil, fmt.Errorf("qemu-storage-daemon socket %s: %v; stderr: %s", sock, err, stderr.String())
		})
		read4K(b, sock, size)
	})
}

// read4K is the measured loop: batches of 32 reads of consecutive 4 KiB
// blocks, kicked together, each batch waited for.
func read4K(b *testing.B, sock string, size uint64) {
	const batch = 32
	f := vhostusertest.Dial(b, sock)
	f.Negotiate(0)
	f.SetupMemory()
	q := startQueue(b, f, 0, 256)
	pend := make([]pendingReq, 0, batch)
	sector := uint64(0)
	b.ResetTimer()
	for done := 0; done < b.N; {
		pend = pend[:0]
		for k := 0; k < batch && done+k < b.N; k++ {
			pend = append(pend, q.prepare(blkTypeIn, sector, nil, 4096))
			sector = (sector + 8) % (size / 512)
		}
		q.Kick()
		for range pend {
			q.WaitUsed()
		}
		done += len(pend)
	}
	b.StopTimer()
	if st, _ := q.result(pend[len(pend)-1]); st != blkStatusOK {
		b.Fatalf("read status %d", st)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reads/s")
}
