// Package childproc starts the processes a pod cannot outlive its owner
// without (QEMU, virtiofsd): each gets PR_SET_PDEATHSIG = SIGKILL, so a
// shim or `kata-fsx run` that dies, even by SIGKILL, takes them with it.
//
// The kernel sends the parent-death signal when the thread that forked
// the child exits, not the process. A Go program's threads come and go:
// a goroutine that ends while locked to its thread (runtime.LockOSThread
// without Unlock, as namespace and working-directory tricks do) ends that
// thread too, and any goroutine may have run on it before. A child forked
// from such a thread would be killed while its owner lives on. Start
// therefore forks from a goroutine locked to its thread until the child
// has been reaped: that thread exits only with the process.
package childproc

import (
	"os/exec"
	"runtime"
	"syscall"
)

// Start starts cmd so that it is SIGKILLed when this process dies, and
// reaps it: the returned channel receives cmd.Wait's result once the
// child has exited (and its output copies, if any, have ended). The
// caller must not call cmd.Wait itself. Any cmd.SysProcAttr the caller
// set is kept, with Pdeathsig set to SIGKILL.
func Start(cmd *exec.Cmd) (<-chan error, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	started := make(chan error, 1)
	exited := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Unlocked only once the child is reaped: a thread given back to
		// the scheduler is never destroyed, so nothing can end it early.
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		exited <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return exited, nil
}
