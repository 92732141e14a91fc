//go:build !ppc64 && !ppc64le && !mips && !mipsle && !mips64 && !mips64le

package hypervisor

// ioctlVhostVsockSetGuestCID is VHOST_VSOCK_SET_GUEST_CID, _IOW(0xAF, 0x60,
// __u64) in the generic ioctl encoding (x86_64, arm64, riscv64, s390x).
const ioctlVhostVsockSetGuestCID = 0x4008AF60
