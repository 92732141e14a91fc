package sandbox

import (
	"context"
	"time"

	"github.com/containerd/log"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// autoPruneTimeout bounds the prune a disk build starts in the background.
const autoPruneTimeout = 5 * time.Minute

// diskBuilt does what the node caches need once a pod's disk d is built
// and served with serveCtx: it holds the layer blobs the disk reads from
// the blob cache in use until serveCtx ends (the disk is removed or the
// sandbox stops), so that no prune takes them from under a running pod,
// and it starts a prune (Spec.PruneCaches) of the node caches to their budgets in the
// background ([kata_fsx.cache] prune = "auto"), bounded and never failing
// the pod: its problems are logged. The channel closes when that prune
// is over (for tests; the sandbox does not wait for it).
func (s *Sandbox) diskBuilt(serveCtx context.Context, d *blk.Disk, opts blk.Options) <-chan struct{} {
	lg := log.G(s.life).WithField("sandbox", s.ID)
	if opts.Opener == nil && d.Image != nil {
		// A lazy image reads through its store, which marks its own layers.
		release, err := hostfs.HoldBlobs(opts.CacheDir, d.Image.Sources())
		if err != nil {
			lg.Warnf("node caches: disk %s: %v", d.Dir, err)
		}
		context.AfterFunc(serveCtx, release)
	}
	done := make(chan struct{})
	if s.pruneCaches == nil {
		close(done)
		return done
	}
	go func() {
		defer close(done)
		ctx, cancel := context.WithTimeout(s.life, autoPruneTimeout)
		defer cancel()
		ran, rs, err := s.pruneCaches(ctx, s.cfg, func(format string, args ...any) { lg.Debugf(format, args...) })
		if err != nil {
			lg.Warnf("node caches: prune: %v", err)
		}
		if !ran {
			return
		}
		for _, r := range rs {
			if len(r.Removed) > 0 || r.OverBudget() {
				logResult(lg, &r)
			}
		}
	}()
	return done
}

func logResult(lg *log.Entry, r *nodecache.Result) {
	if r.OverBudget() {
		lg.Warn("node caches: " + r.Summary())
		return
	}
	lg.Info("node caches: " + r.Summary())
}
