package hypervisor

import (
	"context"
	"errors"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestMemPreallocFailsAtStart runs QEMU with its RAM file on a tmpfs
// smaller than the guest's memory: with MemPrealloc (Kata's
// enable_mem_prealloc) QEMU refuses to start, where without it the VM
// starts and would later die of SIGBUS on the page that does not fit.
func TestMemPreallocFailsAtStart(t *testing.T) {
	testenv.Root(t, "mounts a small tmpfs for guest RAM")
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })

	cfg := testVM(t, "q35")
	cfg.SharedMemory, cfg.MemPath, cfg.MemoryMiB = SharedMemoryFile, dir, 64
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("without prealloc, a VM larger than its RAM file system starts (and faults later): %v", err)
	}
	if err := vm.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}

	cfg = testVM(t, "q35")
	cfg.SharedMemory, cfg.MemPath, cfg.MemoryMiB, cfg.MemPrealloc = SharedMemoryFile, dir, 64, true
	vm, err = Start(context.Background(), cfg)
	if err == nil {
		vm.Stop(context.Background())
		t.Fatal("with prealloc, a VM larger than its RAM file system started")
	}
	if !errors.Is(err, ErrExited) || !strings.Contains(err.Error(), "qemu-system-x86_64:") {
		t.Fatalf("err = %v, want QEMU's own complaint", err)
	}
	t.Logf("refused: %v", err)
}

func TestMemPreallocArgs(t *testing.T) {
	for _, tc := range []struct {
		shared SharedMemory
		want   string
	}{
		{SharedMemoryFile, "share=on,prealloc=on"},
		{SharedMemoryMemfd, "share=on,prealloc=on"},
		{SharedMemoryOff, "-mem-prealloc"},
	} {
		vm := baseVM()
		vm.Devices = nil
		vm.SharedMemory, vm.MemPrealloc = tc.shared, true
		p, err := Build(vm)
		if err != nil {
			t.Fatalf("%v: %v", tc.shared, err)
		}
		if joined := strings.Join(p.Args, " "); !strings.Contains(joined, tc.want) {
			t.Errorf("%v with MemPrealloc: %q lacks %q", tc.shared, joined, tc.want)
		}
		vm.MemPrealloc = false
		if p, _ := Build(vm); strings.Contains(strings.Join(p.Args, " "), "prealloc") {
			t.Errorf("%v without MemPrealloc: preallocates", tc.shared)
		}
	}
}
