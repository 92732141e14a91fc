package sandbox_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestPlanBootsTheGuestImage: with image = the VM gets the image (sized
// from the file) and no initrd; on an nvdimm with Kata's -m slots and a
// maxmem that holds RAM and image, on virtio-blk without them; the plan's
// arguments build.
func TestPlanBootsTheGuestImage(t *testing.T) {
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	dir := t.TempDir()
	img := filepath.Join(dir, "kata-containers.img")
	if err := os.WriteFile(filepath.Join(dir, "vmlinux"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 128<<20); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		extra   string
		blk     bool
		wantArg string
	}{
		{"nvdimm", "", false, "root=/dev/pmem0p1"},
		{"virtio-blk", "disable_image_nvdimm = true\n", true, "root=/dev/vda1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "configuration.toml")
			cfgText := "[hypervisor.qemu]\npath = \"" + qemu + "\"\nkernel = \"" + dir + "/vmlinux\"\nimage = \"" + img + "\"\n" +
				"default_memory = 256\nshared_fs = \"virtio-9p\"\n" + tc.extra +
				"[kata_fsx]\naccelerator = \"tcg\"\nagent_transport = \"virtio-serial\"\nstate_dir = \"" + filepath.Join(dir, "run") + "\"\n"
			if err := os.WriteFile(p, []byte(cfgText), 0o644); err != nil {
				t.Fatal(err)
			}
			cfg, err := config.LoadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			vmc, err := sandbox.PlanForTest(context.Background(), cfg, "img")
			if err != nil {
				t.Fatal(err)
			}
			if vmc.Image == nil || vmc.Image.Path != img || vmc.Image.Size != 128<<20 || vmc.Image.VirtioBlk != tc.blk || vmc.Initrd != "" {
				t.Fatalf("image %+v initrd %q", vmc.Image, vmc.Initrd)
			}
			if tc.blk && (vmc.MemorySlots != 0 || vmc.MaxMemoryMiB != 0) {
				t.Errorf("virtio-blk image with memory slots %d maxmem %d", vmc.MemorySlots, vmc.MaxMemoryMiB)
			}
			if !tc.blk && (vmc.MemorySlots != 10 || vmc.MaxMemoryMiB < 256+128+1024) {
				t.Errorf("nvdimm image with memory slots %d maxmem %d MiB", vmc.MemorySlots, vmc.MaxMemoryMiB)
			}
			vmc.QMPSocket = filepath.Join(dir, "qmp.sock")
			plan, err := hypervisor.Build(vmc)
			if err != nil {
				t.Fatal(err)
			}
			if joined := strings.Join(plan.Args, " "); !strings.Contains(joined, tc.wantArg) || strings.Contains(joined, "-initrd") {
				t.Errorf("arguments lack %s or carry -initrd: %s", tc.wantArg, joined)
			}
		})
	}
	// A missing image is the pod's error, naming the key.
	p := filepath.Join(t.TempDir(), "configuration.toml")
	if err := os.WriteFile(p, []byte("[hypervisor.qemu]\npath = \""+qemu+"\"\nkernel = \""+dir+"/vmlinux\"\nimage = \""+dir+"/missing.img\"\nshared_fs = \"virtio-9p\"\n[kata_fsx]\naccelerator = \"tcg\"\nagent_transport = \"virtio-serial\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sandbox.PlanForTest(context.Background(), cfg, "img"); err == nil || !strings.Contains(err.Error(), "hypervisor.qemu.image") {
		t.Fatalf("missing image: %v", err)
	}
}
