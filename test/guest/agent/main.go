// Command agent is kata-fsx's *test* guest agent: a small /init for the test
// guest kit that serves the Kata agent protocol (grpc.AgentService and
// grpc.Health over ttrpc) so the shim can be exercised against a real VM.
//
// It is a test fixture only. Production sandboxes run Kata's guest image
// with the real kata-agent, and kata-fsx must stay protocol-compatible with
// it; nothing here defines protocol behaviour the real agent lacks.
//
// The same binary has two roles, chosen by argv[1]:
//
//   - none: PID 1 of the guest (boot, then serve the agent API);
//   - "__container-init": the first process of a container, started in new
//     mount, PID and UTS namespaces; it builds the container's mounts,
//     enters the rootfs and execs the OCI process.
//
// Exec'd processes need no helper: a locked OS thread of the agent joins the
// container's namespaces and forks them from there (see ExecProcess).
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
	if err := agentMain(); err != nil {
		fmt.Fprintf(os.Stderr, "kata-fsx test agent: %v\n", err)
		powerOff()
		os.Exit(1)
	}
}
