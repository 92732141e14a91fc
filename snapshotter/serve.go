package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"google.golang.org/grpc"
)

// Listen listens on the unix socket address for Serve. A socket left by a
// snapshotter that is gone is replaced; one that a live process serves is
// refused, so two snapshotters never share a root behind one address.
func Listen(address string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return nil, fmt.Errorf("snapshotter socket directory: %w", err)
	}
	if fi, err := os.Lstat(address); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("snapshotter socket %s: exists and is not a socket; remove it or set kata_fsx.snapshotter.address", address)
		}
		c, err := net.DialTimeout("unix", address, time.Second)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("snapshotter socket %s: another snapshotter serves it; stop it first (systemctl stop kata-fsx-snapshotter) or use another --address", address)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("snapshotter socket %s: %w", address, err)
		}
		if err := os.Remove(address); err != nil {
			return nil, fmt.Errorf("snapshotter socket %s (stale): %w", address, err)
		}
	}
	l, err := net.Listen("unix", address)
	if err != nil {
		return nil, fmt.Errorf("snapshotter socket: %w", err)
	}
	if err := os.Chmod(address, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("snapshotter socket: %w", err)
	}
	return l, nil
}

// Serve serves sn's snapshots API on l until ctx ends, then stops the
// server (letting calls in flight finish) and removes the socket.
func Serve(ctx context.Context, l net.Listener, sn *Snapshotter) error {
	srv := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(srv, snapshotservice.FromSnapshotter(sn))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	var err error
	select {
	case <-ctx.Done():
		srv.GracefulStop()
		<-errc
	case err = <-errc:
	}
	// The listener removes its socket on Close (Go's unix listeners
	// unlink what they bound); make sure of it for a failed Serve too.
	if ul, ok := l.(*net.UnixListener); ok {
		_ = os.Remove(ul.Addr().String())
	}
	if errors.Is(err, grpc.ErrServerStopped) {
		err = nil
	}
	return err
}
