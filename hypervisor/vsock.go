package hypervisor

import (
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Guest vsock context ids: 0-2 are reserved (hypervisor, local, host) and
// 2^32-1 is VMADDR_CID_ANY, which vhost-vsock refuses as a guest's CID.
const (
	MinGuestCID uint32 = 3
	MaxGuestCID uint32 = 1<<32 - 2
)

// cidSearch is FindContextID's walk with what it touches injected: the
// CID ioctl, the random start and the top of the range, so tests can run
// it without /dev/vhost-vsock and exhaust a small range.
type cidSearch struct {
	// setCID claims cid for the vhost-vsock fd (VHOST_VSOCK_SET_GUEST_CID).
	setCID func(fd uintptr, cid uint64) error
	// random returns a number in [0, n).
	random func(n uint64) (uint64, error)
	// max is the highest CID tried.
	max uint32
}

// FindContextID opens /dev/vhost-vsock and claims a guest CID on it the
// way Kata does (utils.FindContextID): a random start in [3, 2^32-1) so
// that other processes cannot predict and squat it, then upwards to the
// top, then downwards from the start to 3, skipping CIDs in use. The open
// file holds the CID: pass it to QEMU (AgentChannel.VhostFD) and close it
// only once QEMU has exited.
func FindContextID() (*os.File, uint32, error) {
	f, err := os.OpenFile(devVhostVsock, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("vhost-vsock guest CID: %w", err)
	}
	cid, err := defaultCIDSearch().find(f.Fd())
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("vhost-vsock guest CID on %s: %w", devVhostVsock, err)
	}
	return f, cid, nil
}

func defaultCIDSearch() cidSearch {
	return cidSearch{setCID: setGuestCID, random: randomBelow, max: MaxGuestCID}
}

// find walks the CIDs from a random start. Only EADDRINUSE moves it on:
// Kata retries on any error, but any other answer (EINVAL, ENOTTY from a
// node that is not vhost-vsock, EFAULT) would be the same for every CID
// and turn into four billion ioctls.
func (s cidSearch) find(fd uintptr) (uint32, error) {
	start := MinGuestCID
	n, err := s.random(uint64(s.max-MinGuestCID) + 1)
	if err != nil {
		return 0, fmt.Errorf("random start: %w", err)
	}
	start += uint32(n)
	try := func(cid uint32) (bool, error) {
		err := s.setCID(fd, uint64(cid))
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, unix.EADDRINUSE):
			return false, nil
		}
		return false, fmt.Errorf("VHOST_VSOCK_SET_GUEST_CID %d: %w", cid, err)
	}
	for cid := uint64(start); cid <= uint64(s.max); cid++ {
		if ok, err := try(uint32(cid)); ok || err != nil {
			return uint32(cid), err
		}
	}
	for cid := start - 1; cid >= MinGuestCID; cid-- {
		if ok, err := try(cid); ok || err != nil {
			return cid, err
		}
	}
	return 0, fmt.Errorf("every guest CID from %d to %d is in use: %w", MinGuestCID, s.max, unix.EADDRINUSE)
}

// setGuestCID is the VHOST_VSOCK_SET_GUEST_CID ioctl; the kernel reads the
// CID through the pointer as a __u64.
func setGuestCID(fd uintptr, cid uint64) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, ioctlVhostVsockSetGuestCID, uintptr(unsafe.Pointer(&cid))); errno != 0 {
		return errno
	}
	return nil
}

func randomBelow(n uint64) (uint64, error) {
	v, err := rand.Int(rand.Reader, new(big.Int).SetUint64(n))
	if err != nil {
		return 0, err
	}
	return v.Uint64(), nil
}
