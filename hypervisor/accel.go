package hypervisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Accel is a QEMU accelerator.
type Accel string

// Accelerators kata-fsx can run on.
const (
	AccelKVM Accel = "kvm"
	AccelTCG Accel = "tcg"
)

// kvmAPIVersion is the only KVM API version Linux has ever reported (KVM_API_VERSION).
const kvmAPIVersion = 12

// KVM ioctl numbers from <linux/kvm.h>: _IO(KVMIO=0xAE, 0x00) and _IO(KVMIO, 0x01).
const (
	kvmGetAPIVersion = 0xAE00
	kvmCreateVM      = 0xAE01
)

const (
	devKVM        = "/dev/kvm"
	devVhostVsock = "/dev/vhost-vsock"
)

// DetectAccel picks KVM when /dev/kvm opens read-write, answers
// KVM_GET_API_VERSION with 12, creates a VM, and the QEMU binary at qemuPath
// (if given) lists the kvm accelerator; otherwise it falls back to TCG. The
// reason says why, for logs and `kata-fsx check`.
func DetectAccel(ctx context.Context, qemuPath string) (Accel, string) {
	if ok, reason := probeKVM(devKVM); !ok {
		return AccelTCG, reason
	}
	if qemuPath != "" {
		path, err := resolveBinary(qemuPath)
		if err != nil {
			return AccelTCG, err.Error()
		}
		out, err := runQuery(ctx, path, "-accel", "help")
		if err != nil {
			return AccelTCG, fmt.Sprintf("cannot list accelerators: %v", err)
		}
		if !hasLine(string(out), "kvm") {
			return AccelTCG, fmt.Sprintf("%s was built without KVM support", path)
		}
	}
	return AccelKVM, fmt.Sprintf("%s usable (KVM API version %d)", devKVM, kvmAPIVersion)
}

// probeKVM checks that the KVM device at path can really create a VM; an
// openable node is not enough in containers that pass /dev/kvm without the
// module behind it.
func probeKVM(path string) (bool, string) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Sprintf("%s: %s", path, describeErrno(err))
	}
	defer unix.Close(fd)
	v, err := unix.IoctlRetInt(fd, kvmGetAPIVersion)
	if err != nil {
		return false, fmt.Sprintf("%s: KVM_GET_API_VERSION: %s", path, describeErrno(err))
	}
	if v != kvmAPIVersion {
		return false, fmt.Sprintf("%s: KVM API version %d, want %d", path, v, kvmAPIVersion)
	}
	vmfd, err := unix.IoctlRetInt(fd, kvmCreateVM)
	if err != nil {
		return false, fmt.Sprintf("%s: KVM_CREATE_VM: %s", path, describeErrno(err))
	}
	unix.Close(vmfd)
	return true, ""
}

// VsockAvailable reports whether /dev/vhost-vsock can be opened, which
// vhost-vsock-pci needs; the reason explains a false answer.
func VsockAvailable() (bool, string) {
	return openRW(devVhostVsock)
}

func openRW(path string) (bool, string) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			return false, fmt.Sprintf("%s: %s", path, describeErrno(pe.Err))
		}
		return false, err.Error()
	}
	f.Close()
	return true, ""
}

// MemfdAvailable reports whether memfd_create works, which the
// memory-backend-memfd shared-memory backend needs.
func MemfdAvailable() (bool, string) {
	fd, err := unix.MemfdCreate("kata-fsx-probe", unix.MFD_CLOEXEC)
	if err != nil {
		return false, fmt.Sprintf("memfd_create: %s", describeErrno(err))
	}
	unix.Close(fd)
	return true, ""
}

// describeErrno renders the common errnos the way people search for them.
func describeErrno(err error) string {
	switch {
	case errors.Is(err, unix.ENOENT):
		return "no such file"
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
		return "permission denied"
	case errors.Is(err, unix.ENXIO), errors.Is(err, unix.ENODEV):
		return "no device behind the node (module not loaded?)"
	}
	return err.Error()
}

func hasLine(out, want string) bool {
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) == want {
			return true
		}
	}
	return false
}
