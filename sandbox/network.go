package sandbox

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/network"
)

// nicID is the QEMU id of the NIC for the i-th interface of the pod's namespace.
func nicID(i int) string { return "nic" + strconv.Itoa(i) }

// setupNetwork wires the pod's network namespace to the VM about to boot
// (internetworking_model tcfilter): the taps and redirects are made and
// vmc gets a NIC per interface. A pod without a namespace path, or with
// internetworking_model = "none", gets no NIC.
func (s *Sandbox) setupNetwork(ctx context.Context, spec Spec, vmc *hypervisor.VMConfig) error {
	lg := log.G(ctx).WithField("sandbox", spec.ID)
	model := s.cfg.InterNetworking()
	switch {
	case spec.NetNSPath == "":
		lg.Info("network: the pod has no network namespace path: no NIC")
		return nil
	case model == network.ModelNone:
		lg.Info("network: internetworking_model = none: no NIC")
		return nil
	case model != network.ModelTCFilter:
		return fmt.Errorf("sandbox %s: runtime.internetworking_model = %q: not supported by kata-fsx (use %q or %q)", spec.ID, model, network.ModelTCFilter, network.ModelNone)
	}
	n, err := network.Setup(spec.NetNSPath, network.Options{Queues: int(vmc.VCPUs), DisableVhostNet: s.cfg.QEMU().DisableVhostNet})
	if err != nil {
		return fmt.Errorf("sandbox %s: network: %w", spec.ID, err)
	}
	s.net = n
	lg.Infof("network: %d interface(s) of %s through tcfilter; %s", len(n.Interfaces), n.NetNSPath, n.VhostReason)
	for i, ifc := range n.Interfaces {
		vmc.NICs = append(vmc.NICs, &hypervisor.NIC{ID: nicID(i), MAC: ifc.HardwareAddr, TapFiles: ifc.Files, VhostFiles: ifc.VhostFiles})
	}
	return nil
}

// configureGuestNetwork tells the agent the pod's interfaces, routes and
// neighbours, in Kata's order (UpdateInterface each, UpdateRoutes,
// AddARPNeighbors), before the sandbox is created.
func (s *Sandbox) configureGuestNetwork(ctx context.Context) error {
	if s.net == nil {
		return nil
	}
	paths := s.vm.Plan().PCIPaths
	for i, ifc := range s.net.Interfaces {
		path, ok := paths[nicID(i)]
		if !ok {
			return fmt.Errorf("interface %s: NIC %s has no PCI path", ifc.Name, nicID(i))
		}
		req := &pb.Interface{
			Device: ifc.Name, Name: ifc.Name, Mtu: uint64(ifc.MTU), HwAddr: ifc.HardwareAddr.String(),
			DevicePath: string(path), Type: ifc.Type,
		}
		for _, a := range ifc.Addrs {
			req.IPAddresses = append(req.IPAddresses, ipAddress(a.IP, a.Mask))
		}
		if _, err := s.agent.UpdateInterface(ctx, req); err != nil {
			return s.Explain(err)
		}
	}
	var routes []*pb.Route
	for _, r := range s.net.Routes {
		pr := &pb.Route{Device: r.Device, Scope: uint32(r.Scope), Family: family(r.Family), Flags: uint32(r.Flags), Mtu: uint32(r.MTU)}
		if r.Dst != nil {
			pr.Dest = r.Dst.String()
		}
		if r.Gw != nil {
			pr.Gateway = r.Gw.String()
		}
		if r.Src != nil {
			pr.Source = r.Src.String()
		}
		routes = append(routes, pr)
	}
	if len(routes) > 0 {
		if _, err := s.agent.UpdateRoutes(ctx, routes); err != nil {
			return s.Explain(err)
		}
	}
	var neighs []*pb.ARPNeighbor
	for _, nb := range s.net.Neighbors {
		neighs = append(neighs, &pb.ARPNeighbor{
			ToIPAddress: ipAddress(nb.IP, nil), Device: nb.Device, Lladdr: nb.HardwareAddr.String(),
			State: int32(nb.State), Flags: int32(nb.Flags),
		})
	}
	if len(neighs) > 0 {
		if err := s.agent.AddARPNeighbors(ctx, neighs); err != nil {
			return s.Explain(err)
		}
	}
	return nil
}

// ipAddress is ip in Kata's IPAddress: the mask as a prefix length.
func ipAddress(ip net.IP, mask net.IPMask) *pb.IPAddress {
	a := &pb.IPAddress{Family: pb.IPFamily_v4, Address: ip.String()}
	if ip.To4() == nil {
		a.Family = pb.IPFamily_v6
	}
	if mask != nil {
		ones, _ := mask.Size()
		a.Mask = strconv.Itoa(ones)
	}
	return a
}

func family(f int) pb.IPFamily {
	if f == unix.AF_INET6 {
		return pb.IPFamily_v6
	}
	return pb.IPFamily_v4
}

// teardownNetwork removes the taps and redirects; QEMU is gone.
func (s *Sandbox) teardownNetwork() error {
	if s.net == nil {
		return nil
	}
	if err := s.net.Teardown(); err != nil {
		return fmt.Errorf("remove the pod's network wiring: %w", err)
	}
	return nil
}

// closeNetworkFiles drops the shim's copies of the tap fds once QEMU holds its own.
func (s *Sandbox) closeNetworkFiles() error {
	if s.net == nil {
		return nil
	}
	return s.net.CloseFiles()
}
