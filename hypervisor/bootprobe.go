package hypervisor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// ProbeBoot boots kernel (no initrd, no root disk) on the given accelerator
// and reports whether it got as far as panicking for want of a root
// filesystem, which with panic=1 and -no-reboot ends QEMU cleanly. It exists
// because a /dev/kvm that passes DetectAccel's ioctl checks can still fail to
// run a real guest (seen on nested hosts: the guest hangs after its real-mode
// setup code); bound it with ctx (a healthy guest needs ~1 s on KVM, ~5 s on TCG).
func ProbeBoot(ctx context.Context, qemuPath, kernel string, accel Accel) error {
	dir, err := os.MkdirTemp("", "kata-fsx-bootprobe-")
	if err != nil {
		return fmt.Errorf("boot probe: %w", err)
	}
	defer os.RemoveAll(dir)
	console := filepath.Join(dir, "console.log")
	cfg := &VMConfig{
		Name:       "kata-fsx-bootprobe",
		Dir:        filepath.Join(dir, "vm"),
		QEMUPath:   qemuPath,
		Accel:      accel,
		VCPUs:      1,
		MemoryMiB:  256,
		Kernel:     kernel,
		Debug:      true,
		ConsoleLog: console,
	}
	vm, err := Start(ctx, cfg)
	if err != nil {
		return fmt.Errorf("boot probe (%s): %w", accel, err)
	}
	defer vm.Stop(context.Background())
	select {
	case <-vm.Exited():
	case <-ctx.Done():
		return fmt.Errorf("boot probe (%s): guest did not finish booting: %w; console ends %q", accel, ctx.Err(), consoleTail(console))
	}
	if err := vm.Wait(); err != nil {
		return fmt.Errorf("boot probe (%s): %w", accel, err)
	}
	out, err := os.ReadFile(console)
	if err != nil {
		return fmt.Errorf("boot probe (%s): %w", accel, err)
	}
	if !bytes.Contains(out, []byte("Linux version")) || !bytes.Contains(out, []byte("Kernel panic")) {
		return fmt.Errorf("boot probe (%s): QEMU exited before the kernel reached the root mount; console ends %q", accel, consoleTail(console))
	}
	return nil
}

func consoleTail(path string) string {
	out, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if len(out) > 300 {
		out = out[len(out)-300:]
	}
	return string(out)
}
