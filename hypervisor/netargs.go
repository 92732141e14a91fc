package hypervisor

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// NIC is a virtio-net-pci device fed by a tap's queue fds, as Kata's QEMU
// gets a tcfilter endpoint: the tap lives in the pod's network namespace
// and QEMU, outside it, only holds the fds.
type NIC struct {
	// ID is the QEMU id of the device; its netdev is "net-" + ID.
	ID string
	// MAC is the guest NIC's address: the pod interface's, which the
	// network plugin expects to see traffic from.
	MAC net.HardwareAddr
	// TapFiles are the tap's queue fds, one per queue; QEMU inherits them (fds=).
	TapFiles []*os.File
	// VhostFiles are open /dev/vhost-net fds, one per queue (vhost=on,
	// vhostfds=); empty for virtio-net in QEMU's userspace.
	VhostFiles []*os.File
}

// netdevID is the -netdev id of n.
func (n *NIC) netdevID() string { return "net-" + n.ID }

// validate checks n against QEMU's rules for a tap netdev.
func (n *NIC) validate(vm *VMConfig) error {
	if len(n.TapFiles) == 0 {
		return invalid("NIC %s: no tap fds", n.ID)
	}
	for i, f := range n.TapFiles {
		if f == nil {
			return invalid("NIC %s: tap fd %d is nil", n.ID, i)
		}
	}
	if len(n.VhostFiles) != 0 && len(n.VhostFiles) != len(n.TapFiles) {
		return invalid("NIC %s: %d vhost fds for %d queues: want one per queue or none", n.ID, len(n.VhostFiles), len(n.TapFiles))
	}
	for i, f := range n.VhostFiles {
		if f == nil {
			return invalid("NIC %s: vhost fd %d is nil", n.ID, i)
		}
	}
	if len(n.MAC) != 6 || n.MAC[0]&1 != 0 {
		return invalid("NIC %s: MAC %q: want a unicast Ethernet address", n.ID, n.MAC)
	}
	return needDevice(vm, "virtio-net-pci")
}

// nics adds the NICs on the root bus after the other cold-plugged devices,
// handing QEMU their fds.
func (b *argBuilder) nics(vm *VMConfig, bus *rootBus) error {
	for _, n := range vm.NICs {
		loc, err := bus.next(n.ID)
		if err != nil {
			return err
		}
		netdev := "tap,id=" + n.netdevID() + ",fds=" + b.passFiles(n.TapFiles)
		if len(n.VhostFiles) > 0 {
			netdev += ",vhost=on,vhostfds=" + b.passFiles(n.VhostFiles)
		}
		b.add("-netdev", netdev)
		dev := fmt.Sprintf("virtio-net-pci,id=%s,netdev=%s,mac=%s,disable-modern=false", n.ID, n.netdevID(), n.MAC)
		if q := len(n.TapFiles); q > 1 {
			// Kata's sizing: a vector per queue each way, plus config and control.
			dev += ",mq=on,vectors=" + strconv.Itoa(2*q+2)
		}
		// No option ROM: PXE boot is never used, and QEMU refuses to
		// start when its ROM file is not installed.
		b.add("-device", dev+",romfile=,"+loc.props())
		b.plan.PCIPaths[n.ID] = loc.path
	}
	return nil
}

// passFiles appends files to the ones QEMU inherits and returns their fd
// numbers in QEMU, colon-separated as fds= and vhostfds= take them.
func (b *argBuilder) passFiles(files []*os.File) string {
	var fds []string
	for _, f := range files {
		fds = append(fds, strconv.Itoa(3+len(b.plan.ExtraFiles)))
		b.plan.ExtraFiles = append(b.plan.ExtraFiles, f)
	}
	return strings.Join(fds, ":")
}

// validateNICs checks the NICs; ids holds the ids already taken.
func validateNICs(vm *VMConfig, ids map[string]bool) error {
	for i, n := range vm.NICs {
		if n == nil {
			return invalid("NIC %d is nil", i)
		}
		for _, id := range []string{n.ID, n.netdevID()} {
			if !qemuIDRE.MatchString(id) {
				return invalid("NIC id %q: want a letter then letters, digits, '-', '.', '_' (at most 64)", id)
			}
			if ids[id] {
				return invalid("NIC id %q is used twice", id)
			}
			ids[id] = true
		}
		if err := n.validate(vm); err != nil {
			return err
		}
	}
	return nil
}
