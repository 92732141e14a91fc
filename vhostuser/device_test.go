package vhostuser_test

import (
	"context"
	"encoding/binary"
	"path/filepath"
	"sync"
	"testing"
	"time"

	vu "github.com/kata-fsx/kata-fsx/vhostuser"
	"github.com/kata-fsx/kata-fsx/vhostuser/vhostusertest"
	"github.com/kata-fsx/kata-fsx/virtio/virtq"
	"github.com/kata-fsx/kata-fsx/virtio/virtq/testdriver"
)

// echoDevice records what the core asks of it; its queues return every
// chain with the number of bytes it could read.
type echoDevice struct {
	mu          sync.Mutex
	started     []int
	stopped     []int
	disconnects int
	changed     chan struct{}
}

func (d *echoDevice) Features() uint64 { return 1 << 5 }
func (d *echoDevice) NumQueues() int   { return 2 }
func (d *echoDevice) ReadConfig(offset uint32, p []byte) {
	cfg := []byte("0123456789")
	if offset < uint32(len(cfg)) {
		copy(p, cfg[offset:])
	}
}

func (d *echoDevice) note(f func()) {
	d.mu.Lock()
	f()
	d.mu.Unlock()
	select {
	case d.changed <- struct{}{}:
	default:
	}
}

func (d *echoDevice) RunQueue(q *vu.Queue) {
	d.note(func() { d.started = append(d.started, q.Index()) })
	defer d.note(func() { d.stopped = append(d.stopped, q.Index()) })
	vq := q.VQ()
	var c virtq.Chain
	for {
		for {
			ok, err := vq.Pop(&c)
			if !ok {
				break
			}
			n := c.ReadLen
			if err != nil {
				n = 0
			}
			vq.PushUsed(c.Head, n)
		}
		if vq.NeedsNotification() {
			q.Notify()
		}
		select {
		case <-q.Kicks():
		case <-q.Done():
			return
		}
	}
}

func (d *echoDevice) Disconnect() { d.note(func() { d.disconnects++ }) }

func (d *echoDevice) wait(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.After(vhostusertest.Wait)
	for {
		d.mu.Lock()
		ok := cond()
		d.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-d.changed:
		case <-deadline:
			t.Fatal("device never saw the expected calls")
		}
	}
}

// TestDeviceLifecycle: the core offers the device's features with its own,
// windows the device's config space, runs a queue once it is started and
// enabled, stops it on GET_VRING_BASE, and tells the device when the
// front-end hangs up.
func TestDeviceLifecycle(t *testing.T) {
	dev := &echoDevice{changed: make(chan struct{}, 1)}
	sock := filepath.Join(t.TempDir(), "vu", "dev.sock")
	srv, err := vu.Serve(context.Background(), sock, dev, vu.Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	f := vhostusertest.Dial(t, sock)
	offered := f.Negotiate(0)
	if want := uint64(1<<5 | 1<<vu.FeatVersion1 | 1<<vu.FeatIndirectDesc | 1<<vu.FeatEventIdx | 1<<vu.FeatProtocolFeatures); offered != want {
		t.Errorf("features %#x, want %#x", offered, want)
	}
	cfg := func(off, size uint32) []byte {
		b := binary.LittleEndian.AppendUint32(nil, off)
		b = binary.LittleEndian.AppendUint32(b, size)
		b = binary.LittleEndian.AppendUint32(b, 0)
		return append(b, make([]byte, size)...)
	}
	if p := f.Get(vu.ReqGetConfig, cfg(8, 4)); string(p[12:]) != "89\x00\x00" {
		t.Errorf("config window at 8: %q", p[12:])
	}
	if n := binary.LittleEndian.Uint64(f.Get(vu.ReqGetQueueNum, nil)); n != 2 {
		t.Errorf("GET_QUEUE_NUM %d", n)
	}
	f.SetupMemory()
	q := f.StartQueue(1, 64)
	dev.wait(t, func() bool { return len(dev.started) == 1 && dev.started[0] == 1 })

	a := q.Alloc(100, 8)
	head := q.Publish([]testdriver.Buf{{Addr: a, Len: 100}})
	q.Kick()
	if id, n := q.WaitUsed(); id != uint32(head) || n != 100 {
		t.Fatalf("used %d/%d", id, n)
	}
	b := f.Get(vu.ReqGetVringBase, vhostusertest.State(1, 0))
	if base := binary.LittleEndian.Uint32(b[4:]); base != 1 {
		t.Errorf("GET_VRING_BASE %d, want 1", base)
	}
	dev.wait(t, func() bool { return len(dev.stopped) == 1 })
	f.Close()
	dev.wait(t, func() bool { return dev.disconnects == 1 })
	if len(dev.started) != 1 {
		t.Errorf("queues started %v", dev.started)
	}
}
