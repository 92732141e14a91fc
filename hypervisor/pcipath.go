package hypervisor

import (
	"context"
	"errors"
	"fmt"
	"path"

	"github.com/kata-fsx/kata-fsx/hypervisor/qmp"
)

// maxPCIDepth bounds the walk up the bridge chain; kata-fsx never nests
// bridges, so anything deeper means a confused topology.
const maxPCIDepth = 8

// DevicePCIPath asks QEMU where the device with id sits and returns its guest
// PCI path. Unlike query-pci it works before the firmware has numbered the
// bridges' buses (a VM started with -S), because it follows each device's
// "addr" and "parent_bus" QOM properties up to the host bridge.
func DevicePCIPath(ctx context.Context, q *qmp.Client, id string) (PCIPath, error) {
	obj := "/machine/peripheral/" + id
	var slots []int
	for depth := 0; ; depth++ {
		if depth == maxPCIDepth {
			return "", fmt.Errorf("device %s: PCI bridges nested deeper than %d", id, maxPCIDepth)
		}
		var devfn int
		if err := q.QOMGet(ctx, obj, "addr", &devfn); err != nil {
			var qe *qmp.Error
			// Host bridges are not PCI devices and have no addr: the walk is done.
			if depth > 0 && errors.As(err, &qe) {
				break
			}
			return "", fmt.Errorf("device %s: %w", id, err)
		}
		if devfn < 0 || devfn > 0xff {
			return "", fmt.Errorf("device %s: QEMU reports devfn %d for %s", id, devfn, obj)
		}
		slots = append([]int{devfn >> 3}, slots...)
		var bus string
		if err := q.QOMGet(ctx, obj, "parent_bus", &bus); err != nil {
			return "", fmt.Errorf("device %s: %w", id, err)
		}
		// A bus is a child of the device providing it.
		obj = path.Dir(bus)
	}
	return NewPCIPath(slots...)
}

// DevicePCIPath returns where QEMU placed the device with id; see the
// package-level DevicePCIPath.
func (vm *VM) DevicePCIPath(ctx context.Context, id string) (PCIPath, error) {
	return DevicePCIPath(ctx, vm.qmp, id)
}
