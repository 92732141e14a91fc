package e2e

import "syscall"

func syscallKill(pid int) { _ = syscall.Kill(pid, syscall.SIGKILL) }
