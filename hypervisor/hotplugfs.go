package hypervisor

import (
	"context"
	"errors"
	"fmt"
)

// PluggedFS is a vhost-user-fs-pci device hot-plugged into a running VM.
type PluggedFS struct {
	Device VhostUserFS
	Slot   HotplugSlot

	chardevAdded bool
	deviceAdded  bool
}

// HotplugVhostUserFS plugs a vhost-user-fs-pci device into a free slot of
// the hot-plug bridge, for a share that starts after the VM booted. The
// daemon must already listen on d.SocketPath: QEMU connects when the
// chardev is added. On error nothing of the device is left in QEMU.
func (vm *VM) HotplugVhostUserFS(ctx context.Context, d VhostUserFS) (_ *PluggedFS, err error) {
	if d.ID == "" {
		return nil, invalid("vhost-user-fs device has no id")
	}
	if err := d.validate(&vm.cfg); err != nil {
		return nil, err
	}
	slot, err := vm.NextHotplugSlot()
	if err != nil {
		return nil, fmt.Errorf("hot-plug %s: %w", d.ID, err)
	}
	p := &PluggedFS{Device: d, Slot: slot}
	defer func() {
		if err != nil {
			if uerr := vm.UnplugVhostUserFS(context.WithoutCancel(ctx), p); uerr != nil {
				err = errors.Join(err, fmt.Errorf("undo the hot-plug: %w", uerr))
			}
		}
	}()
	q := vm.QMP()
	chardev := "char-" + d.ID
	if err := q.ChardevAddSocket(ctx, chardev, d.SocketPath); err != nil {
		return p, fmt.Errorf("chardev-add %s (%s): %w", chardev, d.SocketPath, err)
	}
	p.chardevAdded = true
	props := slot.Props()
	props["chardev"] = chardev
	props["tag"] = orDefault(d.Tag, defaultFSTag)
	props["queue-size"] = orDefault(d.QueueSize, defaultFSQueue)
	if d.DAXWindowMiB > 0 {
		props["cache-size"] = d.DAXWindowMiB << 20
	}
	if err := q.DeviceAdd(ctx, "vhost-user-fs-pci", d.ID, props); err != nil {
		return p, fmt.Errorf("device_add vhost-user-fs-pci %s: %w", d.ID, err)
	}
	p.deviceAdded = true
	return p, nil
}

// UnplugVhostUserFS undoes HotplugVhostUserFS as far as it got: device_del
// (waiting for the guest to release the device, so its filesystem must be
// unmounted), chardev-remove and the slot. A step that fails is left for
// a later call or for QEMU's exit.
func (vm *VM) UnplugVhostUserFS(ctx context.Context, p *PluggedFS) error {
	q := vm.QMP()
	if p.deviceAdded {
		if err := q.DeviceDel(ctx, p.Device.ID); err != nil {
			return fmt.Errorf("device_del %s: %w", p.Device.ID, err)
		}
		p.deviceAdded = false
	}
	if p.chardevAdded {
		if err := q.ChardevRemove(ctx, "char-"+p.Device.ID); err != nil {
			return fmt.Errorf("chardev-remove char-%s: %w", p.Device.ID, err)
		}
		p.chardevAdded = false
	}
	if p.Slot.Bus != "" {
		if err := vm.ReleaseHotplugSlot(p.Slot); err != nil {
			return err
		}
		p.Slot = HotplugSlot{}
	}
	return nil
}
