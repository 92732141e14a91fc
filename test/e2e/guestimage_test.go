package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// guestImageKit returns the kit directory holding the guest image and its
// kernel (make guest-image), or ends the test through testenv.
func guestImageKit(t *testing.T) string {
	t.Helper()
	kit := guestKit(t)
	for _, f := range []string{"vmlinux-kata", "kata-containers.img"} {
		if _, err := os.Stat(filepath.Join(kit, f)); err != nil {
			testenv.Missing(t, "guest image missing (%v): run 'make guest-image' or set KATA_FSX_GUEST_DIR", err)
		}
	}
	return kit
}

// TestRunBootsGuestImage boots pods as Kata boots its guest: `image =`
// (build/guest/kata-containers.img, the agent as /sbin/init), no
// initrd, the kernel with every driver built in; on both rootfs backends,
// with the image on an nvdimm (DAX) and on a virtio-blk disk
// (disable_image_nvdimm). The container proves the guest booted from the
// image: the kernel's root parameter, and the ext4 filesystem mounted from
// that device (/proc/fs/ext4/<dev> exists only for a mounted ext4).
func TestRunBootsGuestImage(t *testing.T) {
	kit := guestImageKit(t)
	for _, tc := range []struct {
		backend, mode string
		// rootFSType is the container's / as the guest sees it.
		rootFSType string
	}{
		{"virtio-fs", "nvdimm", "virtiofs"},
		{"imagefs-blk", "nvdimm", "ext4"},
		{"virtio-fs", "virtio-blk", "virtiofs"},
		{"imagefs-blk", "virtio-blk", "ext4"},
	} {
		t.Run(tc.backend+"/"+tc.mode, func(t *testing.T) {
			boot := fmt.Sprintf("kernel = %q\nimage = %q\n", kit+"/vmlinux-kata", kit+"/kata-containers.img")
			dev := "pmem0p1"
			if tc.mode == "virtio-blk" {
				boot += "disable_image_nvdimm = true\n"
				dev = "vda1"
			}
			// The default agent transport: hybrid vsock on this host.
			e := newEnvBooting(t, kit, boot, "", "")
			rootfs := busyboxRootfs(t)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			script := "echo cmdline: $(cat /proc/cmdline); echo options: $(cat /proc/fs/ext4/" + dev + "/options); " +
				"echo dax: $(cat /sys/block/pmem0/queue/dax 2>/dev/null); cat /proc/mounts"
			r := e.run(ctx, "run", "--backend", tc.backend, "--rootfs", rootfs, "--", "/bin/sh", "-c", script)
			if r.code != 0 {
				t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
			lines := map[string]string{}
			var root string
			for _, l := range strings.Split(r.stdout, "\n") {
				if k, v, ok := strings.Cut(l, ": "); ok {
					lines[k] = v
				}
				if f := strings.Fields(l); len(f) > 2 && f[1] == "/" {
					root = f[2]
				}
			}
			if !strings.Contains(lines["cmdline"], "root=/dev/"+dev+" ") || strings.Contains(lines["cmdline"], "initrd") {
				t.Fatalf("kernel command line %q: want root=/dev/%s\n%s", lines["cmdline"], dev, r.stdout)
			}
			opts := lines["options"]
			if !strings.HasPrefix(opts, "ro ") {
				t.Fatalf("guest root %s is not a read-only ext4 mount (options %q)\n%s", dev, opts, r.stdout)
			}
			if tc.mode == "nvdimm" && (!strings.Contains(opts, "dax") || lines["dax"] != "1") {
				t.Fatalf("guest root on the nvdimm without DAX (ext4 options %q, pmem0 dax %q)\n%s", opts, lines["dax"], r.stdout)
			}
			if root != tc.rootFSType {
				t.Fatalf("container / is %q, want %q\n%s", root, tc.rootFSType, r.stdout)
			}
			if !strings.Contains(r.stderr, "backend "+tc.backend) {
				t.Fatalf("backend not reported: %s", r.stderr)
			}
			// Kata's agent listens on vsock only: the image is reached over it.
			if _, err := os.Stat("/dev/vhost-vsock"); err != nil && !strings.Contains(r.stderr, "agent transport hybrid-vsock") {
				t.Fatalf("the agent was not reached over hybrid vsock: %s", r.stderr)
			}
		})
	}
}

// TestShimContainerdGuestImage runs one pod through containerd (ctr run,
// the shim, imagefs-blk) on the guest image on an nvdimm: the path a Kata
// operator's pods take with Kata's default `image =`.
func TestShimContainerdGuestImage(t *testing.T) {
	kit := guestImageKit(t)
	boot := fmt.Sprintf("kernel = %q\nimage = %q\n", kit+"/vmlinux-kata", kit+"/kata-containers.img")
	ce := newContainerdEnvFor(t, func() *env {
		return newEnvBooting(t, kit, boot, `shared_fs = "imagefs-blk"`+"\n", "")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	r := ce.ctr(ctx, ce.runArgs("--rm", ce.image, "image-pod", "/bin/sh", "-c", `cat /proc/cmdline; grep " / " /proc/mounts`)...)
	if r.code != 0 {
		t.Fatalf("ctr run: exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(r.stdout, "root=/dev/pmem0p1 ") || strings.Contains(r.stdout, "initrd") {
		t.Fatalf("the guest did not boot from the image on an nvdimm:\n%s", r.stdout)
	}
	if got := rootFstype(r.stdout); got != "ext4" {
		t.Fatalf("container / is %q, want ext4 (imagefs-blk):\n%s", got, r.stdout)
	}
}
