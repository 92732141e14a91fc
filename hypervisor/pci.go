package hypervisor

import (
	"fmt"
	"strings"
	"sync"
)

// PCIPath is a guest PCI path in Kata's format: the slot of each bridge from
// the root bus down to the device, two hex digits each, joined by "/"
// ("02" for a root-bus device, "02/01" behind the bridge in slot 2).
type PCIPath string

// NewPCIPath formats slots (each 0..31) as a PCIPath.
func NewPCIPath(slots ...int) (PCIPath, error) {
	if len(slots) == 0 {
		return "", fmt.Errorf("empty PCI path")
	}
	parts := make([]string, len(slots))
	for i, s := range slots {
		if s < 0 || s > 31 {
			return "", fmt.Errorf("PCI slot %d out of range 0..31", s)
		}
		parts[i] = fmt.Sprintf("%02x", s)
	}
	return PCIPath(strings.Join(parts, "/")), nil
}

// String returns the path as the agent expects it.
func (p PCIPath) String() string { return string(p) }

// pciLocation is where a device is plugged.
type pciLocation struct {
	bus  string
	slot int
	path PCIPath
}

func (l pciLocation) props() string { return fmt.Sprintf("bus=%s,addr=%#x", l.bus, l.slot) }

// rootBus hands out root-bus slots in order.
type rootBus struct {
	name      string
	free, max int
}

// newRootBus knows the free slots of the two machine families: on q35 slot
// 0 is the host bridge and 0x1f the ICH9 LPC/SATA/SMBus functions; on pc slot
// 0 is the host bridge and 1 the PIIX3. Both start at 2, like Kata.
func newRootBus(machine string) (*rootBus, error) {
	switch {
	case machine == "q35" || strings.HasPrefix(machine, "pc-q35-"):
		return &rootBus{name: "pcie.0", free: 2, max: 0x1e}, nil
	case machine == "pc" || strings.HasPrefix(machine, "pc-i440fx-"):
		return &rootBus{name: "pci.0", free: 2, max: 0x1f}, nil
	case machine == "microvm":
		return nil, invalid("machine type microvm has no PCI bus and hangs at random under TCG: use q35 or pc")
	}
	return nil, invalid("machine type %q: want q35 or pc (or a versioned pc-q35-*/pc-i440fx-*)", machine)
}

func (b *rootBus) next(id string) (pciLocation, error) {
	if b.free > b.max {
		return pciLocation{}, invalid("no free slot on %s for %s: too many PCI devices", b.name, id)
	}
	slot := b.free
	b.free++
	p, err := NewPCIPath(slot)
	if err != nil {
		return pciLocation{}, err
	}
	return pciLocation{bus: b.name, slot: slot, path: p}, nil
}

// HotplugSlot is a free slot behind the hot-plug bridge.
type HotplugSlot struct {
	// Bus and Addr are the device_add "bus" and "addr" arguments.
	Bus  string
	Addr string
	// Slot is the slot number on Bus.
	Slot int
	// Path is the guest PCI path of a device plugged there.
	Path PCIPath
}

// Props returns the bus/addr properties for a QMP device_add.
func (s HotplugSlot) Props() map[string]any { return map[string]any{"bus": s.Bus, "addr": s.Addr} }

// HotplugAllocator hands out the hot-plug slots reserved on the bridge; it is safe for concurrent use.
type HotplugAllocator struct {
	bus        string
	bridgePath PCIPath
	// mu guards used alone, a leaf lock: taking and releasing a slot
	// wait for nothing.
	mu   sync.Mutex
	used []bool // index = slot; slot 0 stays unused
}

func newHotplugAllocator(bus string, bridgePath PCIPath, slots int) *HotplugAllocator {
	return &HotplugAllocator{bus: bus, bridgePath: bridgePath, used: make([]bool, slots+1)}
}

// NextHotplugSlot reserves the lowest free slot, or returns ErrNoHotplugSlot.
func (a *HotplugAllocator) NextHotplugSlot() (HotplugSlot, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for slot := 1; slot < len(a.used); slot++ {
		if !a.used[slot] {
			a.used[slot] = true
			return HotplugSlot{Bus: a.bus, Addr: fmt.Sprintf("%#x", slot), Slot: slot, Path: PCIPath(fmt.Sprintf("%s/%02x", a.bridgePath, slot))}, nil
		}
	}
	return HotplugSlot{}, fmt.Errorf("%w: all %d slots on %s are in use", ErrNoHotplugSlot, len(a.used)-1, a.bus)
}

// Release returns a slot after its device was removed (DEVICE_DELETED).
func (a *HotplugAllocator) Release(s HotplugSlot) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if s.Bus != a.bus || s.Slot < 1 || s.Slot >= len(a.used) || !a.used[s.Slot] {
		return fmt.Errorf("release of hot-plug slot %s addr %s: not allocated", s.Bus, s.Addr)
	}
	a.used[s.Slot] = false
	return nil
}
