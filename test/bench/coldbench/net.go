package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// link is the benchmark's own network: a namespace holding the registry,
// joined to the host by a veth pair whose host end counts every byte the
// registry sends and receives. Shaping is tbf on both ends' egress, so
// the data (registry to host) and the requests (host to registry) are
// bounded alike.
type link struct {
	NS       string // network namespace name
	HostDev  string // host end of the veth pair
	NSDev    string // namespace end
	HostAddr string // host end's IPv4 address
	NSAddr   string // the registry's IPv4 address
}

// newLink creates the namespace and the veth pair with a /30 of
// 10.213.0.0/16 chosen by tag (the caller's pid, so two runs on one
// machine do not collide). On error everything made so far is removed.
func newLink(ctx context.Context, tag int) (l *link, err error) {
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("ip (iproute2) is not installed: %w", err)
	}
	n := tag % 16000
	l = &link{
		NS:       fmt.Sprintf("coldbench-%d", tag),
		HostDev:  fmt.Sprintf("cb%dh", tag%1000000),
		NSDev:    fmt.Sprintf("cb%dn", tag%1000000),
		HostAddr: fmt.Sprintf("10.213.%d.%d", n/64, (n%64)*4+1),
		NSAddr:   fmt.Sprintf("10.213.%d.%d", n/64, (n%64)*4+2),
	}
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	for _, args := range [][]string{
		{"netns", "add", l.NS},
		{"link", "add", l.HostDev, "type", "veth", "peer", "name", l.NSDev, "netns", l.NS},
		{"addr", "add", l.HostAddr + "/30", "dev", l.HostDev},
		{"link", "set", l.HostDev, "up"},
		{"-n", l.NS, "addr", "add", l.NSAddr + "/30", "dev", l.NSDev},
		{"-n", l.NS, "link", "set", l.NSDev, "up"},
		{"-n", l.NS, "link", "set", "lo", "up"},
	} {
		if err := run(ctx, "ip", args...); err != nil {
			return l, err
		}
	}
	return l, nil
}

// Shape bounds both directions to bitsPerSec with tbf; 0 removes the
// shaping (the veth's full speed).
func (l *link) Shape(ctx context.Context, bitsPerSec uint64) error {
	for _, dev := range []struct{ ns, name string }{{"", l.HostDev}, {l.NS, l.NSDev}} {
		pre := []string{}
		if dev.ns != "" {
			pre = []string{"-n", dev.ns}
		}
		// Deleting a root qdisc that is the default fails; that is the
		// unshaped state wanted anyway.
		_ = run(ctx, "tc", append(pre, "qdisc", "del", "dev", dev.name, "root")...)
		if bitsPerSec == 0 {
			continue
		}
		// The bucket holds 4 ms of traffic but never less than 64 KiB, a
		// GSO segment: smaller, tbf splits or drops the large packets a
		// veth carries.
		burst := max(bitsPerSec/8/250, 64<<10)
		args := append(pre, "qdisc", "add", "dev", dev.name, "root", "tbf",
			"rate", strconv.FormatUint(bitsPerSec, 10)+"bit", "burst", strconv.FormatUint(burst, 10), "latency", "50ms")
		if err := run(ctx, "tc", args...); err != nil {
			return fmt.Errorf("shaping %s to %d bit/s: %w", dev.name, bitsPerSec, err)
		}
	}
	return nil
}

// Counters reads the host end's byte counters: rx is what the registry
// sent to the host, tx what the host sent to the registry.
func (l *link) Counters() (rx, tx uint64, err error) {
	read := func(name string) (uint64, error) {
		b, err := os.ReadFile(filepath.Join("/sys/class/net", l.HostDev, "statistics", name))
		if err != nil {
			return 0, err
		}
		return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	}
	if rx, err = read("rx_bytes"); err != nil {
		return 0, 0, err
	}
	tx, err = read("tx_bytes")
	return rx, tx, err
}

// Close removes the veth pair and the namespace, and waits until the
// kernel has let go of both (deleting a namespace frees its devices
// asynchronously). Safe to call twice.
func (l *link) Close() error {
	var errs []error
	if linkExists(l.HostDev) {
		// Deleting one end deletes the pair.
		if err := run(context.Background(), "ip", "link", "del", l.HostDev); err != nil {
			errs = append(errs, err)
		}
	}
	if nsExists(l.NS) {
		if err := run(context.Background(), "ip", "netns", "del", l.NS); err != nil {
			errs = append(errs, err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); linkExists(l.HostDev) && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	if linkExists(l.HostDev) {
		errs = append(errs, fmt.Errorf("veth %s still present 10 s after its deletion", l.HostDev))
	}
	return errors.Join(errs...)
}

func linkExists(dev string) bool {
	_, err := os.Stat(filepath.Join("/sys/class/net", dev))
	return err == nil
}

func nsExists(ns string) bool {
	_, err := os.Stat(filepath.Join("/run/netns", ns))
	return err == nil
}

// registry is Debian's docker-registry serving from a directory of the
// benchmark's own, inside the link's namespace.
type registry struct {
	Addr    string // NSAddr:5000, reached from the host over the veth
	dir     string
	cmd     *exec.Cmd
	out     limitedBuffer
	stopped chan struct{}
}

// startRegistry writes a config under dir and starts the registry in the
// namespace, returning once it accepts connections over the veth.
func startRegistry(ctx context.Context, l *link, dir string) (*registry, error) {
	if _, err := exec.LookPath("docker-registry"); err != nil {
		return nil, fmt.Errorf("docker-registry is not installed (apt-get install docker-registry): %w", err)
	}
	r := &registry{Addr: net.JoinHostPort(l.NSAddr, "5000"), dir: dir, stopped: make(chan struct{})}
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n",
		filepath.Join(dir, "data"), r.Addr)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	// ip netns exec execs the registry in place: the pid is the registry's.
	r.cmd = exec.Command("ip", "netns", "exec", l.NS, "docker-registry", "serve", cfgPath)
	r.cmd.Stdout, r.cmd.Stderr = &r.out, &r.out
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting docker-registry in %s: %w", l.NS, err)
	}
	go func() { _ = r.cmd.Wait(); close(r.stopped) }()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-r.stopped:
			return nil, fmt.Errorf("docker-registry in %s exited at start: %s", l.NS, r.out.String())
		case <-ctx.Done():
			r.Stop()
			return nil, ctx.Err()
		default:
		}
		if c, err := net.DialTimeout("tcp", r.Addr, time.Second); err == nil {
			c.Close()
			return r, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.Stop()
	return nil, fmt.Errorf("docker-registry on %s did not start within 20 s: %s", r.Addr, r.out.String())
}

// Stop kills the registry and waits for it.
func (r *registry) Stop() {
	if r == nil || r.cmd == nil || r.cmd.Process == nil {
		return
	}
	select {
	case <-r.stopped:
		return
	default:
	}
	_ = r.cmd.Process.Kill()
	<-r.stopped
}

// hostsDir writes a containerd certs.d directory saying the registry
// speaks plain HTTP.
func (r *registry) hostsDir(dir string) (string, error) {
	d := filepath.Join(dir, "certs.d")
	if err := os.MkdirAll(filepath.Join(d, r.Addr), 0o755); err != nil {
		return "", err
	}
	body := fmt.Sprintf("server = %q\n", "http://"+r.Addr)
	return d, os.WriteFile(filepath.Join(d, r.Addr, "hosts.toml"), []byte(body), 0o644)
}

// push copies the layout's image tag to the registry as repo:tag with
// skopeo (plain HTTP); the layers are gzip already and go as they are.
func (r *registry) push(ctx context.Context, layout, tag, repo string) error {
	return run(ctx, "skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false",
		"oci:"+layout+":"+tag, "docker://"+r.Addr+"/"+repo+":"+tag)
}

// run runs a tool and turns a failure into an error carrying its output.
func run(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}
