package vhostblk

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/vhostuser"
)

// qmpClient speaks just enough QMP for the smoke test.
type qmpClient struct {
	c  net.Conn
	rd *bufio.Reader
}

func dialQMP(t *testing.T, path string) *qmpClient {
	t.Helper()
	deadline := time.Now().Add(feWait)
	for {
		c, err := net.Dial("unix", path)
		if err == nil {
			q := &qmpClient{c: c, rd: bufio.NewReaderSize(c, 1<<20)}
			c.SetDeadline(time.Now().Add(feWait))
			if _, err := q.read(); err != nil { // greeting
				t.Fatalf("QMP greeting: %v", err)
			}
			return q
		}
		if time.Now().After(deadline) {
			t.Fatalf("QMP socket: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (q *qmpClient) read() (map[string]json.RawMessage, error) {
	for {
		line, err := q.rd.ReadBytes('\n')
		if err != nil {
			return nil, err
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(line, &m); err != nil {
			return nil, fmt.Errorf("QMP line %q: %w", line, err)
		}
		if _, ev := m["event"]; ev {
			continue
		}
		return m, nil
	}
}

func (q *qmpClient) run(cmd string, args any) (json.RawMessage, error) {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, _ := json.Marshal(req)
	if _, err := q.c.Write(append(b, '\n')); err != nil {
		return nil, err
	}
	m, err := q.read()
	if err != nil {
		return nil, err
	}
	if e, ok := m["error"]; ok {
		return nil, fmt.Errorf("QMP %s: %s", cmd, e)
	}
	return m["return"], nil
}

// TestQEMUSmoke starts a real QEMU (TCG, paused, no guest) with a
// vhost-user-blk-pci device on our socket: QEMU must connect, negotiate,
// read the config space at realize and come up; after QMP quit the server
// must see the disconnect and accept a new front-end.
func TestQEMUSmoke(t *testing.T) {
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	env := newEnv(t, 64<<20, false, Options{})
	qmpPath := filepath.Join(t.TempDir(), "qmp.sock")
	var stderr strings.Builder
	cmd := exec.Command(qemu,
		"-machine", "q35,accel=tcg", "-nodefaults", "-display", "none", "-S",
		"-m", "128M",
		"-object", "memory-backend-memfd,id=mem,size=128M,share=on", "-numa", "node,memdev=mem",
		"-chardev", "socket,id=c,path="+env.sock,
		"-device", "vhost-user-blk-pci,chardev=c,num-queues=1,id=vblk",
		"-qmp", "unix:"+qmpPath+",server=on,wait=off",
	)
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var waitErr error
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	defer func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
	}()

	q := dialQMP(t, qmpPath)
	if _, err := q.run("qmp_capabilities", nil); err != nil {
		t.Fatalf("%v; qemu stderr: %s", err, stderr.String())
	}
	ret, err := q.run("qom-list", map[string]any{"path": "/machine/peripheral"})
	if err != nil || !strings.Contains(string(ret), `"vblk"`) {
		t.Fatalf("device not realized: %s %v; qemu stderr: %s", ret, err, stderr.String())
	}
	for _, r := range []vhostuser.Request{vhostuser.ReqGetFeatures, vhostuser.ReqGetProtocolFeatures, vhostuser.ReqSetProtocolFeatures, vhostuser.ReqGetQueueNum, vhostuser.ReqGetConfig} {
		if env.srv.Requests(r) == 0 {
			t.Errorf("QEMU never sent %v", r)
		}
	}
	t.Logf("requests from QEMU: %s", env.srv.RequestSummary())
	if _, err := q.run("quit", nil); err != nil && !strings.Contains(err.Error(), "EOF") {
		t.Logf("quit: %v", err)
	}
	select {
	case <-exited:
		if waitErr != nil {
			t.Fatalf("qemu exited with %v; stderr: %s", waitErr, stderr.String())
		}
	case <-time.After(feWait):
		t.Fatal("qemu did not quit")
	}
	st, err := env.srv.WaitStats(ctxT(t), func(s Stats) bool { return s.Disconnects >= 1 })
	if err != nil {
		t.Fatalf("server did not see the disconnect: %v", err)
	}
	if st.LastError != nil {
		t.Errorf("QEMU's connection ended with %v", st.LastError)
	}
	if s := stderr.String(); strings.Contains(s, "vhost") {
		t.Errorf("qemu complained: %s", s)
	}
	// Ready for the next front-end.
	_, vq := env.connect(t, 0)
	if st, _, _ := vq.blkReq(blkTypeFlush, 0, nil, 0); st != blkStatusOK {
		t.Fatal("server unusable after QEMU left")
	}
}
