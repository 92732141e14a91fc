package hypervisor

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestHotplugVhostUserFS(t *testing.T) {
	testenv.Root(t, "virtiofsd")
	vfsd := "/usr/lib/qemu/virtiofsd"
	if _, err := filepath.EvalSymlinks(vfsd); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-common): %v", err)
	}
	cfg := testVM(t, "q35")
	work := t.TempDir()
	sock := filepath.Join(work, "fs.sock")
	startDaemon(t, sock, vfsd, "--socket-path="+sock, "-o", "source="+t.TempDir(), "-o", "cache=none", "-o", "sandbox=chroot")
	vm, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop(context.Background())
	ctx := context.Background()

	// No daemon on the socket: the plug fails, and its slot is free again.
	if _, err := vm.HotplugVhostUserFS(ctx, VhostUserFS{ID: "fs-none", SocketPath: filepath.Join(work, "none.sock")}); err == nil {
		t.Fatal("a device with no daemon behind it was plugged")
	}
	p, err := vm.HotplugVhostUserFS(ctx, VhostUserFS{ID: "fs-vol", SocketPath: sock, Tag: "kataShared", QueueSize: 512})
	if err != nil {
		t.Fatal(err)
	}
	if p.Slot.Path != "02/01" {
		t.Errorf("the failed plug kept its slot: the device went to %s", p.Slot.Path)
	}
	if got, err := vm.DevicePCIPath(ctx, "fs-vol"); err != nil || got != p.Slot.Path {
		t.Fatalf("fs-vol at %s (%v), allocator said %s", got, err, p.Slot.Path)
	}
	var tag string
	if err := vm.QMP().QOMGet(ctx, "/machine/peripheral/fs-vol", "tag", &tag); err != nil || tag != "kataShared" {
		t.Errorf("device tag %q (%v), want kataShared", tag, err)
	}
	if _, err := vm.HotplugVhostUserFS(ctx, VhostUserFS{ID: "fs-bad", SocketPath: sock, Tag: "has,comma"}); err == nil {
		t.Error("a tag with a comma was accepted")
	}
}
