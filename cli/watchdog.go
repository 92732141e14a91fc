package cli

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/kata-fsx/kata-fsx/sandbox"
)

// watchdogCommand is the hidden command `kata-fsx run` starts beside
// itself: `kata-fsx __run-watchdog DIR`.
const watchdogCommand = "__run-watchdog"

// watchdog is the process that cleans up after a `kata-fsx run` that dies
// without tearing its pod down (SIGKILL, the OOM killer, a crash). QEMU
// and virtiofsd die with run by their parent-death signal (childproc),
// but the sandbox directory and its mounts (the rootfs bind under
// shared/) belong to no process: a dead run cannot remove them, so a
// process that outlives it has to.
//
// The watchdog's stdin is a pipe whose write end only run holds and
// never writes to: the kernel closes it when run dies, however it dies,
// and the watchdog's read then ends. A run that ends normally has torn
// its pod down and dismisses the watchdog first (SIGKILL), so the
// watchdog acts only on run's death.
type watchdog struct {
	cmd *exec.Cmd
	// pipe is the write end; kept open (and referenced, so no finalizer
	// closes it) for as long as run lives.
	pipe *os.File
}

// startWatchdog starts the watchdog of the sandbox directory dir. It runs
// the same binary through /proc/self/exe, which still works when the
// binary was replaced on disk since run started.
func startWatchdog(dir string, stderr io.Writer) (*watchdog, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("watchdog pipe: %w", err)
	}
	defer r.Close()
	cmd := exec.Command("/proc/self/exe", watchdogCommand, dir)
	cmd.Args[0] = "kata-fsx"
	cmd.Stdin, cmd.Stderr = r, stderr
	// Its own process group: the terminal's ^C and a kill of run's group
	// are for run, which tears its pod down itself.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, fmt.Errorf("start the watchdog: %w", err)
	}
	return &watchdog{cmd: cmd, pipe: w}, nil
}

// dismiss ends the watchdog once run's own teardown is over: killed
// before the pipe closes, it never sees the EOF that means run died.
func (w *watchdog) dismiss() {
	// The errors only say the watchdog is already gone.
	_ = w.cmd.Process.Kill()
	_ = w.cmd.Wait()
	w.pipe.Close()
}

// runWatchdog is the watchdog itself: it waits for its stdin to end and
// then, if the sandbox directory is still there, kills what still runs
// off it, unmounts what is mounted below it and removes it.
func runWatchdog(args []string, stderr io.Writer) int {
	// Signals are run's to act on; run dismisses the watchdog with SIGKILL.
	// SIGPIPE too: run's stderr may be a pipe whose reader died with run,
	// and a write to it must fail, not end the watchdog before it cleaned.
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGPIPE, syscall.SIGTTOU)
	if len(args) != 1 {
		fmt.Fprintf(stderr, "usage: kata-fsx %s DIR (started by kata-fsx run)\n", watchdogCommand)
		return 2
	}
	dir := args[0]
	// run never writes: the read ends only when run has died.
	_, _ = io.Copy(io.Discard, os.Stdin)
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return 0
	}
	if err := sandbox.CleanupDir(dir); err != nil {
		fmt.Fprintf(stderr, "kata-fsx run: watchdog: the run process died; cleaning up its sandbox %s: %v\n", dir, err)
		return 1
	}
	fmt.Fprintf(stderr, "kata-fsx run: watchdog: the run process died; removed its sandbox %s\n", dir)
	return 0
}
