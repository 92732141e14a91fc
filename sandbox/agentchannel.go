package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/log"

	"github.com/kata-fsx/kata-fsx/agent"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/vsock"
)

// vsockDir is the sandbox subdirectory (0700) of the agent channel's
// vsock files: the hybrid vsock's two sockets, or the vhost-vsock CID.
const vsockDir = "vsock"

// hybridGuestCID is the guest's CID behind a hybrid vsock. Each VM has
// its own in-process device, so the CID need not be unique on the host;
// Kata uses 3 for its hybrid vsocks too (defaultGuestVSockCID, Firecracker
// and Cloud Hypervisor).
const hybridGuestCID = 3

// maxSocketPath is sun_path's 108 bytes less the NUL.
const maxSocketPath = 107

// startAgentChannel acquires what the agent channel plan chose needs
// before QEMU starts, completes vmc.Agent and returns the transport the
// agent is dialled over. What it acquires is Stop's to release.
func (s *Sandbox) startAgentChannel(ctx context.Context, vmc *hypervisor.VMConfig) (agent.Transport, error) {
	lg := log.G(ctx).WithField("sandbox", s.ID)
	switch vmc.Agent.Transport {
	case hypervisor.AgentVsock:
		f, cid, err := hypervisor.FindContextID()
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: agent over vhost-vsock: %w", s.ID, err)
		}
		s.vhostVsock = f
		vmc.Agent.GuestCID, vmc.Agent.VhostFD = cid, f
		// kata-fsx exec, another process, dials the guest by this CID.
		if err := s.writeGuestCID(cid); err != nil {
			return nil, err
		}
		lg.Infof("agent over vhost-vsock: guest CID %d", cid)
		return agent.VsockTransport{CID: cid}, nil
	case hypervisor.AgentHybridVsock:
		if err := s.makeVsockDir(); err != nil {
			return nil, err
		}
		hybrid := filepath.Join(s.Dir, vsockDir, "hybrid.sock")
		if len(hybrid) > maxSocketPath {
			return nil, fmt.Errorf("sandbox %s: hybrid vsock socket %s is longer than %d bytes: use a shorter kata_fsx.state_dir", s.ID, hybrid, maxSocketPath)
		}
		logf := func(format string, args ...any) { lg.Debugf("hybrid vsock: "+format, args...) }
		// s.life, not ctx: the device serves the guest for the sandbox's
		// whole life, not for the request that boots it.
		dev, err := startHybridVsock(s.life, vmc.Agent.SocketPath, hybrid, logf)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: agent over hybrid vsock: %w", s.ID, err)
		}
		s.hybridVsock = dev
		lg.Infof("agent over hybrid vsock: %s (device on %s, guest CID %d)", hybrid, vmc.Agent.SocketPath, hybridGuestCID)
		return agent.HybridVsockTransport{Path: hybrid}, nil
	case hypervisor.AgentSerial:
		return agent.SerialTransport{Path: vmc.Agent.SocketPath}, nil
	}
	return nil, fmt.Errorf("sandbox %s: agent transport %q is not wired", s.ID, vmc.Agent.Transport)
}

// startHybridVsock serves the guest's vsock device on vhostSocket (QEMU's
// vhost-user-vsock-pci connects there) and its hybrid vsock on
// hybridSocket (the shim connects there with CONNECT <port>); the device
// must listen before QEMU starts. The result is closed by Stop once QEMU
// has exited.
func startHybridVsock(ctx context.Context, vhostSocket, hybridSocket string, logf func(format string, args ...any)) (io.Closer, error) {
	return vsock.Serve(ctx, vhostSocket, hybridSocket, vsock.Options{GuestCID: hybridGuestCID, Logf: logf})
}

// makeVsockDir creates the sandbox's vsock directory, private: its
// sockets lead into the guest.
func (s *Sandbox) makeVsockDir() error {
	dir := filepath.Join(s.Dir, vsockDir)
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("sandbox %s: vsock directory: %w", s.ID, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("sandbox %s: vsock directory: %w", s.ID, err)
	}
	return nil
}

func (s *Sandbox) writeGuestCID(cid uint32) error {
	if err := s.makeVsockDir(); err != nil {
		return err
	}
	p := filepath.Join(s.Dir, vsockDir, "guest-cid")
	if err := os.WriteFile(p, []byte(strconv.FormatUint(uint64(cid), 10)+"\n"), 0o600); err != nil {
		return fmt.Errorf("sandbox %s: record the guest CID: %w", s.ID, err)
	}
	return nil
}

// HybridVsockSocket is the unix socket through which the agent of
// sandbox id under configuration c is reached over hybrid vsock.
func HybridVsockSocket(c *config.Config, id string) string {
	return filepath.Join(DirOf(c, id), vsockDir, "hybrid.sock")
}

// DialTransport is how another process (kata-fsx exec) reaches the agent
// of the running sandbox id: the hybrid vsock or the vhost-vsock CID the
// sandbox recorded, else its virtio-serial socket.
func DialTransport(c *config.Config, id string) (agent.Transport, error) {
	if _, err := os.Stat(HybridVsockSocket(c, id)); err == nil {
		return agent.HybridVsockTransport{Path: HybridVsockSocket(c, id)}, nil
	}
	cidFile := filepath.Join(DirOf(c, id), vsockDir, "guest-cid")
	if b, err := os.ReadFile(cidFile); err == nil {
		cid, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: %s: %w", id, cidFile, err)
		}
		return agent.VsockTransport{CID: uint32(cid)}, nil
	}
	sock := AgentSocket(c, id)
	if _, err := os.Stat(sock); err != nil {
		return nil, fmt.Errorf("no running pod %s: %w", id, err)
	}
	return agent.SerialTransport{Path: sock}, nil
}
