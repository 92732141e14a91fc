// Package blk is imagefs-blk: it turns a container image into a disk the
// guest mounts as ext4. The image's tree is indexed (blk/index), the ext4
// metadata synthesized with data left in place (blk/ext4), guest writes go
// to a copy-on-write overlay (blk/overlay), and the disk is served to QEMU
// over vhost-user-blk (blk/vhostblk), all in the caller's process.
package blk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/imagestore"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/blk/rawimage"
	"github.com/kata-fsx/kata-fsx/blk/vhostblk"
)

// Options configure one disk.
type Options struct {
	// CacheDir holds the per-layer index cache, the blob cache and the
	// node's image store (CacheDir/images), which Create and
	// CreateFromIndex share images through.
	CacheDir string
	// LayerKeys is index.Options.LayerKeys for Create and Build: a key per
	// layer that is immutable (a committed snapshot's lowerdir), "" for a
	// mutable one (the upperdir, a bind rootfs); only keyed layers are
	// cached.
	LayerKeys []string
	// WritableSize is the free space added for guest writes, in bytes.
	WritableSize int64
	// BlockSize is the ext4 block size (4096 or 2048).
	BlockSize int
	// Journal and JournalSize control the filesystem's journal.
	Journal     bool
	JournalSize int64
	// NumQueues is the most queues the frontend may use; QEMU's num-queues
	// must not exceed it.
	NumQueues int
	// QueueSize is the frontend's descriptors per queue (QEMU's
	// queue-size); the device offers seg_max = QueueSize-2 segments per
	// request, as QEMU's own virtio-blk does, so the guest sends requests
	// of the same size to both. Zero keeps the server's default.
	QueueSize int
	ReadOnly  bool
	// Socket is where Create serves the disk (default DIR/vhost-blk.sock);
	// unix socket paths are limited to 107 bytes, so callers with deep
	// directories put it somewhere shorter.
	Socket string
	// Budgets bound what the image may make Create and Build spend.
	Budgets Budgets
	// Opener reads file data; nil means this host's files and blob cache
	// (hostfs.Opener over CacheDir). A lazy image's store goes here.
	Opener index.Opener
}

// Budgets bound what one image may make a build spend (the
// [kata_fsx.imagefs_blk] max_* keys); a zero field keeps the package
// default of index or ext4.
type Budgets struct {
	MaxEntries       int   // entries of one layer and of the merged tree
	MaxLayerBytes    int64 // one layer, uncompressed
	MaxMetadataBytes int64 // synthesized ext4 metadata
	MaxBuildMemory   int64 // the build's accounting of its in-memory tables
}

// indexOptions are the index options that carry b.
func (b Budgets) indexOptions(cacheDir string, keys []string) index.Options {
	return index.Options{CacheDir: cacheDir, LayerKeys: keys, MaxEntries: b.MaxEntries, MaxBlobSize: b.MaxLayerBytes}
}

// segMax is the seg_max matching a queue of n descriptors: a request's
// header and status take two of them.
func segMax(n int) int {
	if n <= 2 {
		return 0
	}
	return n - 2
}

// maxSocketPath is the longest path a unix socket can be bound to.
const maxSocketPath = 107

func socketPath(dir string, opts Options) (string, error) {
	p := opts.Socket
	if p == "" {
		p = filepath.Join(dir, socketFile)
	}
	if len(p) > maxSocketPath {
		return "", fmt.Errorf("imagefs-blk: socket path %s is %d bytes, over the %d-byte limit of unix sockets: use a shorter state_dir", p, len(p), maxSocketPath)
	}
	return p, nil
}

// Disk is an imagefs-blk disk being served on a vhost-user socket.
type Disk struct {
	Dir    string // the overlay (and a private image, if any) live here
	Socket string
	// Image is the image served: an entry of the node's image store,
	// shared read-only with every pod of the same image, or the disk's own.
	Image *ext4.Image
	// Build says how the image was obtained (timings, shared or built).
	Build BuildInfo

	entry *imagestore.Entry // the store entry Image is, held until Close
	base  *rawimage.Disk
	dev   *overlay.Device
	srv   *vhostblk.Server
}

// Files in a disk directory, and the image store under a cache directory.
const (
	imageDir    = "image"
	overlayFile = "overlay"
	socketFile  = "vhost-blk.sock"
	storeDir    = "images"
)

// ImageStoreDir is the node's image store under a cache directory.
func ImageStoreDir(cacheDir string) string { return filepath.Join(cacheDir, storeDir) }

// ext4Options are the synthesis options of opts.
func ext4Options(opts Options) ext4.Options {
	eo := ext4.Options{BlockSize: opts.BlockSize, WritableSize: opts.WritableSize, JournalSize: opts.JournalSize, NoJournal: !opts.Journal,
		MaxMetadataBytes: opts.Budgets.MaxMetadataBytes, MaxBuildMemory: opts.Budgets.MaxBuildMemory}
	if opts.WritableSize == 0 {
		eo.WritableSize = -1
	}
	return eo
}

func synthesize(ctx context.Context, idx *index.Index, dir string, opts Options) (*ext4.Image, error) {
	eo := ext4Options(opts)
	// The metadata is written beside the image it becomes, not in a tmpfs
	// /tmp that the guests' memory may share.
	eo.TempDir = dir
	img, err := ext4.Build(ctx, idx, eo)
	if err != nil {
		return nil, fmt.Errorf("imagefs-blk: synthesize ext4: %w", err)
	}
	if err := img.WriteTo(filepath.Join(dir, imageDir)); err != nil {
		img.Close()
		return nil, fmt.Errorf("imagefs-blk: %w", err)
	}
	return img, nil
}

// Serve serves a built image (an `image build` directory) on socket with
// guest writes going to overlayPath ("" with opts.ReadOnly: no overlay).
// Reopening the same overlay resumes from what was flushed to it.
func Serve(ctx context.Context, imgDir, overlayPath, socket string, opts Options) (*Disk, error) {
	img, err := ext4.Open(imgDir)
	if err != nil {
		return nil, err
	}
	d, err := serveImage(ctx, img, overlayPath, socket, opts)
	if err != nil {
		img.Close()
		return nil, err
	}
	return d, nil
}

func serveImage(ctx context.Context, img *ext4.Image, overlayPath, socket string, opts Options) (*Disk, error) {
	d := &Disk{Dir: filepath.Dir(overlayPath), Socket: socket, Image: img}
	opener := opts.Opener
	if opener == nil {
		opener = &hostfs.Opener{CacheDir: opts.CacheDir}
	}
	d.base = rawimage.New(img, opener)
	var err error
	d.dev, err = overlay.Open(d.base, d.base.Size(), overlayPath, overlay.Options{BlockSize: int(img.Manifest.BlockSize), ReadOnly: opts.ReadOnly, Serial: "imagefs-blk"})
	if err != nil {
		d.base.Close()
		return nil, fmt.Errorf("imagefs-blk: overlay %s: %w", overlayPath, err)
	}
	d.srv, err = vhostblk.Serve(ctx, socket, d.dev, vhostblk.Options{NumQueues: max(opts.NumQueues, 1), SegMax: segMax(opts.QueueSize)})
	if err != nil {
		d.dev.Close()
		d.base.Close()
		return nil, fmt.Errorf("imagefs-blk: serve %s: %w", socket, err)
	}
	return d, nil
}

// Create indexes a rootfs (layers lowest first) and serves it as a pod's
// disk from dir (created 0700): the image from the node's image store
// (see CreateFromIndex), dir/overlay (+ .dirty), dir/vhost-blk.sock.
func Create(ctx context.Context, layers []string, dir string, opts Options) (*Disk, error) {
	layers, opts.LayerKeys = dropEmptyUpper(layers, opts.LayerKeys)
	start := time.Now()
	idx, err := overlayfs.FromLayers(ctx, layers, opts.Budgets.indexOptions(opts.CacheDir, opts.LayerKeys))
	if err != nil {
		return nil, fmt.Errorf("imagefs-blk: index rootfs: %w", err)
	}
	return create(ctx, idx, dir, opts, BuildInfo{Index: time.Since(start)})
}

// dropEmptyUpper leaves out the top layer when it is mutable (no key) and
// an empty directory without xattrs: a container's fresh upper directory.
// It adds no file, but the merged root would take its attributes (its
// creation time), which would give every container of an image a
// filesystem, and an image store entry, of its own; without it the root
// is the image's.
func dropEmptyUpper(layers, keys []string) ([]string, []string) {
	top := len(layers) - 1
	if top < 1 || len(keys) != len(layers) || keys[top] != "" {
		return layers, keys
	}
	f, err := os.Open(layers[top])
	if err != nil {
		return layers, keys
	}
	defer f.Close()
	if _, err := f.Readdirnames(1); !errors.Is(err, io.EOF) { // io.EOF: empty
		return layers, keys
	}
	if !onlyOverlayXattrs(f) {
		return layers, keys
	}
	return layers[:top], keys[:top]
}

// onlyOverlayXattrs reports whether the directory f has no extended
// attributes but overlayfs's own: the kernel's overlayfs (6.6 and later)
// stamps trusted.overlay.uuid (or user.overlay.* with userxattr) on an
// upper directory the first time it is mounted, which the shim does
// before the disk is built, and those say nothing about the files.
func onlyOverlayXattrs(f *os.File) bool {
	n, err := unix.Flistxattr(int(f.Fd()), nil)
	if err != nil {
		return false
	}
	if n == 0 {
		return true
	}
	buf := make([]byte, n)
	if n, err = unix.Flistxattr(int(f.Fd()), buf); err != nil {
		return false
	}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "trusted.overlay.") && !strings.HasPrefix(name, "user.overlay.") {
			return false
		}
	}
	return true
}

// create serves idx from the node's image store, or, without a cache
// directory, from an image synthesized into dir/image.
func create(ctx context.Context, idx *index.Index, dir string, opts Options, info BuildInfo) (*Disk, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("imagefs-blk: %w", err)
	}
	sock, err := socketPath(dir, opts)
	if err != nil {
		return nil, err
	}
	var (
		img   *ext4.Image
		entry *imagestore.Entry
	)
	if opts.CacheDir == "" {
		start := time.Now()
		if img, err = synthesize(ctx, idx, dir, opts); err != nil {
			return nil, err
		}
		info.Synthesis = time.Since(start)
	} else {
		if entry, err = imagestore.New(ImageStoreDir(opts.CacheDir)).Acquire(ctx, idx, ext4Options(opts)); err != nil {
			return nil, fmt.Errorf("imagefs-blk: %w", err)
		}
		img, info.Synthesis, info.Shared = entry.Image, entry.Synthesis, !entry.Built
	}
	// The index and the build's tables are garbage now (unless the caller
	// keeps the index): a pod's serving process returns them to the
	// system rather than holding a build's peak for the pod's lifetime.
	idx = nil
	debug.FreeOSMemory()
	d, err := serveImage(ctx, img, filepath.Join(dir, overlayFile), sock, opts)
	if err != nil {
		if entry != nil {
			entry.Close()
		} else {
			img.Close()
		}
		return nil, err
	}
	d.entry, d.Build = entry, info
	return d, nil
}

// Overlay is the copy-on-write device, for listing what the pod changed.
func (d *Disk) Overlay() *overlay.Device { return d.dev }

// Close stops serving and flushes the overlay; the files stay.
func (d *Disk) Close() error {
	var errs []error
	if d.srv != nil {
		errs = append(errs, d.srv.Close())
	}
	if d.dev != nil {
		errs = append(errs, d.dev.Close())
	}
	if d.base != nil {
		errs = append(errs, d.base.Close())
	}
	if d.entry != nil {
		errs = append(errs, d.entry.Close()) // closes Image, lets a pruner have the entry
	} else if d.Image != nil {
		errs = append(errs, d.Image.Close())
	}
	return errors.Join(errs...)
}

// Remove closes the disk and deletes its directory (overlay, a private
// image) and socket; a shared image stays in the node's store.
func (d *Disk) Remove() error {
	err := d.Close()
	if rmErr := os.RemoveAll(d.Dir); rmErr != nil {
		err = errors.Join(err, rmErr)
	}
	if rmErr := os.Remove(d.Socket); rmErr != nil && !os.IsNotExist(rmErr) {
		err = errors.Join(err, rmErr)
	}
	return err
}
