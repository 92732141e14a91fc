// Package snapshotter is kata-fsx's containerd proxy snapshotter: containerd's
// overlayfs snapshotter whose layers pulled through CRI become remote.
// Given the labels CRI passes with each layer (the image reference, its
// manifest and layer digests), it finds the image's lazy-read indexes
// (content/lazyimage: an index artifact, else built by streaming) and
// commits the layer as an empty snapshot with a sidecar naming the image
// and layer (content/layerdir), then tells containerd the snapshot already
// exists so that it downloads nothing. The mounts of a snapshot over such
// layers have type layerdir.MountType, whose helper materializes them from
// the node's lazy store for consumers that need real directories; the
// kata-fsx shim on imagefs-blk reads them from the store directly. See
// docs/snapshotter.md.
package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	"github.com/containerd/continuity/fs"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/node"
)

// Labels the snapshotter reads and writes.
const (
	// LabelRef is the label of a Prepare naming the snapshot the
	// prepared layer will be committed as (its chain ID).
	LabelRef = "containerd.io/snapshot.ref"
	// LabelRemote marks a remote snapshot; its value is the layer's blob
	// digest.
	LabelRemote = "containerd.io/snapshot/kata-fsx.remote"
)

// metaLockWait bounds New's wait for the metadata database's lock, which
// a snapshotter that is stopping may still hold for a moment.
var metaLockWait = 10 * time.Second

// Options configure New.
type Options struct {
	// Root holds the snapshots and their metadata database.
	Root string
	// Config is the kata-fsx configuration: its [kata_fsx.registry] table
	// and imagefs-blk state_dir (the node store) for remote layers, and
	// [kata_fsx.snapshotter] remote.
	Config *config.Config
	// Logf receives one line per remote-layer decision; nil discards.
	Logf func(format string, args ...any)
}

// Snapshotter is containerd's overlayfs snapshotter with remote layers. It
// is safe for concurrent use.
type Snapshotter struct {
	inner snapshots.Snapshotter
	// ms is the metadata database, flocked by this process for its life
	// (New). Each call opens and ends its own transactions, never one
	// inside another: a walk's callback opens none, as a write transaction
	// that grows the file waits for every open read transaction, the
	// walk's included.
	ms         *storage.MetaStore
	root       string
	remote     bool
	configPath string
	storeDir   string // the node store's directory (store.Options.Dir)
	logf       func(format string, args ...any)
	resolver   *resolver
	cancel     context.CancelFunc // ends the resolver's resolves

	// layers orders a remote layer's commit against the release of its
	// store files by the Remove of its last snapshot. Lock order: layers,
	// then the metadata database's transactions, then (Remove) the node
	// store's locks of the layer, which content/store.RemoveLayer waits
	// for at most initLockWait. No holder of a transaction or of a store
	// lock waits for layers, and the image resolve a Prepare waits for is
	// over before it takes layers, so a holder waits only for the database
	// and for those bounded file locks.
	layers sync.Mutex
}

// New opens (or creates) the snapshotter under o.Root; snapshots of an
// earlier run are there again.
func New(o Options) (*Snapshotter, error) {
	if o.Root == "" || !filepath.IsAbs(o.Root) {
		return nil, fmt.Errorf("snapshotter root %q: must be an absolute path (set kata_fsx.snapshotter.root or --root)", o.Root)
	}
	if o.Config == nil {
		return nil, errors.New("snapshotter: no configuration")
	}
	if err := os.MkdirAll(o.Root, 0o700); err != nil {
		return nil, fmt.Errorf("snapshotter root: %w", err)
	}
	dbPath := filepath.Join(o.Root, "metadata.db")
	ms, err := storage.NewMetaStore(dbPath, func(bo *bolt.Options) error {
		bo.Timeout = metaLockWait
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshotter metadata %s: %w", dbPath, err)
	}
	// The database is flocked for as long as a snapshotter has it open,
	// and the MetaStore opens it at its first transaction, under a mutex
	// every later transaction takes: without the bound, and the open here,
	// a second snapshotter on this root would start and then hang every
	// request it serves behind the first one's lock.
	if err := ms.WithTransaction(context.Background(), false, func(context.Context) error { return nil }); err != nil {
		ms.Close()
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("snapshotter metadata %s: still locked after %v: another process (a snapshotter on root %s?) has it open", dbPath, metaLockWait, o.Root)
		}
		return nil, fmt.Errorf("snapshotter metadata %s: %w", dbPath, err)
	}
	inner, err := overlay.NewSnapshotter(o.Root, overlay.WithMetaStore(ms))
	if err != nil {
		ms.Close()
		return nil, fmt.Errorf("overlay snapshotter in %s: %w", o.Root, err)
	}
	logf := o.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	lo := node.LazyRootOptions(o.Config, logf)
	life, cancel := context.WithCancel(context.Background())
	s := &Snapshotter{
		inner:      inner,
		ms:         ms,
		root:       o.Root,
		remote:     o.Config.KataFSX.Snapshotter.Remote,
		configPath: o.Config.Path,
		storeDir:   lo.StoreDir,
		logf:       logf,
		cancel:     cancel,
		resolver:   newResolver(life, lazyroot.ImageOptions(lo)),
	}
	return s, nil
}

// Stat returns the info of a snapshot by name or key.
func (s *Snapshotter) Stat(ctx context.Context, key string) (snapshots.Info, error) {
	return s.inner.Stat(ctx, key)
}

// Update changes a snapshot's labels.
func (s *Snapshotter) Update(ctx context.Context, info snapshots.Info, fieldpaths ...string) (snapshots.Info, error) {
	return s.inner.Update(ctx, info, fieldpaths...)
}

// Walk calls fn for each snapshot matching the filters.
func (s *Snapshotter) Walk(ctx context.Context, fn snapshots.WalkFunc, filters ...string) error {
	return s.inner.Walk(ctx, fn, filters...)
}

// Commit commits an active snapshot.
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	return s.inner.Commit(ctx, name, key, opts...)
}

// Cleanup removes the directories of removed snapshots (containerd's
// garbage collection calls it).
func (s *Snapshotter) Cleanup(ctx context.Context) error {
	if c, ok := s.inner.(snapshots.Cleaner); ok {
		return c.Cleanup(ctx)
	}
	return nil
}

// Close stops the resolves in flight and closes the metadata database.
func (s *Snapshotter) Close() error {
	s.cancel()
	return s.inner.Close()
}

// Prepare makes an active snapshot; for a layer CRI pulls it makes the
// committed remote snapshot instead and returns errdefs.ErrAlreadyExists.
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return nil, err
		}
	}
	if target, ok := base.Labels[LabelRef]; ok && s.remote {
		if layer, ok := base.Labels[snapshotters.TargetLayerDigestLabel]; ok {
			err := s.prepareRemote(ctx, key, parent, target, base.Labels)
			if err == nil || errdefs.IsAlreadyExists(err) {
				return nil, fmt.Errorf("target snapshot %q: %w", target, errdefs.ErrAlreadyExists)
			}
			s.logf("snapshotter: layer %s (%s): downloaded by containerd, not remote: %v", layer, base.Labels[snapshotters.TargetRefLabel], err)
		}
	}
	m, err := s.inner.Prepare(ctx, key, parent, opts...)
	if err != nil {
		return nil, err
	}
	return s.remoteMounts(m)
}

// View makes a read-only snapshot of parent.
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	m, err := s.inner.View(ctx, key, parent, opts...)
	if err != nil {
		return nil, err
	}
	return s.remoteMounts(m)
}

// Mounts returns the mounts of an active or view snapshot.
func (s *Snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	m, err := s.inner.Mounts(ctx, key)
	if err != nil {
		return nil, err
	}
	return s.remoteMounts(m)
}

// prepareRemote commits the layer labels name as the remote snapshot
// target over parent, or says why it cannot.
func (s *Snapshotter) prepareRemote(ctx context.Context, key, parent, target string, labels map[string]string) error {
	imageRef, manifest, layer := labels[snapshotters.TargetRefLabel], labels[snapshotters.TargetManifestDigestLabel], labels[snapshotters.TargetLayerDigestLabel]
	if imageRef == "" || manifest == "" {
		return fmt.Errorf("no %s or %s label (a pull through CRI passes them; is disable_snapshot_annotations false?)",
			snapshotters.TargetRefLabel, snapshotters.TargetManifestDigestLabel)
	}
	ref, err := registry.ParseReference(imageRef)
	if err != nil {
		return err
	}
	md, err := digest.Parse(manifest)
	if err != nil {
		return fmt.Errorf("manifest digest label %q: %w", manifest, err)
	}
	ld, err := digest.Parse(layer)
	if err != nil {
		return fmt.Errorf("layer digest label %q: %w", layer, err)
	}
	ref.Tag, ref.Digest = "", md
	if _, err := s.inner.Stat(ctx, target); err == nil {
		// Committed already (another namespace pulled the image): the
		// snapshot is there, as AlreadyExists says.
		s.logf("snapshotter: layer %s of %s: snapshot %s exists already", ld, ref, target)
		return errdefs.ErrAlreadyExists
	}
	img, err := s.resolver.get(ctx, ref)
	if err != nil {
		return fmt.Errorf("lazy-read index of %s: %w", ref, err)
	}
	found := false
	for i, d := range img.Manifest.Layers {
		if d.Digest == ld {
			if img.Layers[i] == nil {
				return fmt.Errorf("image %s has no index of its layer %d", ref, i+1)
			}
			found = true
			break
		}
	}
	if !found {
		return fmt.Errorf("image %s has no layer %s", ref, ld)
	}

	s.layers.Lock()
	defer s.layers.Unlock()
	m, err := s.inner.Prepare(ctx, key, parent)
	if err != nil {
		return fmt.Errorf("prepare %s: %v", key, err) // %v: its AlreadyExists is not the target's
	}
	committed := false
	defer func() {
		if !committed {
			if err := s.inner.Remove(ctx, key); err != nil {
				s.logf("snapshotter: removing %s after a failed remote commit: %v", key, err)
			}
		}
	}()
	dir, err := snapshotDir(m)
	if err != nil {
		return err
	}
	if err := layerdir.WriteRemote(dir, layerdir.Remote{Ref: ref.String(), Layer: ld, Config: s.configPath}); err != nil {
		return err
	}
	cl := make(map[string]string, len(labels)+1)
	for k, v := range labels {
		cl[k] = v
	}
	cl[LabelRemote] = ld.String()
	if err := s.inner.Commit(ctx, target, key, snapshots.WithLabels(cl)); err != nil {
		return fmt.Errorf("commit %s: %w", target, err)
	}
	committed = true
	s.logf("snapshotter: layer %s of %s: remote (index %s), snapshot %s", ld, ref, img.IndexSource, target)
	return nil
}

// snapshotDir is the directory of the snapshot an active snapshot's
// mounts m are of: the parent of its fs directory, the bind source of a
// snapshot without parents or the overlay's upperdir.
func snapshotDir(m []mount.Mount) (string, error) {
	if len(m) == 1 {
		switch m[0].Type {
		case "bind":
			return filepath.Dir(m[0].Source), nil
		case "overlay":
			for _, o := range m[0].Options {
				if up, ok := strings.CutPrefix(o, "upperdir="); ok {
					return filepath.Dir(up), nil
				}
			}
		}
	}
	return "", fmt.Errorf("mounts %+v: not an overlay snapshot's", m)
}

// remoteMounts gives m with type layerdir.MountType when a layer below is
// remote and not materialized; its source and options stay as they are.
func (s *Snapshotter) remoteMounts(m []mount.Mount) ([]mount.Mount, error) {
	out := make([]mount.Mount, len(m))
	for i, mt := range m {
		var lowers []string
		switch mt.Type {
		case "bind":
			lowers = []string{mt.Source}
		case "overlay":
			for _, o := range mt.Options {
				if l, ok := strings.CutPrefix(o, "lowerdir="); ok {
					lowers = strings.Split(l, ":")
				}
			}
		}
		out[i] = mt
		pending, err := layerdir.Pending(lowers)
		if err != nil {
			return nil, err
		}
		if len(pending) > 0 {
			out[i].Type = layerdir.MountType
		}
	}
	return out, nil
}

// Usage of a remote snapshot is its fs directory's (0 until materialized)
// plus the blocks of its layer's files in the node store; of any other
// snapshot, the overlayfs snapshotter's.
func (s *Snapshotter) Usage(ctx context.Context, key string) (snapshots.Usage, error) {
	var (
		id   string
		info snapshots.Info
	)
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		var err error
		id, info, _, err = storage.GetInfo(ctx, key)
		return err
	}); err != nil {
		return snapshots.Usage{}, err
	}
	layer, ok := info.Labels[LabelRemote]
	if !ok {
		return s.inner.Usage(ctx, key)
	}
	// containerd's overlayfs layout: <root>/snapshots/<id>/fs.
	du, err := fs.DiskUsage(ctx, filepath.Join(s.root, "snapshots", id, "fs"))
	if err != nil {
		return snapshots.Usage{}, fmt.Errorf("usage of %s: %w", key, err)
	}
	u := snapshots.Usage(du)
	if d, err := digest.Parse(layer); err == nil {
		size, files := store.LayerDiskUsage(s.storeDir, d)
		u.Size += size
		u.Inodes += files
	}
	return u, nil
}

// Remove removes a snapshot; the Remove of the last snapshot of a remote
// layer releases the layer's files in the node store.
func (s *Snapshotter) Remove(ctx context.Context, key string) error {
	info, err := s.inner.Stat(ctx, key)
	if err != nil {
		return err
	}
	layer, remote := info.Labels[LabelRemote]
	if !remote {
		return s.inner.Remove(ctx, key)
	}
	s.layers.Lock()
	defer s.layers.Unlock()
	if err := s.inner.Remove(ctx, key); err != nil {
		return err
	}
	d, err := digest.Parse(layer)
	if err != nil {
		s.logf("snapshotter: removed %s, whose %s label %q is not a digest: its store files stay", key, LabelRemote, layer)
		return nil
	}
	others := 0
	filter := fmt.Sprintf(`labels."%s"==%s`, LabelRemote, d)
	if err := s.inner.Walk(ctx, func(_ context.Context, i snapshots.Info) error {
		if i.Labels[LabelRemote] == layer {
			others++
		}
		return nil
	}, filter); err != nil {
		s.logf("snapshotter: removed %s; looking for other snapshots of layer %s failed, its store files stay: %v", key, d, err)
		return nil
	}
	if others > 0 {
		return nil
	}
	if err := store.RemoveLayer(s.storeDir, d); err != nil {
		s.logf("snapshotter: removed %s, the last snapshot of layer %s; releasing its store files: %v", key, d, err)
		return nil
	}
	s.logf("snapshotter: removed %s, the last snapshot of layer %s: its store files released", key, d)
	return nil
}
