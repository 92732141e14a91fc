// Command agent is kata-fsx's *test* guest agent: a small /init for the test
// guest kit that serves the Kata agent protocol (grpc.AgentService and
// grpc.Health over ttrpc) so the shim can be exercised against a real VM.
//
// It is a test fixture only. Production sandboxes run Kata's guest image
// with the real kata-agent, and kata-fsx must stay protocol-compatible with
// it; nothing here defines protocol behaviour the real agent lacks.
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

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == containerInitArg {
		containerInit()
		return
	}
	if len(os.Args) > 1 && os.Args[1] == execInitArg {
		execInit()
		return
	}
	if err := agentMain(); err != nil {
		fmt.Fprintf(os.Stderr, "kata-fsx test agent: %v\n", err)
		powerOff()
		os.Exit(1)
	}
}
