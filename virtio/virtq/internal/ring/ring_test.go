package ring

import (
	"sync"
	"testing"
)

// TestStoreKeepsNeighbour: the device and the driver store the two halves
// of one 32-bit word at once (avail ring entries, used flags and idx);
// neither store may undo the other.
func TestStoreKeepsNeighbour(t *testing.T) {
	b := make([]byte, 8)
	const n = 10000
	var wg sync.WaitGroup
	for _, off := range []int{0, 2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range n {
				store16(b[off:], uint16(i+off))
			}
		}()
	}
	wg.Wait()
	if lo, hi := load16(b[0:]), load16(b[2:]); lo != n-1 || hi != n+1 {
		t.Fatalf("after concurrent stores: %d and %d, want %d and %d", lo, hi, n-1, n+1)
	}
}

func TestFieldsLittleEndian(t *testing.T) {
	const size = 4
	avail := make([]byte, AvailLen(size))
	used := make([]byte, UsedLen(size))
	SetAvailFlags(avail, 0x0102)
	SetAvailIdx(avail, 0x0304)
	SetAvailEntry(avail, 3, 0x0506)
	SetUsedEvent(avail, size, 0x0708)
	want := []byte{2, 1, 4, 3, 0, 0, 0, 0, 0, 0, 6, 5, 8, 7}
	if string(avail) != string(want) {
		t.Fatalf("available ring % x, want % x", avail, want)
	}
	if AvailFlags(avail) != 0x0102 || AvailIdx(avail) != 0x0304 || AvailEntry(avail, 3) != 0x0506 || UsedEvent(avail, size) != 0x0708 {
		t.Fatal("available ring fields do not read back")
	}
	SetUsedFlags(used, 1)
	SetUsedIdx(used, 2)
	PutUsedElem(used, 3, 7, 512)
	SetAvailEvent(used, size, 9)
	if id, n := UsedElem(used, 3); id != 7 || n != 512 || UsedFlags(used) != 1 || UsedIdx(used) != 2 || AvailEvent(used, size) != 9 {
		t.Fatalf("used ring fields do not read back: % x", used)
	}
	table := make([]byte, 2*DescSize)
	d := Desc{Addr: 0x1122334455667788, Len: 0x99aabbcc, Flags: 3, Next: 1}
	PutDesc(table, 1, d)
	if got := ReadDesc(table, 1); got != d || table[DescSize] != 0x88 {
		t.Fatalf("descriptor %+v, want %+v", got, d)
	}
}
