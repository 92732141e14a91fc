// Package network configures the guest's side of pod networking from the
// host's requests: the NICs (found by PCI path or MAC), their addresses,
// routes and ARP neighbours, and the loopback.
package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/pci"
)

// The guest has one network namespace, the agent's, which every container
// of the pod shares (the agent never gives a container CLONE_NEWNET), as
// in Kata: the pod's interfaces configured here are the containers'.

// nicWaitTimeout bounds the wait for a NIC to appear: virtio_net may still
// be loading when the host's first UpdateInterface arrives.
const nicWaitTimeout = pci.HotplugTimeout

// UpdateInterface finds the NIC by its PCI path (or, without one, by its
// MAC), names it, sets its MTU and addresses and brings it up; the caller
// waits for virtio_net to be loaded first.
func UpdateInterface(ctx context.Context, r *pb.UpdateInterfaceRequest) (*pb.Interface, error) {
	ifc := r.GetInterface()
	if ifc == nil {
		return nil, status.Error(codes.InvalidArgument, "UpdateInterface: no interface")
	}
	link, err := findLink(ctx, ifc.GetDevicePath(), ifc.GetHwAddr())
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "UpdateInterface %s: %v", ifc.GetName(), err)
	}
	if err := configureLink(link, ifc); err != nil {
		return nil, status.Errorf(codes.Internal, "UpdateInterface %s: %v", ifc.GetName(), err)
	}
	link, err = netlink.LinkByIndex(link.Attrs().Index)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "UpdateInterface %s: %v", ifc.GetName(), err)
	}
	return interfaceOf(link)
}

// findLink waits for the NIC at a PCI path, or with a MAC.
func findLink(ctx context.Context, pciPath, mac string) (netlink.Link, error) {
	if pciPath == "" && mac == "" {
		return nil, errors.New("neither a PCI path nor a MAC to find the NIC by")
	}
	var slots []uint8
	if pciPath != "" {
		var err error
		if slots, err = pci.ParsePath(pciPath); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, nicWaitTimeout)
	defer cancel()
	var last error
	for {
		l, err := lookupLink(slots, mac)
		if err == nil {
			return l, nil
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the NIC: %w (last: %w)", ctx.Err(), last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func lookupLink(slots []uint8, mac string) (netlink.Link, error) {
	if slots != nil {
		dir, err := pci.DeviceDir("/sys/devices", slots)
		if err != nil {
			return nil, err
		}
		names, _ := filepath.Glob(filepath.Join(dir, "virtio*", "net", "*"))
		if len(names) == 0 {
			return nil, fmt.Errorf("no network device under %s", dir)
		}
		return netlink.LinkByName(filepath.Base(names[0]))
	}
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	for _, l := range links {
		if l.Attrs().HardwareAddr.String() == mac {
			return l, nil
		}
	}
	return nil, fmt.Errorf("no link with MAC %s", mac)
}

// configureLink gives link what ifc asks, Kata's agent's order: down,
// renamed, MTU, addresses replaced, up.
func configureLink(link netlink.Link, ifc *pb.Interface) error {
	if err := netlink.LinkSetDown(link); err != nil {
		return fmt.Errorf("set %s down: %w", link.Attrs().Name, err)
	}
	if n := ifc.GetName(); n != "" && n != link.Attrs().Name {
		if err := netlink.LinkSetName(link, n); err != nil {
			return fmt.Errorf("rename %s to %s: %w", link.Attrs().Name, n, err)
		}
	}
	if mtu := int(ifc.GetMtu()); mtu > 0 {
		if err := netlink.LinkSetMTU(link, mtu); err != nil {
			return fmt.Errorf("set MTU %d: %w", mtu, err)
		}
	}
	if hw := ifc.GetHwAddr(); hw != "" && hw != link.Attrs().HardwareAddr.String() {
		mac, err := net.ParseMAC(hw)
		if err != nil {
			return fmt.Errorf("MAC %q: %w", hw, err)
		}
		if err := netlink.LinkSetHardwareAddr(link, mac); err != nil {
			return fmt.Errorf("set MAC %s: %w", hw, err)
		}
	}
	old, err := netlink.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return fmt.Errorf("list addresses: %w", err)
	}
	for _, ad := range old {
		if err := netlink.AddrDel(link, &ad); err != nil {
			return fmt.Errorf("delete address %s: %w", ad.IPNet, err)
		}
	}
	for _, ip := range ifc.GetIPAddresses() {
		ipn, err := ipNet(ip)
		if err != nil {
			return err
		}
		ad := &netlink.Addr{IPNet: ipn}
		if ipn.IP.To4() == nil {
			// The host already did duplicate detection for this address.
			ad.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(link, ad); err != nil {
			return fmt.Errorf("add address %s: %w", ipn, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set up: %w", err)
	}
	return nil
}

// ipNet parses Kata's IPAddress: an address and a prefix length.
func ipNet(a *pb.IPAddress) (*net.IPNet, error) {
	ip := net.ParseIP(a.GetAddress())
	if ip == nil {
		return nil, fmt.Errorf("address %q: not an IP address", a.GetAddress())
	}
	bits := 128
	if ip4 := ip.To4(); ip4 != nil {
		ip, bits = ip4, 32
	}
	ones := bits
	if m := a.GetMask(); m != "" {
		n, err := strconv.Atoi(m)
		if err != nil || n < 0 || n > bits {
			return nil, fmt.Errorf("address %s: mask %q: want a prefix length 0..%d", a.GetAddress(), m, bits)
		}
		ones = n
	}
	return &net.IPNet{IP: ip, Mask: net.CIDRMask(ones, bits)}, nil
}

// UpdateRoutes replaces the routes of the main table on the interfaces it
// names with the ones given: device routes first, so the gateways they
// reach are routable when the gateway routes are added.
func UpdateRoutes(ctx context.Context, r *pb.UpdateRoutesRequest) (*pb.Routes, error) {
	want := r.GetRoutes().GetRoutes()
	devices := map[string]bool{}
	for _, rt := range want {
		devices[rt.GetDevice()] = true
	}
	for dev := range devices {
		link, err := netlink.LinkByName(dev)
		if err != nil {
			return nil, status.Errorf(codes.NotFound, "UpdateRoutes: device %q: %v", dev, err)
		}
		old, err := netlink.RouteList(link, netlink.FAMILY_ALL)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "UpdateRoutes: %v", err)
		}
		for _, rt := range old {
			// The kernel's own routes follow the addresses.
			if rt.Protocol == unix.RTPROT_KERNEL {
				continue
			}
			if err := netlink.RouteDel(&rt); err != nil {
				return nil, status.Errorf(codes.Internal, "UpdateRoutes: delete %v: %v", rt, err)
			}
		}
	}
	sorted := append([]*pb.Route(nil), want...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].GetGateway() == "" && sorted[j].GetGateway() != "" })
	for _, rt := range sorted {
		nr, err := toNetlinkRoute(rt)
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "UpdateRoutes: %v", err)
		}
		if err := netlink.RouteReplace(nr); err != nil {
			return nil, status.Errorf(codes.Internal, "UpdateRoutes: add route to %q via %q dev %s: %v", rt.GetDest(), rt.GetGateway(), rt.GetDevice(), err)
		}
	}
	return ListRoutes(ctx, nil)
}

func toNetlinkRoute(rt *pb.Route) (*netlink.Route, error) {
	link, err := netlink.LinkByName(rt.GetDevice())
	if err != nil {
		return nil, fmt.Errorf("route device %q: %w", rt.GetDevice(), err)
	}
	nr := &netlink.Route{LinkIndex: link.Attrs().Index, Scope: netlink.Scope(rt.GetScope()), Flags: int(rt.GetFlags()), MTU: int(rt.GetMtu())}
	nr.Family = unix.AF_INET
	if rt.GetFamily() == pb.IPFamily_v6 {
		nr.Family = unix.AF_INET6
	}
	switch d := rt.GetDest(); d {
	case "", "default":
	default:
		_, dst, err := net.ParseCIDR(d)
		if err != nil {
			return nil, fmt.Errorf("route destination %q: %w", d, err)
		}
		nr.Dst = dst
	}
	if g := rt.GetGateway(); g != "" {
		if nr.Gw = net.ParseIP(g); nr.Gw == nil {
			return nil, fmt.Errorf("route gateway %q: not an IP address", g)
		}
	}
	if s := rt.GetSource(); s != "" {
		if nr.Src = net.ParseIP(s); nr.Src == nil {
			return nil, fmt.Errorf("route source %q: not an IP address", s)
		}
	}
	return nr, nil
}

// AddARPNeighbors adds (or replaces) neighbour entries; an entry without
// a state is permanent.
func AddARPNeighbors(ctx context.Context, r *pb.AddARPNeighborsRequest) (*emptypb.Empty, error) {
	for _, n := range r.GetNeighbors().GetARPNeighbors() {
		link, err := netlink.LinkByName(n.GetDevice())
		if err != nil {
			return nil, status.Errorf(codes.NotFound, "AddARPNeighbors: device %q: %v", n.GetDevice(), err)
		}
		ip := net.ParseIP(n.GetToIPAddress().GetAddress())
		if ip == nil {
			return nil, status.Errorf(codes.InvalidArgument, "AddARPNeighbors: address %q: not an IP address", n.GetToIPAddress().GetAddress())
		}
		mac, err := net.ParseMAC(n.GetLladdr())
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "AddARPNeighbors: %s: lladdr %q: %v", ip, n.GetLladdr(), err)
		}
		state := int(n.GetState())
		if state == 0 {
			state = netlink.NUD_PERMANENT
		}
		fam := netlink.FAMILY_V4
		if ip.To4() == nil {
			fam = netlink.FAMILY_V6
		}
		nb := &netlink.Neigh{LinkIndex: link.Attrs().Index, Family: fam, IP: ip, HardwareAddr: mac, State: state, Flags: int(n.GetFlags())}
		if err := netlink.NeighSet(nb); err != nil {
			return nil, status.Errorf(codes.Internal, "AddARPNeighbors: %s lladdr %s dev %s: %v", ip, mac, n.GetDevice(), err)
		}
	}
	return &emptypb.Empty{}, nil
}

// ListInterfaces returns the guest's interfaces with their addresses.
func ListInterfaces(context.Context, *pb.ListInterfacesRequest) (*pb.Interfaces, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "ListInterfaces: %v", err)
	}
	out := &pb.Interfaces{}
	for _, l := range links {
		ifc, err := interfaceOf(l)
		if err != nil {
			return nil, err
		}
		out.Interfaces = append(out.Interfaces, ifc)
	}
	return out, nil
}

func interfaceOf(l netlink.Link) (*pb.Interface, error) {
	at := l.Attrs()
	ifc := &pb.Interface{Device: at.Name, Name: at.Name, Mtu: uint64(at.MTU), HwAddr: at.HardwareAddr.String(), Type: l.Type(), RawFlags: uint32(at.RawFlags)}
	addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "addresses of %s: %v", at.Name, err)
	}
	for _, ad := range addrs {
		ones, _ := ad.Mask.Size()
		fam := pb.IPFamily_v4
		if ad.IP.To4() == nil {
			fam = pb.IPFamily_v6
		}
		ifc.IPAddresses = append(ifc.IPAddresses, &pb.IPAddress{Family: fam, Address: ad.IP.String(), Mask: strconv.Itoa(ones)})
	}
	return ifc, nil
}

// ListRoutes returns the routes of the main table.
func ListRoutes(context.Context, *pb.ListRoutesRequest) (*pb.Routes, error) {
	rs, err := netlink.RouteList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "ListRoutes: %v", err)
	}
	out := &pb.Routes{}
	for _, r := range rs {
		pr := &pb.Route{Scope: uint32(r.Scope), Flags: uint32(r.Flags), Mtu: uint32(r.MTU)}
		if r.Family == unix.AF_INET6 {
			pr.Family = pb.IPFamily_v6
		}
		if r.Dst != nil {
			pr.Dest = r.Dst.String()
		}
		if r.Gw != nil {
			pr.Gateway = r.Gw.String()
		}
		if r.Src != nil {
			pr.Source = r.Src.String()
		}
		if l, err := netlink.LinkByIndex(r.LinkIndex); err == nil {
			pr.Device = l.Attrs().Name
		}
		out.Routes = append(out.Routes, pr)
	}
	return out, nil
}

// UpLoopback brings lo up, as Kata's agent does when it creates the
// sandbox: the pod's processes talk to themselves over 127.0.0.1.
func UpLoopback() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return status.Errorf(codes.Internal, "loopback: %v", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return status.Errorf(codes.Internal, "set lo up: %v", err)
	}
	return nil
}
