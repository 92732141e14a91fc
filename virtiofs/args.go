package virtiofs

import (
	"fmt"
)

// Options describe one virtiofsd instance.
type Options struct {
	Daemon    *Daemon
	SharedDir string
	// Cache is virtio_fs_cache in Kata's spelling; it is translated to the
	// daemon's own.
	Cache string
	// ExtraArgs is virtio_fs_extra_args in either dialect; see Flavour.ExtraArgs.
	ExtraArgs []string
	// Sandbox is the daemon's sandboxing mode: "namespace" (default) or "chroot".
	Sandbox string
}

// socketFD is the descriptor number the listening vhost-user socket has in
// the daemon: the first of exec.Cmd.ExtraFiles.
const socketFD = 3

// Args returns the daemon's command line (without the binary) in its
// flavour's dialect. The vhost-user socket is passed as an inherited,
// already listening descriptor (--fd) so there is no window in which QEMU
// could find no socket or the wrong one.
func Args(o Options) ([]string, error) {
	if o.Daemon == nil {
		return nil, fmt.Errorf("virtiofsd: no daemon detected")
	}
	if o.SharedDir == "" {
		return nil, fmt.Errorf("virtiofsd: no shared directory")
	}
	cache, err := o.Daemon.Flavour.CacheMode(o.Cache)
	if err != nil {
		return nil, err
	}
	extra, err := o.Daemon.Flavour.ExtraArgs(o.ExtraArgs)
	if err != nil {
		return nil, err
	}
	sandbox := o.Sandbox
	if sandbox == "" {
		sandbox = "namespace"
	}
	if sandbox != "namespace" && sandbox != "chroot" {
		return nil, fmt.Errorf("virtiofsd sandbox %q: use namespace or chroot", sandbox)
	}
	var args []string
	switch o.Daemon.Flavour {
	case FlavourC:
		// -f: the C daemon would otherwise daemonize and escape supervision.
		args = []string{fmt.Sprintf("--fd=%d", socketFD), "-f", "-o", "source=" + o.SharedDir, "-o", "cache=" + cache, "-o", "sandbox=" + sandbox}
	case FlavourRust:
		args = []string{fmt.Sprintf("--fd=%d", socketFD), "--shared-dir=" + o.SharedDir, "--cache=" + cache, "--sandbox=" + sandbox}
	default:
		return nil, fmt.Errorf("virtiofsd %s: unknown flavour %q", o.Daemon.Path, o.Daemon.Flavour)
	}
	return append(args, extra...), nil
}
