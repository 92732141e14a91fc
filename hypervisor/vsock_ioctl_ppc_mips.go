//go:build ppc64 || ppc64le || mips || mipsle || mips64 || mips64le

package hypervisor

// ioctlVhostVsockSetGuestCID is VHOST_VSOCK_SET_GUEST_CID, _IOW(0xAF, 0x60,
// __u64) in the encoding of powerpc and mips, whose write direction bit differs.
const ioctlVhostVsockSetGuestCID = 0x8008AF60
