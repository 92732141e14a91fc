// Package pci resolves Kata's PCI paths (slot numbers from the root bus
// down through bridges, as the host's hot-plug hands them over) to devices
// in the guest's sysfs; the storage and network parts both find their
// devices this way.
package pci

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// HotplugTimeout bounds the wait for a hot-plugged device (a disk, a NIC)
// to appear in the guest once the host has added it.
const HotplugTimeout = 20 * time.Second

var pciSlot = regexp.MustCompile(`^[0-9a-fA-F]{1,2}$`)

// ParsePath parses Kata's PCI path: slot numbers (hex) from the root bus
// down through bridges, e.g. "02/01".
func ParsePath(p string) ([]uint8, error) {
	parts := strings.Split(p, "/")
	if len(parts) == 0 || len(parts) > 8 {
		return nil, fmt.Errorf("PCI path %q: want 1 to 8 slots", p)
	}
	slots := make([]uint8, 0, len(parts))
	for _, part := range parts {
		if !pciSlot.MatchString(part) {
			return nil, fmt.Errorf("PCI path %q: bad slot %q", p, part)
		}
		v, err := strconv.ParseUint(part, 16, 8)
		if err != nil || v > 0x1f {
			return nil, fmt.Errorf("PCI path %q: slot %q out of range", p, part)
		}
		slots = append(slots, uint8(v))
	}
	return slots, nil
}

// DeviceDir walks a PCI path from the root bus under sysDevices (the
// guest's /sys/devices): each slot is function 0 of that slot on the bus
// behind the previous bridge.
func DeviceDir(sysDevices string, slots []uint8) (string, error) {
	roots, err := filepath.Glob(filepath.Join(sysDevices, "pci0000:*"))
	if err != nil || len(roots) == 0 {
		return "", errors.New("no PCI root bus in sysfs")
	}
	dir := roots[0]
	for i, slot := range slots {
		suffix := fmt.Sprintf(":%02x.0", slot)
		entries, err := os.ReadDir(dir)
		if err != nil {
			return "", fmt.Errorf("PCI path element %d: %w", i+1, err)
		}
		found := ""
		for _, e := range entries {
			n := e.Name()
			// Children are named DDDD:BB:SS.F; the bus part is whatever the
			// firmware assigned behind the bridge.
			if len(n) == 12 && strings.HasSuffix(n, suffix) && n[4] == ':' {
				found = n
				break
			}
		}
		if found == "" {
			return "", fmt.Errorf("no PCI device at slot %02x (path element %d) under %s", slot, i+1, dir)
		}
		dir = filepath.Join(dir, found)
	}
	return dir, nil
}
