package hypervisor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/helperproc"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// ownerEnv makes TestOwnerHelper start a VM named by its value and wait.
const ownerEnv = "KATA_FSX_HYPERVISOR_OWNER"

// init keeps the main goroutine on the main thread. Go never ends the
// main thread (a locked goroutine that exits there wedges it instead), so
// a test goroutine that ran on it could not show what ending its thread
// does to the children it forked.
func init() { runtime.LockOSThread() }

// TestOwnerHelper is the VM's owner that TestQEMUDiesWithItsOwner kills.
func TestOwnerHelper(t *testing.T) {
	name := os.Getenv(ownerEnv)
	if name == "" {
		return
	}
	cfg := testVM(t, "q35")
	cfg.Name = name
	if _, err := Start(context.Background(), cfg); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("started")
	select {}
}

// qemuNamed lists the QEMU processes whose argv has -name name.
func qemuNamed(name string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && bytes.Contains(b, []byte("\x00-name\x00"+name+"\x00")) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestQEMUDiesWithItsOwner: SIGKILL of the process that started a VM (a
// shim, `kata-fsx run`) ends the VM too, instead of leaving QEMU to pid 1.
func TestQEMUDiesWithItsOwner(t *testing.T) {
	qemuBinary(t)
	name := fmt.Sprintf("owner-%d-%d", os.Getpid(), time.Now().UnixNano())
	// The killed helper cleans nothing up: its temporary directories are
	// made in this test's.
	owner := helperproc.Start(t, "TestOwnerHelper", "started", ownerEnv+"="+name, "TMPDIR="+t.TempDir())
	pids := qemuNamed(name)
	if len(pids) != 1 {
		t.Fatalf("QEMU processes named %s: %v, want one", name, pids)
	}
	t.Cleanup(func() { syscall.Kill(pids[0], syscall.SIGKILL) })
	helperproc.Kill(t, owner)
	// The bound is the requirement's: nothing of the VM runs 5 s after its
	// owner's death.
	testenv.Eventually(t, 5*time.Second, func() (bool, error) {
		return len(qemuNamed(name)) == 0, fmt.Errorf("QEMU %d outlived its owner", pids[0])
	})
}

// TestQEMUOutlivesItsStarterThread: a VM started from a goroutine locked
// to a thread that Go then ends (the goroutine exits without unlocking)
// keeps running: the parent-death signal must follow the process, not the
// thread that happened to fork QEMU.
func TestQEMUOutlivesItsStarterThread(t *testing.T) {
	cfg := testVM(t, "q35")
	type started struct {
		vm  *VM
		err error
	}
	ch := make(chan started, 1)
	go func() {
		runtime.LockOSThread()
		vm, err := Start(context.Background(), cfg)
		ch <- started{vm, err}
	}()
	s := <-ch
	if s.err != nil {
		t.Fatal(s.err)
	}
	vm := s.vm
	t.Cleanup(func() { vm.Stop(context.Background()) })
	// The starter's thread is gone once its goroutine has ended; QEMU,
	// were it tied to that thread, would be SIGKILLed by then. A QMP round
	// trip after a second proves it still serves.
	select {
	case <-vm.Exited():
		t.Fatalf("QEMU died with the thread that started it: %v", vm.Wait())
	case <-time.After(time.Second):
	}
	if _, err := vm.QMP().QueryStatus(context.Background()); err != nil {
		t.Fatalf("QMP after the starter thread ended: %v", err)
	}
}
