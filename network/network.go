// Package network connects a pod's network namespace to its VM the way
// Kata's default internetworking model, tcfilter, does: for every interface
// in the namespace a tap is created beside it, both get a tc ingress qdisc,
// and a u32 match-all filter on each redirects every frame to the other
// (mirred egress redirect). QEMU is given the tap's queue fds for a
// virtio-net device with the interface's MAC, so the guest owns the pod's
// address as the interface did. The interface's addresses, routes and
// static ARP neighbours are collected for the guest agent.
package network

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Kata's internetworking_model values kata-fsx knows.
const (
	// ModelTCFilter is Kata's default: a tap per interface with tc redirects both ways.
	ModelTCFilter = "tcfilter"
	// ModelNone gives the VM no network device.
	ModelNone = "none"
	// ModelMacvtap is Kata's macvtap model, which kata-fsx does not implement.
	ModelMacvtap = "macvtap"
)

// ingressParent is the handle of the ingress qdisc, ffff:.
var ingressParent = netlink.MakeHandle(0xffff, 0)

// Interface is one interface of the pod's network namespace as the guest
// gets it, with the tap that carries its traffic.
type Interface struct {
	// Name is the interface's name in the namespace ("eth0"); the guest's NIC gets it.
	Name string
	// Type is the netlink link type ("veth").
	Type string
	// HardwareAddr is the interface's MAC, which the guest's NIC takes over.
	HardwareAddr net.HardwareAddr
	MTU          int
	// Addrs are the interface's addresses, IPv6 link-local ones left out
	// (the guest makes its own).
	Addrs []*net.IPNet
	// Tap is the tap beside the interface ("tap0_kata").
	Tap string
	// Files are the tap's queue fds, one per queue, for QEMU.
	Files []*os.File
	// VhostFiles are open /dev/vhost-net fds, one per queue; empty when vhost-net is not used.
	VhostFiles []*os.File
}

// Route is a route of the namespace the guest gets, through one of the Interfaces.
type Route struct {
	// Dst is nil for a default route.
	Dst    *net.IPNet
	Gw     net.IP
	Src    net.IP
	Device string
	Scope  uint8
	// Family is unix.AF_INET or unix.AF_INET6.
	Family int
	Flags  int
	MTU    int
}

// Neighbor is an ARP or NDP entry the guest gets: a static one, or the
// default gateway's, as Kata passes them.
type Neighbor struct {
	IP           net.IP
	HardwareAddr net.HardwareAddr
	Device       string
	State        int
	Flags        int
}

// Options tunes Setup.
type Options struct {
	// Queues is the number of queues of each tap (and virtio-net device); 0 means 1.
	Queues int
	// DisableVhostNet keeps QEMU's virtio-net in userspace even where
	// /dev/vhost-net opens (Kata's disable_vhost_net).
	DisableVhostNet bool
}

// Network is a pod's network namespace wired to taps for its VM.
type Network struct {
	// NetNSPath is the namespace as the OCI spec named it.
	NetNSPath  string
	Interfaces []*Interface
	Routes     []Route
	Neighbors  []Neighbor
	// VhostNet says whether the taps are served by vhost-net, and
	// VhostReason why or why not.
	VhostNet    bool
	VhostReason string

	ns netns.NsHandle // held until Teardown, so the taps can be removed after CNI unmounts the namespace
}

// Setup creates a tap with tc redirects for every interface of the
// network namespace at nsPath except lo, and collects what the guest
// needs. On error everything it made is removed again.
func Setup(nsPath string, opts Options) (_ *Network, err error) {
	if opts.Queues <= 0 {
		opts.Queues = 1
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("network namespace %s: %w", nsPath, err)
	}
	n := &Network{NetNSPath: nsPath, ns: ns}
	defer func() {
		if err != nil {
			if terr := n.Teardown(); terr != nil {
				err = errors.Join(err, fmt.Errorf("undo the network setup: %w", terr))
			}
		}
	}()
	useVhost := false
	switch {
	case opts.DisableVhostNet:
		n.VhostReason = "disable_vhost_net = true: virtio-net in QEMU's userspace"
	default:
		if f, oerr := os.OpenFile("/dev/vhost-net", os.O_RDWR, 0); oerr != nil {
			n.VhostReason = fmt.Sprintf("/dev/vhost-net does not open (%v): virtio-net in QEMU's userspace", oerr)
		} else {
			f.Close()
			useVhost = true
			n.VhostReason = "/dev/vhost-net opens: vhost-net"
		}
	}
	n.VhostNet = useVhost
	err = inNetNS(ns, func() error { return n.setup(opts.Queues, useVhost) })
	if err != nil {
		return nil, fmt.Errorf("network namespace %s: %w", nsPath, err)
	}
	return n, nil
}

// setup runs in the pod's namespace.
func (n *Network) setup(queues int, vhost bool) error {
	h, err := netlink.NewHandle()
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	var routes []netlink.Route
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagLoopback != 0 {
			continue
		}
		switch l.Type() {
		case "veth", "macvlan", "ipvlan":
		default:
			return fmt.Errorf("interface %s: link type %q is not supported by internetworking_model = %q (veth, macvlan and ipvlan are)", a.Name, l.Type(), ModelTCFilter)
		}
		ifc := &Interface{Name: a.Name, Type: l.Type(), HardwareAddr: a.HardwareAddr, MTU: a.MTU, Tap: fmt.Sprintf("tap%d_kata", len(n.Interfaces))}
		// Appended first so Teardown removes what exists of it if the rest fails.
		n.Interfaces = append(n.Interfaces, ifc)
		if err := connect(h, l, ifc, queues); err != nil {
			return fmt.Errorf("interface %s: %w", a.Name, err)
		}
		if vhost {
			for range queues {
				f, err := os.OpenFile("/dev/vhost-net", os.O_RDWR, 0)
				if err != nil {
					return fmt.Errorf("interface %s: open /dev/vhost-net: %w", a.Name, err)
				}
				ifc.VhostFiles = append(ifc.VhostFiles, f)
			}
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("interface %s: list addresses: %w", a.Name, err)
		}
		for _, ad := range addrs {
			if ad.IP.To4() == nil && ad.IP.IsLinkLocalUnicast() {
				continue
			}
			ifc.Addrs = append(ifc.Addrs, ad.IPNet)
		}
		rs, err := h.RouteList(l, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("interface %s: list routes: %w", a.Name, err)
		}
		for _, r := range rs {
			// The kernel makes the guest's subnet routes itself when the
			// addresses are set, as Kata's validGuestRoute assumes.
			if r.Protocol == unix.RTPROT_KERNEL {
				continue
			}
			routes = append(routes, r)
			dst := r.Dst
			if dst != nil {
				if ones, _ := dst.Mask.Size(); ones == 0 {
					dst = nil
				}
			}
			n.Routes = append(n.Routes, Route{Dst: dst, Gw: r.Gw, Src: r.Src, Device: a.Name, Scope: uint8(r.Scope), Family: r.Family, Flags: r.Flags, MTU: r.MTU})
		}
		nbs, err := h.NeighList(a.Index, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("interface %s: list neighbours: %w", a.Name, err)
		}
		gws := gateways(routes)
		for _, nb := range nbs {
			if !guestNeighbor(nb, gws) {
				continue
			}
			n.Neighbors = append(n.Neighbors, Neighbor{IP: nb.IP, HardwareAddr: nb.HardwareAddr, Device: a.Name, State: nb.State, Flags: nb.Flags})
		}
	}
	return nil
}

// connect creates ifc's tap beside link and redirects each one's ingress
// to the other's egress, as Kata's setupTCFiltering.
func connect(h *netlink.Handle, link netlink.Link, ifc *Interface, queues int) error {
	flags := netlink.TUNTAP_VNET_HDR | netlink.TUNTAP_NO_PI | netlink.TUNTAP_MULTI_QUEUE_DEFAULTS
	tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: ifc.Tap}, Mode: netlink.TUNTAP_MODE_TAP, Queues: queues, Flags: flags}
	if err := h.LinkAdd(tap); err != nil {
		return fmt.Errorf("create tap %s: %w", ifc.Tap, err)
	}
	ifc.Files = tap.Fds
	tl, err := h.LinkByName(ifc.Tap)
	if err != nil {
		return fmt.Errorf("tap %s: %w", ifc.Tap, err)
	}
	if err := h.LinkSetMTU(tl, ifc.MTU); err != nil {
		return fmt.Errorf("tap %s: set MTU %d: %w", ifc.Tap, ifc.MTU, err)
	}
	if err := h.LinkSetUp(tl); err != nil {
		return fmt.Errorf("tap %s: set up: %w", ifc.Tap, err)
	}
	for _, l := range []netlink.Link{tl, link} {
		q := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_INGRESS}}
		if err := h.QdiscAdd(q); err != nil {
			return fmt.Errorf("add ingress qdisc to %s: %w", l.Attrs().Name, err)
		}
	}
	for _, p := range [][2]netlink.Link{{link, tl}, {tl, link}} {
		if err := redirect(h, p[0], p[1]); err != nil {
			return err
		}
	}
	return nil
}

// redirect adds `tc filter add dev SRC parent ffff: protocol all u32
// match u8 0 0 action mirred egress redirect dev DST`.
func redirect(h *netlink.Handle, src, dst netlink.Link) error {
	f := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: src.Attrs().Index, Parent: ingressParent, Protocol: unix.ETH_P_ALL},
		Actions: []netlink.Action{&netlink.MirredAction{
			ActionAttrs:  netlink.ActionAttrs{Action: netlink.TC_ACT_STOLEN},
			MirredAction: netlink.TCA_EGRESS_REDIR,
			Ifindex:      dst.Attrs().Index,
		}},
	}
	if err := h.FilterAdd(f); err != nil {
		return fmt.Errorf("redirect %s to %s: %w", src.Attrs().Name, dst.Attrs().Name, err)
	}
	return nil
}

// gateways are the gateways of the default routes.
func gateways(routes []netlink.Route) map[string]bool {
	gws := map[string]bool{}
	for _, r := range routes {
		if r.Gw == nil {
			continue
		}
		if r.Dst == nil {
			gws[r.Gw.String()] = true
		} else if ones, _ := r.Dst.Mask.Size(); ones == 0 {
			gws[r.Gw.String()] = true
		}
	}
	return gws
}

// guestNeighbor keeps static entries, and the default gateway's while it
// is reachable, as Kata's validGuestNeighbor: those spare the guest an ARP
// storm at pod start.
func guestNeighbor(nb netlink.Neigh, gws map[string]bool) bool {
	if nb.HardwareAddr == nil {
		return false
	}
	if nb.State == netlink.NUD_PERMANENT {
		return true
	}
	return gws[nb.IP.String()] && nb.State == netlink.NUD_REACHABLE
}

// CloseFiles closes the tap and vhost fds; QEMU holds its own copies once
// started. The taps persist until Teardown.
func (n *Network) CloseFiles() error {
	var errs []error
	for _, ifc := range n.Interfaces {
		for _, f := range append(ifc.Files, ifc.VhostFiles...) {
			if err := f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
				errs = append(errs, fmt.Errorf("close %s fd: %w", ifc.Tap, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Teardown removes the filters, the ingress qdiscs and the taps Setup made
// and closes the fds and the namespace. A namespace gone meanwhile took
// its taps with it. It returns every error met.
func (n *Network) Teardown() error {
	errs := []error{n.CloseFiles()}
	if n.ns.IsOpen() {
		errs = append(errs, inNetNS(n.ns, n.teardown))
		if err := n.ns.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close network namespace %s: %w", n.NetNSPath, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("network namespace %s: %w", n.NetNSPath, err)
	}
	return nil
}

// teardown runs in the pod's namespace.
func (n *Network) teardown() error {
	h, err := netlink.NewHandle()
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	var errs []error
	for _, ifc := range n.Interfaces {
		// The interface may be gone (CNI DEL ran first): its qdisc went with it.
		if l, err := h.LinkByName(ifc.Name); err == nil {
			if err := unredirect(h, l); err != nil {
				errs = append(errs, err)
			}
		}
		tl, err := h.LinkByName(ifc.Tap)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if !errors.As(err, &nf) {
				errs = append(errs, fmt.Errorf("tap %s: %w", ifc.Tap, err))
			}
			continue
		}
		if err := unredirect(h, tl); err != nil {
			errs = append(errs, err)
		}
		if err := h.LinkDel(tl); err != nil {
			errs = append(errs, fmt.Errorf("delete tap %s: %w", ifc.Tap, err))
		}
	}
	return errors.Join(errs...)
}

// unredirect removes the u32 filters and the ingress qdisc of l.
func unredirect(h *netlink.Handle, l netlink.Link) error {
	name := l.Attrs().Name
	fs, err := h.FilterList(l, ingressParent)
	if err != nil {
		return fmt.Errorf("%s: list filters: %w", name, err)
	}
	for _, f := range fs {
		if u, ok := f.(*netlink.U32); ok {
			if err := h.FilterDel(u); err != nil {
				return fmt.Errorf("%s: delete filter: %w", name, err)
			}
		}
	}
	qs, err := h.QdiscList(l)
	if err != nil {
		return fmt.Errorf("%s: list qdiscs: %w", name, err)
	}
	for _, q := range qs {
		if in, ok := q.(*netlink.Ingress); ok {
			if err := h.QdiscDel(in); err != nil {
				return fmt.Errorf("%s: delete ingress qdisc: %w", name, err)
			}
		}
	}
	return nil
}

// Listen opens a TCP listener on addr inside the pod's network namespace:
// the socket stays there, while the caller accepts from wherever it runs.
// It needs the namespace held, so it fails after Teardown.
func (n *Network) Listen(addr string) (net.Listener, error) {
	if !n.ns.IsOpen() {
		return nil, fmt.Errorf("listen on %s in %s: the namespace is released", addr, n.NetNSPath)
	}
	var l net.Listener
	err := inNetNS(n.ns, func() error {
		var err error
		l, err = net.Listen("tcp", addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen on %s in %s: %w", addr, n.NetNSPath, err)
	}
	return l, nil
}

// inNetNS runs fn on an OS thread that has entered ns, and brings the
// thread back to its namespace before giving it back to the Go scheduler.
// Only a thread that cannot return to its namespace is left locked, to
// die with the goroutine. Ending it is safe for the pod's QEMU and
// virtiofsd, which carry a parent-death signal the kernel sends when the
// thread that forked them exits, only because package childproc forks
// them from threads that never end this way.
func inNetNS(ns netns.NsHandle, fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("the thread's own network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("enter: %w", err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			done <- errors.Join(ferr, fmt.Errorf("return to the host's network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}
