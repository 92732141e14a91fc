package vsock

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/ttrpc"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	vu "github.com/kata-fsx/kata-fsx/vhostuser"
)

// hybridTransport reaches the guest agent through the device's hybrid
// socket, doing Kata's handshake itself (test-local: the agent package's
// own hybrid transport is another change).
type hybridTransport struct {
	path string
	port uint32
}

func (h hybridTransport) String() string { return fmt.Sprintf("hybrid-vsock:%s:%d", h.path, h.port) }

func (h hybridTransport) DialContext(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", h.path)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", h.port); err != nil {
		c.Close()
		return nil, err
	}
	var line []byte
	var b [1]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			c.Close()
			return nil, fmt.Errorf("hybrid handshake: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
	}
	if !bytes.HasPrefix(line, []byte("OK ")) {
		c.Close()
		return nil, fmt.Errorf("hybrid handshake: %q", line)
	}
	c.SetDeadline(time.Time{})
	return c, nil
}

// guestKitDir is $KATA_FSX_GUEST_DIR or the repository's build/guest.
func guestKitDir(t *testing.T) string {
	kit := os.Getenv("KATA_FSX_GUEST_DIR")
	if kit == "" {
		kit = "../build/guest"
	}
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if _, err := os.Stat(filepath.Join(kit, f)); err != nil {
			testenv.Missing(t, "guest kit missing (run 'make guest' or set KATA_FSX_GUEST_DIR): %v", err)
		}
	}
	return kit
}

// busyboxRootfs makes <share>/<cid>/rootfs a busybox system.
func busyboxRootfs(t *testing.T, share, cid string) {
	bb := testenv.Tool(t, "busybox", "busybox-static")
	root := filepath.Join(share, cid, "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "cat", "head", "md5sum"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestQEMUGuestAgent boots the guest kit under QEMU (TCG) with this
// device as its only agent channel (vhost-user-vsock-pci, no
// virtio-serial port): the agent listens on vsock port 1024, the
// host reaches it through the hybrid socket, and 2 MiB go through a
// container's cat and back (WriteStdin/ReadStdout over ttrpc over vsock).
// A port nobody listens on closes the hybrid client (the guest's RST).
func TestQEMUGuestAgent(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest under TCG; skipped in -short mode")
	}
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	kit := guestKitDir(t)
	share := t.TempDir()
	busyboxRootfs(t, share, "c1")

	dir := t.TempDir()
	e := &testEnv{vhost: filepath.Join(dir, "vsock", "vhost.sock"), hybrid: filepath.Join(dir, "vsock", "hybrid.sock")}
	srv, err := Serve(context.Background(), e.vhost, e.hybrid, Options{GuestCID: 3, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	console := filepath.Join(dir, "console.log")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var qout bytes.Buffer
	cmd := exec.CommandContext(ctx, qemu,
		"-M", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", "512M",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-object", "memory-backend-memfd,id=mem,size=512M,share=on", "-numa", "node,memdev=mem",
		"-kernel", filepath.Join(kit, "vmlinux"), "-initrd", filepath.Join(kit, "initrd.img"),
		"-append", "console=ttyS0 panic=-1 tsc=reliable no_timer_check noreplace-smp cryptomgr.notests quiet loglevel=4 rdinit=/init",
		"-serial", "file:"+console,
		"-chardev", "socket,id=charvsock0,path="+e.vhost,
		"-device", "vhost-user-vsock-pci,id=vsock0,chardev=charvsock0",
		"-fsdev", "local,id=fs9p,path="+share+",security_model=none,multidevs=remap",
		"-device", "virtio-9p-pci,fsdev=fs9p,mount_tag=kataShared",
	)
	cmd.Stdout, cmd.Stderr = &qout, &qout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(console)
			t.Logf("qemu output:\n%s\nguest console:\n%s", qout.String(), b)
		}
	}()

	start := time.Now()
	c, err := agent.Dial(ctx, hybridTransport{path: e.hybrid, port: agent.DefaultVsockPort}, 3*time.Minute)
	if err != nil {
		t.Fatalf("dial the agent over hybrid vsock: %v", err)
	}
	defer c.Close()
	t.Logf("QEMU start to agent health check over hybrid vsock: %s", time.Since(start).Round(time.Millisecond))

	// A second connection at once, by hand: CONNECT 1024 / OK <port>.
	raw, err := net.Dial("unix", e.hybrid)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(raw, "CONNECT %d\n", agent.DefaultVsockPort)
	raw.SetReadDeadline(time.Now().Add(time.Minute))
	line, err := bufio.NewReader(raw).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "OK ") {
		t.Fatalf("hand-made handshake: %q %v", line, err)
	}
	if p, err := strconv.ParseUint(strings.TrimSpace(line[3:]), 10, 32); err != nil || p < firstHostPort {
		t.Errorf("OK line %q: host port below 2^30", line)
	}
	c2 := agent.NewClient(nil, ttrpc.NewClient(raw))
	if err := c2.Check(ctx); err != nil {
		t.Fatalf("health check on the hand-made connection: %v", err)
	}
	c2.Close()

	// Nothing listens on port 4000: the guest answers RST, the client is closed.
	closed, err := net.Dial("unix", e.hybrid)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(closed, "CONNECT 4000\n")
	closed.SetReadDeadline(time.Now().Add(time.Minute))
	if b, err := io.ReadAll(closed); err != nil || len(b) != 0 {
		t.Errorf("CONNECT to a port without listener: read %q, %v; want a plain close", b, err)
	}
	closed.Close()

	// 2 MiB through a container's cat: host to guest over WriteStdin,
	// guest to host over ReadStdout, concurrently.
	if err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{Hostname: "vsock", SandboxId: "sb-vsock",
		Storages: []*pb.Storage{{Driver: "9p", Source: "kataShared", Fstype: "9p", MountPoint: "/run/kata-containers/shared/containers/"}}}); err != nil {
		t.Fatal(err)
	}
	req := &pb.CreateContainerRequest{ContainerId: "c1", ExecId: "c1", OCI: &pb.Spec{
		Version: "1.0.2", Root: &pb.Root{Path: "/run/kata-containers/shared/containers/c1/rootfs"},
		Process: &pb.Process{Args: []string{"/bin/cat"}, Env: []string{"PATH=/bin"}, Cwd: "/", User: &pb.User{}},
	}}
	if err := c.CreateContainer(ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := c.StartContainer(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	payload := randomBytes(3, 2<<20)
	got := make(chan []byte, 1)
	go func() {
		b, err := io.ReadAll(c.StreamReader(ctx, "c1", "c1", false))
		if err != nil {
			t.Errorf("read stdout: %v", err)
		}
		got <- b
	}()
	t0 := time.Now()
	if n, err := c.WriteStdin(ctx, "c1", "c1", payload); err != nil || n != len(payload) {
		t.Fatalf("WriteStdin: %d, %v", n, err)
	}
	if err := c.CloseStdin(ctx, "c1", "c1"); err != nil {
		t.Fatal(err)
	}
	b := <-got
	if !bytes.Equal(b, payload) {
		t.Fatalf("cat returned %d bytes, want the %d sent", len(b), len(payload))
	}
	t.Logf("2 MiB each way through cat over hybrid vsock: %s", time.Since(t0).Round(time.Millisecond))
	if st, err := c.WaitProcess(ctx, "c1", "c1"); st != 0 || err != nil {
		t.Errorf("cat exit %d, %v", st, err)
	}
	if err := c.DestroySandbox(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("qemu: %v", err)
		}
		exited <- err
	case <-time.After(time.Minute):
		t.Error("VM still running a minute after DestroySandbox")
	}
	if s, err := srv.VhostServer().WaitStats(ctx, func(s vu.Stats) bool { return s.Disconnects >= 1 }); err != nil || s.LastError != nil {
		t.Errorf("vhost-user connection: %+v, %v", s, err)
	}
	t.Logf("requests from QEMU: %s", srv.VhostServer().RequestSummary())
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Error("test ran out of time")
	}
}
