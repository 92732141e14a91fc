package vhostblk

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/vhostuser"
)

// guestScript is /init of a throwaway initramfs: it loads the virtio-blk and
// ext4 modules, mounts the disk our backend serves, reads, writes, deletes
// (with online discard), runs fstrim, unmounts and powers off.
const guestScript = `#!/bin/busybox sh
B=/bin/busybox
$B mount -t devtmpfs dev /dev
exec 0</dev/console 1>/dev/console 2>&1
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk crc16 crc32c_generic mbcache jbd2 ext4; do
  $B insmod /m/$m.ko || echo "INSMOD-FAIL $m"
done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do $B sleep 0.1; i=$((i+1)); done
echo "SIZE $($B cat /sys/block/vda/size)"
echo "QUEUES $($B ls /sys/block/vda/mq | $B wc -l)"
echo "DISCARDMAX $($B cat /sys/block/vda/queue/discard_max_bytes)"
echo "SERIAL $($B cat /sys/block/vda/serial)"
$B mkdir -p /mnt
$B mount -t ext4 -o discard /dev/vda /mnt || echo MOUNT-FAIL
echo "HELLO $($B cat /mnt/hello.txt)"
echo "BIGSUM $($B md5sum /mnt/big.bin)"
$B dd if=/dev/urandom of=/mnt/new.bin bs=4096 count=300 2>/dev/null
echo "NEWSUM $($B md5sum /mnt/new.bin)"
echo guest-was-here > /mnt/guest.txt
$B rm /mnt/big.bin
$B sync
$B fstrim /mnt && echo FSTRIM-OK
$B umount /mnt && echo UMOUNT-OK
echo GUEST-DONE
$B poweroff -f
`

// TestGuestLinux boots a Linux guest (TCG) whose virtio-blk driver talks to
// this backend over two queues: an ext4 image made by mkfs.ext4 is the
// base, the guest mounts it, reads a file, writes one, deletes one with
// discard; the host then checks the copy-on-write result with e2fsck and
// debugfs. Needs a guest kernel and its modules (KATA_FSX_VMLINUX with
// the modules under /lib/modules, or by default the guest kit of
// KATA_FSX_GUEST_DIR or build/guest, whose initrd carries them), busybox,
// cpio, e2fsprogs and QEMU.
func TestGuestLinux(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest under TCG; skipped in -short mode")
	}
	need := map[string]string{}
	for _, tp := range [][2]string{{"qemu-system-x86_64", "qemu-system-x86"}, {"cpio", "cpio"}, {"mkfs.ext4", "e2fsprogs"}, {"e2fsck", "e2fsprogs"}, {"debugfs", "e2fsprogs"}} {
		need[tp[0]] = testenv.Tool(t, tp[0], tp[1])
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		testenv.Missing(t, "/bin/busybox missing (apt-get install busybox-static): %v", err)
	}
	vmlinux := os.Getenv("KATA_FSX_VMLINUX")
	if vmlinux == "" {
		kit := os.Getenv("KATA_FSX_GUEST_DIR")
		if kit == "" {
			kit = "../../build/guest"
		}
		vmlinux = filepath.Join(kit, "vmlinux")
	}
	if _, err := os.Stat(vmlinux); err != nil {
		testenv.Missing(t, "guest kernel missing (run 'make guest' or set KATA_FSX_GUEST_DIR): %v", err)
	}
	release, err := kernelRelease(vmlinux)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	modDir := kernelModules(t, vmlinux, release, need["cpio"], filepath.Join(dir, "kit-modules"))

	// Base: an ext4 image with a text file and a 1 MiB random file.
	content := filepath.Join(dir, "content")
	os.Mkdir(content, 0o755)
	os.WriteFile(filepath.Join(content, "hello.txt"), []byte("hello from the base image"), 0o644)
	big := randomBytes(42, 1<<20)
	os.WriteFile(filepath.Join(content, "big.bin"), big, 0o644)
	img := filepath.Join(dir, "base.img")
	run(t, need["mkfs.ext4"], "-q", "-F", "-b", "4096", "-d", content, img, "64M")
	baseF, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer baseF.Close()
	st, _ := baseF.Stat()
	dev, err := overlay.Open(baseF, st.Size(), filepath.Join(dir, "overlay"), overlay.Options{Serial: "kfsx-guest-test"})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	sock := filepath.Join(dir, "vu", "blk.sock")
	srv, err := Serve(context.Background(), sock, dev, Options{NumQueues: 2, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	initrd := buildInitramfs(t, dir, modDir, need["cpio"])
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var console bytes.Buffer
	cmd := exec.CommandContext(ctx, need["qemu-system-x86_64"],
		"-machine", "q35,accel=tcg", "-smp", "2", "-m", "256M",
		"-object", "memory-backend-memfd,id=mem,size=256M,share=on", "-numa", "node,memdev=mem",
		"-kernel", vmlinux, "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 tsc=reliable no_timer_check rdinit=/init",
		"-nographic", "-nodefaults", "-no-reboot", "-serial", "stdio",
		"-chardev", "socket,id=c,path="+sock,
		"-device", "vhost-user-blk-pci,chardev=c,num-queues=2",
	)
	cmd.Stdout = &console
	cmd.Stderr = &console
	if err := cmd.Run(); err != nil {
		t.Fatalf("qemu: %v\n%s", err, console.String())
	}
	out := console.String()
	field := func(name string) string {
		m := regexp.MustCompile(`(?m)^` + name + ` (.*?)\r?$`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("guest printed no %s line:\n%s", name, out)
		}
		return strings.TrimSpace(m[1])
	}
	for _, bad := range []string{"INSMOD-FAIL", "MOUNT-FAIL", "I/O error", "EXT4-fs error"} {
		if strings.Contains(out, bad) {
			t.Fatalf("guest reported %q:\n%s", bad, out)
		}
	}
	for _, good := range []string{"FSTRIM-OK", "UMOUNT-OK", "GUEST-DONE"} {
		if !strings.Contains(out, good) {
			t.Fatalf("guest did not print %q:\n%s", good, out)
		}
	}
	if got := field("SIZE"); got != fmt.Sprint(st.Size()/512) {
		t.Errorf("guest sees %s sectors, want %d", got, st.Size()/512)
	}
	if got := field("QUEUES"); got != "2" {
		t.Errorf("guest uses %s queues, want 2", got)
	}
	if got := field("SERIAL"); got != "kfsx-guest-test" {
		t.Errorf("guest serial %q", got)
	}
	if got := field("DISCARDMAX"); got == "0" {
		t.Error("guest sees no discard support")
	}
	if got := field("HELLO"); got != "hello from the base image" {
		t.Errorf("guest read %q", got)
	}
	sum := md5.Sum(big)
	if got := field("BIGSUM"); !strings.HasPrefix(got, hex.EncodeToString(sum[:])) {
		t.Errorf("guest md5 of big.bin %q, want %x", got, sum)
	}
	newSum := strings.Fields(field("NEWSUM"))[0]
	t.Logf("guest console:\n%s", out)

	// Host side: materialize the disk as the guest left it and check it.
	result := filepath.Join(dir, "result.img")
	buf := make([]byte, st.Size())
	if _, err := dev.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(result, buf, 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, need["e2fsck"], "-fn", result)
	if got := run(t, need["debugfs"], "-R", "cat /guest.txt", result); strings.TrimSpace(got) != "guest-was-here" {
		t.Errorf("debugfs cat /guest.txt = %q", got)
	}
	dump := filepath.Join(dir, "new.bin")
	run(t, need["debugfs"], "-R", "dump /new.bin "+dump, result)
	nb, err := os.ReadFile(dump)
	if err != nil || len(nb) != 300*4096 {
		t.Fatalf("new.bin from the result: %d bytes, %v", len(nb), err)
	}
	if s := md5.Sum(nb); hex.EncodeToString(s[:]) != newSum {
		t.Errorf("new.bin md5 on host %x, guest said %s", s, newSum)
	}
	if got := run(t, need["debugfs"], "-R", "ls -l /", result); strings.Contains(got, "big.bin") {
		t.Errorf("big.bin still listed:\n%s", got)
	}
	if len(dev.DirtyRanges()) == 0 {
		t.Error("no dirty blocks after guest writes")
	}
	t.Logf("requests from QEMU: %s", srv.RequestSummary())
	for _, r := range []vhostuser.Request{vhostuser.ReqSetFeatures, vhostuser.ReqAddMemReg, vhostuser.ReqSetVringKick, vhostuser.ReqSetVringEnable, vhostuser.ReqGetVringBase} {
		if srv.Requests(r) == 0 {
			t.Errorf("QEMU never sent %v", r)
		}
	}
	wctx, wcancel := context.WithTimeout(context.Background(), feWait)
	defer wcancel()
	if s, err := srv.WaitStats(wctx, func(s Stats) bool { return s.Disconnects >= 1 }); err != nil || s.Connections != 1 || s.LastError != nil {
		t.Errorf("server stats after guest: %+v, %v", s, err)
	}
}

func run(t *testing.T, prog string, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	c := exec.Command(prog, args...)
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		t.Fatalf("%s %v: %v\n%s%s", prog, args, err, stdout.String(), stderr.String())
	}
	return stdout.String()
}

// kernelModules returns the kernel/ directory of release's modules: the
// host's under /lib/modules, else those in the initrd beside vmlinux (a
// guest kit's), unpacked into dst. CI machines have no kernel package
// installed, only the kit.
func kernelModules(t *testing.T, vmlinux, release, cpio, dst string) string {
	t.Helper()
	host := filepath.Join("/lib/modules", release, "kernel")
	if _, err := os.Stat(host); err == nil {
		return host
	}
	initrd := filepath.Join(filepath.Dir(vmlinux), "initrd.img")
	f, err := os.Open(initrd)
	if err != nil {
		testenv.Missing(t, "modules for %s: not in /lib/modules (apt-get install linux-image-amd64) and no guest kit initrd beside %s ('make guest'): %v", release, vmlinux, err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("%s: %v", initrd, err)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	c := exec.Command(cpio, "-idm", "--quiet", "*.ko")
	c.Dir, c.Stdin = dst, zr
	if b, err := c.CombinedOutput(); err != nil {
		t.Fatalf("unpacking the modules of %s: %v\n%s", initrd, err, b)
	}
	mods := filepath.Join(dst, "lib", "modules", release, "kernel")
	if _, err := os.Stat(mods); err != nil {
		t.Fatalf("%s holds no modules for %s (a kit of another kernel?): %v", initrd, release, err)
	}
	return mods
}

// kernelRelease finds "Linux version X " in an uncompressed kernel image.
func kernelRelease(vmlinux string) (string, error) {
	b, err := os.ReadFile(vmlinux)
	if err != nil {
		return "", err
	}
	m := regexp.MustCompile(`Linux version (\S+) `).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("no version string in %s", vmlinux)
	}
	return string(m[1]), nil
}

func buildInitramfs(t *testing.T, dir, modDir, cpio string) string {
	t.Helper()
	root := filepath.Join(dir, "initramfs")
	for _, d := range []string{"bin", "dev", "proc", "sys", "m", "mnt"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "bin", "busybox"), bb, 0o755)
	os.WriteFile(filepath.Join(root, "init"), []byte(guestScript), 0o755)
	if err := unix.Mknod(filepath.Join(root, "dev", "console"), unix.S_IFCHR|0o600, int(unix.Mkdev(5, 1))); err != nil {
		t.Logf("mknod /dev/console: %v (init redirects after mounting devtmpfs)", err)
	}
	mods := map[string]string{
		"virtio_ring": "drivers/virtio", "virtio": "drivers/virtio", "virtio_pci_modern_dev": "drivers/virtio",
		"virtio_pci_legacy_dev": "drivers/virtio", "virtio_pci": "drivers/virtio", "virtio_blk": "drivers/block",
		"crc16": "lib", "crc32c_generic": "crypto", "mbcache": "fs", "jbd2": "fs/jbd2", "ext4": "fs/ext4",
	}
	for m, sub := range mods {
		b, err := os.ReadFile(filepath.Join(modDir, sub, m+".ko"))
		if err != nil {
			t.Fatalf("module %s of the guest kernel: %v", m, err)
		}
		os.WriteFile(filepath.Join(root, "m", m+".ko"), b, 0o644)
	}
	out := filepath.Join(dir, "initrd.cpio")
	c := exec.Command("sh", "-c", "find . | "+cpio+" -o -H newc --quiet > "+out)
	c.Dir = root
	if b, err := c.CombinedOutput(); err != nil {
		t.Fatalf("cpio: %v\n%s", err, b)
	}
	return out
}
