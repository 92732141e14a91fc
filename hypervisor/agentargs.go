package hypervisor

import "fmt"

// hybridVsockID is the QEMU id of the vhost-user-vsock-pci device and,
// prefixed with "char", of its chardev.
const hybridVsockID = "vsock0"

// vsockDeviceID is Kata's id for the vhost-vsock-pci device.
func vsockDeviceID(cid uint32) string { return fmt.Sprintf("vsock-%d", cid) }

// agentChannel adds the agent channel's devices on the root bus.
func (b *argBuilder) agentChannel(vm *VMConfig, bus *rootBus) error {
	a := vm.Agent
	switch a.Transport {
	case AgentVsock:
		id := vsockDeviceID(a.GuestCID)
		loc, err := bus.next(id)
		if err != nil {
			return err
		}
		dev := "vhost-vsock-pci,id=" + id
		if a.VhostFD != nil {
			// QEMU uses the fd that holds the CID instead of opening
			// /dev/vhost-vsock and claiming it again itself.
			dev += fmt.Sprintf(",vhostfd=%d", 3+len(b.plan.ExtraFiles))
			b.plan.ExtraFiles = append(b.plan.ExtraFiles, a.VhostFD)
		}
		b.add("-device", fmt.Sprintf("%s,guest-cid=%d,%s", dev, a.GuestCID, loc.props()))
		b.plan.PCIPaths[id] = loc.path
	case AgentHybridVsock:
		loc, err := bus.next(hybridVsockID)
		if err != nil {
			return err
		}
		// No guest-cid: vhost-user-vsock-pci reads it from the backend's
		// config space.
		b.add("-chardev", fmt.Sprintf("socket,id=char%s,path=%s", hybridVsockID, escapeOpt(a.SocketPath)))
		b.add("-device", fmt.Sprintf("vhost-user-vsock-pci,id=%s,chardev=char%s,%s", hybridVsockID, hybridVsockID, loc.props()))
		b.plan.PCIPaths[hybridVsockID] = loc.path
	case AgentSerial:
		loc, err := bus.next("serial0")
		if err != nil {
			return err
		}
		b.add("-device", "virtio-serial-pci,id=serial0,"+loc.props())
		b.add("-chardev", "socket,id=charch0,path="+escapeOpt(a.SocketPath)+",server=on,wait=off")
		b.add("-device", "virtserialport,bus=serial0.0,chardev=charch0,id=channel0,name=agent.channel.0")
		b.plan.PCIPaths["serial0"] = loc.path
	}
	return nil
}

// validateAgent checks the agent channel against the transport's needs.
func validateAgent(vm *VMConfig) error {
	a := vm.Agent
	if a.VhostFD != nil && a.Transport != AgentVsock {
		return invalid("a vhost fd is only used by agent transport %q", AgentVsock)
	}
	switch a.Transport {
	case AgentVsock:
		if a.GuestCID < MinGuestCID || a.GuestCID > MaxGuestCID {
			return invalid("vsock guest CID %d: want %d..%d", a.GuestCID, MinGuestCID, MaxGuestCID)
		}
		return needDevice(vm, "vhost-vsock-pci")
	case AgentHybridVsock:
		if err := checkSocketPath("hybrid vsock vhost-user socket", a.SocketPath); err != nil {
			return err
		}
		if vm.SharedMemory == SharedMemoryOff {
			return fmt.Errorf("agent channel %s (vhost-user-vsock-pci): %w", hybridVsockID, ErrSharedMemoryRequired)
		}
		return needDevice(vm, "vhost-user-vsock-pci")
	case AgentSerial:
		if err := checkSocketPath("agent socket", a.SocketPath); err != nil {
			return err
		}
		return needDevice(vm, "virtio-serial-pci")
	case "":
		return nil
	}
	return invalid("agent transport %q: want %q, %q or %q", a.Transport, AgentVsock, AgentHybridVsock, AgentSerial)
}
