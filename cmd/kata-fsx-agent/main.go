// Command kata-fsx-agent is kata-fsx's guest agent: the /init of the
// initrd guest and the /sbin/init of the Kata-layout guest image, serving
// the subset of Kata's agent protocol kata-fsx uses (grpc.AgentService and
// grpc.Health over ttrpc) on a virtio-serial port or vsock. Kata's own
// kata-agent stays the compatibility target: same messages, same field
// numbers, same guest paths; nothing here defines protocol behaviour
// kata-agent lacks.
//
// The same binary has three roles, chosen by argv[1]:
//
//   - none: PID 1 of the guest (boot, then serve the agent API);
//   - "__container-init": the first process of a container, started in new
//     mount, PID and UTS namespaces; it builds the container's mounts,
//     enters the rootfs and execs the OCI process;
//   - "__exec-init": an exec'd process, forked by a locked OS thread of the
//     agent that joined the container's namespaces (see ExecProcess); it
//     applies the process's privileges and execs the command.
//
// Both helpers start in the container's cgroup (clone3 CLONE_INTO_CGROUP).
package main

import "github.com/kata-fsx/kata-fsx/guest/agent/boot"

func main() {
	boot.Main()
}
