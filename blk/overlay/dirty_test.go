package overlay

import (
	"path/filepath"
	"testing"
)

// DirtyBytes counts whole blocks the guest changed, the short last block
// by its own length, and drops nothing a reopen finds again.
func TestDirtyBytes(t *testing.T) {
	const size = 10*4096 + 1024 // a short last block of 1 KiB
	base := make([]byte, size)
	path := filepath.Join(t.TempDir(), "ov")
	d := openT(t, base, path, Options{})
	if got := d.DirtyBytes(); got != 0 {
		t.Fatalf("fresh overlay: %d dirty bytes", got)
	}
	// One byte dirties its whole block; two writes in a block count once.
	for _, off := range []int64{7, 100, 3*4096 + 1} {
		if _, err := d.WriteAt([]byte{1}, off); err != nil {
			t.Fatal(err)
		}
	}
	if got := d.DirtyBytes(); got != 2*4096 {
		t.Fatalf("after writes to blocks 0 and 3: %d, want %d", got, 2*4096)
	}
	if err := d.Discard(5*4096, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(make([]byte, 512), 10*4096+512); err != nil {
		t.Fatal(err)
	}
	want := int64(3*4096 + 1024)
	if got := d.DirtyBytes(); got != want {
		t.Fatalf("after a discard and a write to the short last block: %d, want %d", got, want)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d = openT(t, base, path, Options{})
	defer d.Close()
	if got := d.DirtyBytes(); got != want {
		t.Fatalf("after reopen: %d, want %d", got, want)
	}
	ro := openT(t, base, "", Options{ReadOnly: true})
	defer ro.Close()
	if got := ro.DirtyBytes(); got != 0 {
		t.Fatalf("read-only device: %d", got)
	}
}
