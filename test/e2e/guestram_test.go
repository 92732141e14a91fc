package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// fillShmScript runs the command it is given in a private mount namespace
// whose /dev/shm is a fresh tmpfs of $SHM_SIZE, mode 1777 as the host's;
// with FILL_BEFORE=1 the unprivileged user nobody fills it first.
const fillShmScript = `set -e
mount -t tmpfs -o size="$SHM_SIZE",mode=1777 tmpfs /dev/shm
if [ "$FILL_BEFORE" = 1 ]; then
	msg=$(setpriv --reuid=65534 --regid=65534 --clear-groups -- dd if=/dev/zero of=/dev/shm/nobody-fill bs=1M 2>&1) || true
	case "$msg" in
	*"No space left"*) echo "nobody filled /dev/shm: $(df -k /dev/shm | tail -1)" >&2 ;;
	*) echo "nobody did not fill /dev/shm: $msg" >&2; exit 99 ;;
	esac
fi
exec "$@"
`

// guestTouchScript waits for the host's go (a file in the shared rootfs),
// then has dd allocate and write a buffer of 90% of the guest's available
// memory: pages the guest never touched before, each of which QEMU must
// back when it is first written.
const guestTouchScript = `echo up
while [ ! -e /go ]; do sleep 0.2; done
set -- $(grep MemAvailable /proc/meminfo)
mb=$(( $2 / 1024 * 9 / 10 ))
dd if=/dev/zero of=/dev/null bs=${mb}M count=1 2>/dev/null && echo "touched ${mb} MiB"`

// TestRunGuestRAMWithFullDevShm: an unprivileged local user who fills
// /dev/shm (mode 1777, on every host) cannot hurt a pod with the default
// configuration: the guest boots, and touches nearly all its RAM without
// QEMU dying. Guest RAM as a share=on file in /dev/shm, Kata's default,
// fails both ways: the boot is refused when /dev/shm is full, and a guest
// that booted takes SIGBUS, and QEMU dies, when it is filled later. Each
// run gets a /dev/shm of its own in a private mount namespace.
func TestRunGuestRAMWithFullDevShm(t *testing.T) {
	unshare := testenv.Tool(t, "unshare", "util-linux")
	nsenter := testenv.Tool(t, "nsenter", "util-linux")
	testenv.Tool(t, "setpriv", "util-linux")
	for _, tc := range []struct {
		name       string
		fillBefore bool
		shmMiB     int
	}{
		// Too small for a 512 MiB guest anyway, and full before the boot.
		{"filled before boot", true, 16},
		// Room for all of the guest's RAM at boot; filled once it runs.
		{"filled after boot", false, 512 + 128},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, "")
			rootfs := busyboxRootfs(t)
			cmd := exec.Command(unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", fillShmScript, "fill-shm",
				kataFSX(t), "run", "--config", e.config, "--backend", "virtio-fs", "--rootfs", rootfs, "--", "/bin/sh", "-c", guestTouchScript)
			fill := "0"
			if tc.fillBefore {
				fill = "1"
			}
			cmd.Env = append(os.Environ(), "SHM_SIZE="+strconv.Itoa(tc.shmMiB)+"m", "FILL_BEFORE="+fill)
			var out, errb syncBuffer
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			t.Cleanup(func() {
				if cmd.ProcessState == nil {
					cmd.Process.Kill()
					<-exited
				}
			})
			deadline := time.After(3 * time.Minute)
			for !strings.Contains(out.String(), "up\n") {
				select {
				case err := <-exited:
					t.Fatalf("run ended (%v) before its command started:\n%s", err, errb.String())
				case <-deadline:
					t.Fatalf("the command never started in the guest:\n%s", errb.String())
				case <-time.After(100 * time.Millisecond):
				}
			}
			if !tc.fillBefore {
				// run is the unshare'd process itself (unshare and sh exec
				// it): its mount namespace has the private /dev/shm.
				fillCmd := exec.Command(nsenter, "--target", strconv.Itoa(cmd.Process.Pid), "--mount", "--",
					"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
					"dd", "if=/dev/zero", "of=/dev/shm/nobody-fill", "bs=1M")
				b, err := fillCmd.CombinedOutput()
				if err == nil || !strings.Contains(string(b), "No space left") {
					t.Fatalf("nobody could not fill /dev/shm (%v): %s", err, b)
				}
				df, _ := exec.Command(nsenter, "--target", strconv.Itoa(cmd.Process.Pid), "--mount", "--", "df", "-k", "/dev/shm").CombinedOutput()
				t.Logf("nobody filled /dev/shm: %s", lastLine(string(df)))
			}
			if err := os.WriteFile(filepath.Join(rootfs, "go"), nil, 0o644); err != nil {
				t.Fatal(err)
			}
			var err error
			select {
			case err = <-exited:
			case <-time.After(5 * time.Minute):
				t.Fatalf("the guest's workload did not end within 5 minutes:\n%s", errb.String())
			}
			if err != nil || !strings.Contains(out.String(), "touched ") {
				t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errb.String())
			}
			for _, l := range strings.Split(errb.String(), "\n") {
				if strings.HasPrefix(l, "nobody filled") {
					t.Log(l)
				}
			}
			t.Logf("the guest %s", strings.TrimSpace(lastLine(out.String())))
		})
	}
}
