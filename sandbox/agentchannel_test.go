package sandbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/agent"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// fakeDevice stands in for the in-process vsock device Stop must close.
type fakeDevice struct {
	closed int
	err    error
}

func (d *fakeDevice) Close() error { d.closed++; return d.err }

// TestStopReleasesAgentChannel: Stop closes the hybrid vsock device and
// the vhost-vsock fd, and returns their errors with the rest.
func TestStopReleasesAgentChannel(t *testing.T) {
	s := bareSandbox(t)
	dev := &fakeDevice{err: errors.New("device stuck")}
	s.hybridVsock = dev
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	f.Close() // a second close fails: Stop must report it
	s.vhostVsock = f
	err = s.Stop(context.Background())
	if dev.closed != 1 {
		t.Errorf("device closed %d times", dev.closed)
	}
	for _, want := range []string{"stop the hybrid vsock device: device stuck", "release the vhost-vsock guest CID"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Stop error %v lacks %q", err, want)
		}
	}
	if _, err := os.Stat(s.Dir); !os.IsNotExist(err) {
		t.Errorf("sandbox directory left: %v", err)
	}
}

// TestStartAgentChannelHybrid: the in-process device listens on both
// sockets in the sandbox's private vsock directory before QEMU starts, and
// Stop closes it.
func TestStartAgentChannelHybrid(t *testing.T) {
	s := bareSandbox(t)
	vhost := filepath.Join(s.Dir, vsockDir, "vhost.sock")
	vmc := &hypervisor.VMConfig{Agent: hypervisor.AgentChannel{Transport: hypervisor.AgentHybridVsock, SocketPath: vhost}}
	tr, err := s.startAgentChannel(context.Background(), vmc)
	if err != nil {
		t.Fatal(err)
	}
	if tr != (agent.HybridVsockTransport{Path: HybridVsockSocket(s.cfg, s.ID)}) || s.hybridVsock == nil {
		t.Fatalf("transport %v, device %v", tr, s.hybridVsock)
	}
	fi, err := os.Stat(filepath.Join(s.Dir, vsockDir))
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("vsock directory: %v, %v", fi, err)
	}
	for _, p := range []string{vhost, HybridVsockSocket(s.cfg, s.ID)} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Type() != os.ModeSocket {
			t.Errorf("%s: %v, %v", p, fi, err)
		}
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.Dir); !os.IsNotExist(err) {
		t.Errorf("sandbox directory left: %v", err)
	}
}

func TestStartAgentChannelSerial(t *testing.T) {
	s := bareSandbox(t)
	sock := AgentSocket(s.cfg, s.ID)
	vmc := &hypervisor.VMConfig{Agent: hypervisor.AgentChannel{Transport: hypervisor.AgentSerial, SocketPath: sock}}
	tr, err := s.startAgentChannel(context.Background(), vmc)
	if err != nil || tr != (agent.SerialTransport{Path: sock}) {
		t.Fatalf("transport %v, %v", tr, err)
	}
}

// TestStartAgentChannelVhostVsockWithoutDevice: on this host (no
// /dev/vhost-vsock) the CID cannot be claimed, and the error says so.
func TestStartAgentChannelVhostVsockWithoutDevice(t *testing.T) {
	if _, err := os.Stat("/dev/vhost-vsock"); err == nil {
		t.Skip("this host has /dev/vhost-vsock")
	}
	s := bareSandbox(t)
	vmc := &hypervisor.VMConfig{Agent: hypervisor.AgentChannel{Transport: hypervisor.AgentVsock}}
	_, err := s.startAgentChannel(context.Background(), vmc)
	if err == nil || !strings.Contains(err.Error(), "/dev/vhost-vsock") || s.vhostVsock != nil {
		t.Fatalf("error %v, vhost fd %v", err, s.vhostVsock)
	}
}

func TestDialTransport(t *testing.T) {
	cfg := config.Default()
	cfg.KataFSX.StateDir = t.TempDir()
	dir := filepath.Join(cfg.KataFSX.StateDir, "p")
	if _, err := DialTransport(cfg, "p"); err == nil || !strings.Contains(err.Error(), "no running pod p") {
		t.Fatalf("no pod: %v", err)
	}
	os.MkdirAll(filepath.Join(dir, vsockDir), 0o700)
	os.WriteFile(filepath.Join(dir, "agent.sock"), nil, 0o600)
	if tr, err := DialTransport(cfg, "p"); err != nil || tr != (agent.SerialTransport{Path: AgentSocket(cfg, "p")}) {
		t.Errorf("serial pod: %v, %v", tr, err)
	}
	os.WriteFile(filepath.Join(dir, vsockDir, "guest-cid"), []byte("123456\n"), 0o600)
	if tr, err := DialTransport(cfg, "p"); err != nil || tr != (agent.VsockTransport{CID: 123456}) {
		t.Errorf("vhost-vsock pod: %v, %v", tr, err)
	}
	os.WriteFile(HybridVsockSocket(cfg, "p"), nil, 0o600)
	if tr, err := DialTransport(cfg, "p"); err != nil || tr != (agent.HybridVsockTransport{Path: HybridVsockSocket(cfg, "p")}) {
		t.Errorf("hybrid vsock pod: %v, %v", tr, err)
	}
}
