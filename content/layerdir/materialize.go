package layerdir

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/node"
)

// Files Materialize keeps in the snapshot directory beside the fs
// directory. The snapshotter removes the snapshot directory as a whole, so
// none of them needs cleaning by anyone else.
const (
	// lockName is flocked while a process materializes the layer.
	lockName = "kata-fsx-materialize.lock"
	// pendingName exists from just before the written tree replaces the fs
	// directory until the marker is written: an fs directory that is not
	// empty without the marker is then this helper's interrupted work, to
	// be redone, not something else's to be refused.
	pendingName = "kata-fsx-materializing"
	// stageName is the tree being written.
	stageName = "fs.kata-fsx-stage"
	// trashName holds an interrupted run's tree while it is removed.
	trashName = "fs.kata-fsx-trash"

	// progressMin is the least layer data that gets progress lines.
	progressMin = 4 << 20
	// progressEvery is the most time between progress lines.
	progressEvery = 2 * time.Second
	// copyBuf is the size of one read through the store.
	copyBuf = 1 << 20
	// lockPoll is how often a caller waiting for another process's
	// materialization looks again (flock cannot wait on a context).
	lockPoll = 50 * time.Millisecond
)

// Materialize writes the remote layer whose overlay lowerdir (the
// snapshot's fs directory) is lower as a real overlayfs layer directory,
// reading its files through the node's lazy content store, and then marks
// it (MarkerName). It does nothing for a layer already marked, and waits
// for another process materializing the same layer. An interrupted run
// leaves no marker; the next one starts over. logf gets progress lines for
// layers of more than a few MiB; nil discards them.
func Materialize(ctx context.Context, lower string, logf func(format string, args ...any)) error {
	return writeTree(ctx, lower, logf, false)
}

// writeTree writes, beside the remote layer whose fs directory is lower,
// the layer itself into lower or (skeleton) its skeleton, under the
// snapshot's lock, unless the tree's marker says it is there already.
func writeTree(ctx context.Context, lower string, logf func(format string, args ...any), skeleton bool) error {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if !filepath.IsAbs(lower) {
		return fmt.Errorf("layer %q: not an absolute path", lower)
	}
	lower = filepath.Clean(lower)
	snap := filepath.Dir(lower)
	m := &materializer{ctx: ctx, lower: lower, snap: snap, base: filepath.Base(lower), logf: logf,
		skeleton: skeleton, stage: stageName, marker: MarkerName}
	what := "materialize remote layer"
	if skeleton {
		m.base, m.stage, m.marker, what = SkeletonName, skeletonStageName, SkeletonMarkerName, "skeleton of remote layer"
	}
	if _, err := os.Lstat(filepath.Join(snap, m.marker)); err == nil {
		return nil
	}
	r, ok, err := ReadRemote(lower)
	if err != nil {
		return fmt.Errorf("layer %s: %w", lower, err)
	}
	if !ok {
		return fmt.Errorf("layer %s: no %s beside it: not a remote layer of the kata-fsx snapshotter", lower, SidecarName)
	}
	m.remote = r
	sd, err := unix.Open(snap, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("layer %s: snapshot directory: %w", lower, &os.PathError{Op: "open", Path: snap, Err: err})
	}
	defer unix.Close(sd)
	m.sd = sd
	unlock, err := lockSnapshot(ctx, sd, lower, logf)
	if err != nil {
		return err
	}
	defer unlock()
	if exists(sd, m.marker) {
		return nil
	}
	if err := m.run(); err != nil {
		// The stage is this run's: nothing of it stays for the next.
		if rerr := os.RemoveAll(filepath.Join(snap, m.stage)); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return fmt.Errorf("%s %s (%s of %s): %w", what, lower, r.Layer, r.Ref, err)
	}
	if skeleton {
		logf("layer %s of %s: skeleton for containerd's temporary mount, %d file(s) over %d KiB left out", r.Layer, r.Ref, m.left, SkeletonMaxFile>>10)
	}
	return nil
}

// lockSnapshot takes the snapshot's materialization lock, waiting for
// another holder (another mount of the same layer) as long as ctx allows.
//
// Lock order: it is the package's only lock and is held alone; a holder
// takes no other snapshot's lock (a layer is written from its own index
// and the lower layers' indexes, never from their directories). While it
// holds the lock it waits for the image's resolve (the registry, within
// ctx), for reads through the node store (each within the store's read
// timeout, whose file locks are bounded too) and for its own writes, none
// of which waits for a materialization lock: a waiter, in any process,
// waits for a holder's progress only, and a stopped holder's lock goes
// with its process.
func lockSnapshot(ctx context.Context, sd int, lower string, logf func(string, ...any)) (func(), error) {
	fd, err := unix.Openat(sd, lockName, unix.O_RDWR|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("layer %s: lock file: %w", lower, err)
	}
	waited := false
	for {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Close(fd) }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			unix.Close(fd)
			return nil, fmt.Errorf("layer %s: lock %s: %w", lower, lockName, err)
		}
		if !waited {
			logf("layer %s: another process is materializing it; waiting", lower)
			waited = true
		}
		select {
		case <-ctx.Done():
			unix.Close(fd)
			return nil, fmt.Errorf("layer %s: waiting for another process materializing it: %w", lower, ctx.Err())
		case <-time.After(lockPoll):
		}
	}
}

func exists(dirfd int, name string) bool {
	var st unix.Stat_t
	return unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
}

// materializer is one run of Materialize, under the lock.
type materializer struct {
	ctx    context.Context
	lower  string
	snap   string // the snapshot directory, parent of lower
	base   string // lower's name in snap ("fs")
	sd     int    // snap, opened
	remote Remote
	logf   func(string, ...any)

	// skeleton is set for a skeleton (see MaterializeSkeleton); stage and
	// marker are the names of the tree being written and of the mark of
	// the finished one.
	skeleton      bool
	stage, marker string
	volumes       []string // the image's volumes, as index paths
	left          int      // files a skeleton leaves out

	img     *lazyimage.Image
	layer   int // the layer's position in img
	opts    lazyroot.Options
	store   *store.Store
	opener  index.Opener
	added   map[int]bool            // layers added to the store
	below   *index.Index            // merged tree of the layers below, when needed
	belowBy map[string]*index.Entry // below's entries by path

	total, done int64
	lastLog     time.Time
	loggedPart  int64
	buf         []byte // one read through the store
}

func (m *materializer) run() error {
	if m.skeleton {
		if err := m.prepareSkeleton(); err != nil {
			return err
		}
	} else if err := m.prepare(); err != nil {
		return err
	}
	if err := m.resolve(); err != nil {
		return err
	}
	defer m.store.Close()
	ix := m.img.Layers[m.layer]
	if err := m.writeStage(ix.Tree); err != nil {
		return err
	}
	return m.commit()
}

// prepare checks the fs directory and clears what an interrupted run left.
func (m *materializer) prepare() error {
	pending := exists(m.sd, pendingName)
	var st unix.Stat_t
	err := unix.Fstatat(m.sd, m.base, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case errors.Is(err, unix.ENOENT) && pending:
		// An interrupted run had moved its own tree away.
	case err != nil:
		return fmt.Errorf("fs directory: %w", &os.PathError{Op: "lstat", Path: m.lower, Err: err})
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s is not a directory (mode %#o): remove the snapshot and pull the image again", m.lower, st.Mode)
	default:
		empty, err := emptyDir(m.sd, m.base)
		if err != nil {
			return err
		}
		if !empty {
			if !pending {
				return fmt.Errorf("%s is not empty but has no %s marker: it was not written by this helper; remove the snapshot and pull the image again", m.lower, MarkerName)
			}
			m.logf("layer %s: removing the tree of an interrupted materialization", m.lower)
			if err := os.RemoveAll(filepath.Join(m.snap, trashName)); err != nil {
				return err
			}
			if err := unix.Renameat(m.sd, m.base, m.sd, trashName); err != nil {
				return fmt.Errorf("move the interrupted tree aside: %w", err)
			}
		}
	}
	for _, n := range []string{stageName, trashName} {
		if err := os.RemoveAll(filepath.Join(m.snap, n)); err != nil {
			return fmt.Errorf("remove what an interrupted materialization left: %w", err)
		}
	}
	return nil
}

func emptyDir(dirfd int, name string) (bool, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("open fs directory %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	names, err := f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("read fs directory: %w", err)
	}
	return len(names) == 0, nil
}

// resolve finds the image and the layer and opens the node's store.
func (m *materializer) resolve() error {
	r := m.remote
	cfg, err := config.Load(r.Config)
	if err != nil {
		return fmt.Errorf("kata-fsx configuration %q named by %s: %w (the snapshotter's configuration must stay where it was when the layer was pulled)",
			r.Config, SidecarName, err)
	}
	m.opts = node.LazyRootOptions(cfg, m.logf)
	if m.opts.StoreDir == "" {
		return fmt.Errorf("configuration %s sets no kata_fsx.imagefs_blk.state_dir: the node's content store has no place", cfg.Path)
	}
	ref, err := registry.ParseReference(r.Ref)
	if err != nil {
		return fmt.Errorf("image %q in %s: %w", r.Ref, SidecarName, err)
	}
	if m.img, err = lazyimage.Resolve(m.ctx, lazyroot.ImageOptions(m.opts), ref); err != nil {
		return err
	}
	m.layer = -1
	for i, d := range m.img.Manifest.Layers {
		if d.Digest == r.Layer {
			m.layer = i
			break
		}
	}
	if m.layer < 0 {
		return fmt.Errorf("image %s has no layer %s (its %d layers are %s): the sidecar %s does not match its image; remove the snapshot and pull the image again",
			r.Ref, r.Layer, len(m.img.Manifest.Layers), layerList(m.img), SidecarName)
	}
	if m.store, err = lazyroot.OpenStore(m.opts); err != nil {
		return err
	}
	m.opener = m.store.Opener(nil)
	m.added = map[int]bool{}
	if err := m.addLayer(m.layer); err != nil {
		m.store.Close()
		return err
	}
	return nil
}

func layerList(img *lazyimage.Image) string {
	s := ""
	for i, d := range img.Manifest.Layers {
		if i > 0 {
			s += ", "
		}
		s += d.Digest.String()
	}
	return s
}

func (m *materializer) addLayer(i int) error {
	if m.added[i] {
		return nil
	}
	if err := m.store.AddLayer(m.img.Layers[i], m.img.LayerFetcher(i)); err != nil {
		return fmt.Errorf("layer %d of %s: %w", i+1, m.img.Ref, err)
	}
	m.added[i] = true
	return nil
}

// lowerEntry returns the entry at p in the merged tree of the layers below
// this one (a hard link resolved to its target), or nil. The merge is done
// once, on the first call: only layers with implied directories or hard
// links into lower layers need it.
func (m *materializer) lowerEntry(p string) (*index.Entry, error) {
	if m.layer == 0 {
		return nil, nil
	}
	if m.below == nil {
		trees := make([]*index.Index, m.layer)
		names := make([]string, m.layer)
		for i := range trees {
			trees[i], names[i] = m.img.Layers[i].Tree, fmt.Sprintf("%d (%s)", i+1, m.img.Layers[i].DiffID)
		}
		t, err := overlayfs.Merge(m.ctx, trees, names, (&index.Options{MaxEntries: m.opts.MaxEntries}).EntryLimit())
		if err != nil {
			return nil, fmt.Errorf("layers below %s: %w", m.remote.Layer, err)
		}
		m.below = t
		m.belowBy = make(map[string]*index.Entry, len(t.Entries))
		for i := range t.Entries {
			m.belowBy[t.Entries[i].Path] = &t.Entries[i]
		}
	}
	e := m.belowBy[p]
	if e != nil && e.Type == index.TypeHardlink {
		e = m.belowBy[e.Linkname]
	}
	return e, nil
}

// commit syncs the stage, swaps it in for the fs directory and writes the
// marker.
func (m *materializer) commit() error {
	if err := syncDir(m.sd, m.stage, true); err != nil {
		return err
	}
	if err := writeFileAt(m.sd, pendingName, nil); err != nil {
		return err
	}
	// rename(2) replaces an empty directory in one step (the fs directory
	// was checked empty under the lock; a non-empty one fails it).
	if err := unix.Renameat(m.sd, m.stage, m.sd, m.base); err != nil {
		return fmt.Errorf("swap the written tree in for %s: %w", m.lower, err)
	}
	if err := unix.Fsync(m.sd); err != nil {
		return fmt.Errorf("sync %s: %w", m.snap, err)
	}
	if err := writeFileAt(m.sd, m.marker, []byte(m.remote.Layer.String()+"\n")); err != nil {
		return err
	}
	if err := unix.Unlinkat(m.sd, pendingName, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", pendingName, err)
	}
	return nil
}

// syncDir flushes the file system holding name (syncfs: one call for the
// whole tree rather than one fsync per file).
func syncDir(dirfd int, name string, fsWide bool) error {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s to sync: %w", name, err)
	}
	defer unix.Close(fd)
	if fsWide {
		err = unix.Syncfs(fd)
	} else {
		err = unix.Fsync(fd)
	}
	if err != nil {
		return fmt.Errorf("sync %s: %w", name, err)
	}
	return nil
}

// writeFileAt writes name in dirfd durably (a temporary file renamed over
// it, the directory synced).
func writeFileAt(dirfd int, name string, b []byte) error {
	tmp := name + ".tmp"
	fd, err := unix.Openat(dirfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Renameat(dirfd, tmp, dirfd, name)
	}
	if err == nil {
		err = unix.Fsync(dirfd)
	}
	if err != nil {
		unix.Unlinkat(dirfd, tmp, 0)
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

// progress counts n more bytes written and logs a line now and then.
func (m *materializer) progress(n int64) {
	m.done += n
	if m.total < progressMin {
		return
	}
	// A line per quarter, and at least every progressEvery.
	part := m.done * 4 / m.total
	if part == m.loggedPart && time.Since(m.lastLog) < progressEvery && m.done < m.total {
		return
	}
	m.loggedPart, m.lastLog = part, time.Now()
	m.logf("layer %s: materialized %s of %s", m.remote.Layer, mib(m.done), mib(m.total))
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// readerFor returns the reader of the layer data of e, an entry of the
// tree whose sources are src.
func (m *materializer) readerFor(src []index.Source, e *index.Entry) (io.ReaderAt, error) {
	if int(e.Data.Source) >= len(src) {
		return nil, fmt.Errorf("entry %q: data source %d out of range", index.Trunc(e.Path), e.Data.Source)
	}
	ra, err := m.opener.Open(src[e.Data.Source], "")
	if err != nil {
		return nil, fmt.Errorf("entry %q: %w", index.Trunc(e.Path), err)
	}
	return ra, nil
}
