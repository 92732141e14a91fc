package snapshotter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/lazyimage/lazyimagetest"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/content/store"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/test/logtest"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// countingProxy is an HTTP proxy in front of the registry that counts the
// bytes of each blob it serves, so that a test sees what a pull fetched.
type countingProxy struct {
	addr string
	mu   sync.Mutex
	blob map[digest.Digest]int64
}

// logs records what the code under test logged.
type logs = logtest.Lines

func startProxy(t *testing.T, reg *registrytest.Registry) *countingProxy {
	t.Helper()
	p := &countingProxy{blob: make(map[digest.Digest]int64)}
	target, err := url.Parse("http://" + reg.Addr)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(r *http.Response) error {
		if i := strings.LastIndex(r.Request.URL.Path, "/blobs/"); i >= 0 {
			if d, err := digest.Parse(r.Request.URL.Path[i+len("/blobs/"):]); err == nil {
				r.Body = &countingBody{ReadCloser: r.Body, p: p, d: d}
			}
		}
		return nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: rp}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	p.addr = l.Addr().String()
	return p
}

type countingBody struct {
	io.ReadCloser
	p *countingProxy
	d digest.Digest
}

func (b *countingBody) Read(q []byte) (int, error) {
	n, err := b.ReadCloser.Read(q)
	b.p.mu.Lock()
	b.p.blob[b.d] += int64(n)
	b.p.mu.Unlock()
	return n, err
}

func (p *countingProxy) served(d digest.Digest) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.blob[d]
}

// hostsDir is a certs.d directory sending HOST to http://HOST.
func hostsDir(t *testing.T, hosts ...string) string {
	t.Helper()
	dir := t.TempDir()
	for _, h := range hosts {
		if err := os.MkdirAll(filepath.Join(dir, h), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, h, "hosts.toml"), []byte(fmt.Sprintf("server = %q\n", "http://"+h)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// env is a snapshotter under test, served on a socket and driven through
// containerd's own proxy client.
type env struct {
	t    *testing.T
	cfg  *config.Config
	root string
	sock string
	logs *logs
	sn   snapshots.Snapshotter
	stop func()
}

func newEnv(t *testing.T, hosts string) *env {
	t.Helper()
	testenv.Root(t, "the overlay snapshotter makes root-owned directories and the test mounts them")
	dir := t.TempDir()
	cfg := config.Default()
	cfg.KataFSX.Registry.ConfigPath = hosts
	cfg.KataFSX.ImagefsBlk.StateDir = filepath.Join(dir, "imagefs-blk")
	cfg.Path = filepath.Join(dir, "configuration.toml")
	if err := os.WriteFile(cfg.Path, []byte("[kata_fsx.registry]\nconfig_path = \""+hosts+"\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, cfg: cfg, root: filepath.Join(dir, "root"), sock: filepath.Join(dir, "s.sock"), logs: &logs{}}
	e.start()
	t.Cleanup(func() { e.stop() })
	return e
}

// start serves a new snapshotter on the env's root and socket.
func (e *env) start() {
	t := e.t
	t.Helper()
	l, err := Listen(e.sock)
	if err != nil {
		t.Fatal(err)
	}
	sn, err := New(Options{Root: e.root, Config: e.cfg, Logf: e.logs.Logf})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, l, sn) }()
	conn, err := grpc.NewClient("unix://"+e.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	e.sn = proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "kata-fsx")
	once := sync.Once{}
	e.stop = func() {
		once.Do(func() {
			conn.Close()
			cancel()
			if err := <-served; err != nil {
				t.Errorf("serve: %v", err)
			}
			if err := sn.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		})
	}
}

// image is a pushed test image and what CRI's labels say of it.
type image struct {
	*lazyimagetest.Image
	ref      string // HOST/REPO:TAG through the counting proxy
	manifest digest.Digest
	chain    []digest.Digest
}

func pushImage(t *testing.T, reg *registrytest.Registry, host, repo string, layers []lazyimagetest.Layer) *image {
	t.Helper()
	li := lazyimagetest.Write(t, "v1", layers)
	reg.Push(t, li.Dir, "v1", repo+":v1")
	img := &image{Image: li, ref: host + "/" + repo + ":v1", chain: identity.ChainIDs(slices.Clone(li.Config.RootFS.DiffIDs))}
	c := registry.New(registry.Options{ConfigPath: hostsDir(t, reg.Addr)})
	r, err := registry.ParseReference(reg.Addr + "/" + repo + ":v1")
	if err != nil {
		t.Fatal(err)
	}
	_, desc, err := c.ImageManifest(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	img.manifest = desc.Digest
	return img
}

// pushIndex pushes the image's index artifact (kata-fsx image index), as
// an operator would before pulling it lazily.
func pushIndex(t *testing.T, reg *registrytest.Registry, repo string) {
	t.Helper()
	opts := lazyimage.Options{Client: registry.New(registry.Options{ConfigPath: hostsDir(t, reg.Addr)})}
	r, err := registry.ParseReference(reg.Addr + "/" + repo + ":v1")
	if err != nil {
		t.Fatal(err)
	}
	img, err := lazyimage.Build(context.Background(), opts, r)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lazyimage.Push(context.Background(), opts, img); err != nil {
		t.Fatal(err)
	}
}

// criLabels are the labels containerd's CRI unpack gives layer i's Prepare.
func (img *image) criLabels(i int) map[string]string {
	var ls []string
	for _, d := range img.Manifest.Layers[i:] {
		ls = append(ls, d.Digest.String())
	}
	return map[string]string{
		LabelRef:                                 img.chain[i].String(),
		snapshotters.TargetRefLabel:              img.ref,
		snapshotters.TargetManifestDigestLabel:   img.manifest.String(),
		snapshotters.TargetLayerDigestLabel:      img.Manifest.Layers[i].Digest.String(),
		snapshotters.TargetImageLayersLabel:      strings.Join(ls, ","),
		"containerd.io/snapshot/unrelated.label": "kept",
	}
}

func (img *image) parent(i int) string {
	if i == 0 {
		return ""
	}
	return img.chain[i-1].String()
}

// pullRemote prepares every layer as CRI's unpack does and wants each to
// be a remote snapshot.
func (e *env) pullRemote(ctx context.Context, img *image) {
	t := e.t
	t.Helper()
	for i := range img.chain {
		_, err := e.sn.Prepare(ctx, fmt.Sprintf("extract-%d %s", i, img.chain[i]), img.parent(i), snapshots.WithLabels(img.criLabels(i)))
		if !errdefs.IsAlreadyExists(err) {
			t.Fatalf("Prepare of layer %d: %v, want AlreadyExists (a remote snapshot)\nlogs:\n%s", i, err, e.logs)
		}
		info, err := e.sn.Stat(ctx, img.chain[i].String())
		if err != nil {
			t.Fatal(err)
		}
		if info.Kind != snapshots.KindCommitted || info.Parent != img.parent(i) || info.Labels[LabelRemote] != img.Manifest.Layers[i].Digest.String() ||
			info.Labels["containerd.io/snapshot/unrelated.label"] != "kept" {
			t.Fatalf("layer %d's snapshot: %+v, want committed over %q with %s=%s", i, info, img.parent(i), LabelRemote, img.Manifest.Layers[i].Digest)
		}
	}
}

func lowerdirs(t *testing.T, m mount.Mount) []string {
	t.Helper()
	for _, o := range m.Options {
		if l, ok := strings.CutPrefix(o, "lowerdir="); ok {
			return strings.Split(l, ":")
		}
	}
	t.Fatalf("mount %+v has no lowerdir", m)
	return nil
}

func allocated(t *testing.T, p string) int64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Blocks * 512
}

// readLayer reads the start of layer i's tar through a node store on
// state's content directory, as the shim or the mount helper would.
func readLayer(t *testing.T, ctx context.Context, e *env, img *image, i int) {
	t.Helper()
	lo := lazyimage.Options{Client: registry.New(registry.Options{ConfigPath: e.cfg.KataFSX.Registry.ConfigPath}),
		CacheDir: node.LayoutOf(e.cfg).LazyIndexes()}
	r, err := registry.ParseReference(img.ref)
	if err != nil {
		t.Fatal(err)
	}
	r.Tag, r.Digest = "", img.manifest
	li, err := lazyimage.Resolve(ctx, lo, r)
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(store.Options{Dir: node.LayoutOf(e.cfg).ContentStore()})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.AddLayer(li.Layers[i], li.LayerFetcher(i)); err != nil {
		t.Fatal(err)
	}
	ra, err := st.Opener(nil).Open(index.Source{Kind: index.SourceBlob, ID: li.Layers[i].DiffID}, "")
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4096)
	if _, err := ra.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, img.Tars[i][:4096]) {
		t.Fatal("the store read other bytes than the layer's tar")
	}
}

// TestRemoteLayers: a CRI pull of an image with an index artifact makes
// remote snapshots without fetching any layer byte; mounts over them are
// of the mount helper's type; usage counts the store's bytes; restarts
// keep everything; the last Remove of a layer releases its store files.
func TestRemoteLayers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	reg := registrytest.Start(t, registrytest.Options{})
	px := startProxy(t, reg)
	e := newEnv(t, hostsDir(t, px.addr))
	layers := []lazyimagetest.Layer{
		{Dirs: []string{"etc", "data"}, Files: []lazyimagetest.File{{Name: "etc/a", Data: []byte("lower a\n")}, {Name: "data/random", Data: lazyimagetest.Random(1, 4<<20)}}},
		{Dirs: []string{"etc"}, Files: []lazyimagetest.File{{Name: "etc/c", Data: []byte("upper c\n")}, {Name: "etc/d", Data: lazyimagetest.Random(2, 64<<10)}}},
	}
	img := pushImage(t, reg, px.addr, "snap/img", layers)
	pushIndex(t, reg, "snap/img")

	e.pullRemote(ctx, img)
	for i, d := range img.Manifest.Layers {
		if n := px.served(d.Digest); n != 0 {
			t.Errorf("layer %d: the registry served %d of its %d bytes, want none", i, n, d.Size)
		}
		if !e.logs.Has(d.Digest.String(), "remote", "artifact") {
			t.Errorf("no log line of layer %d made remote from the artifact:\n%s", i, e.logs)
		}
	}

	// The container's snapshot over both: the mount helper's type, the
	// overlay's options naming the layers' (empty) fs directories.
	cm, err := e.sn.Prepare(ctx, "container", img.chain[1].String())
	if err != nil {
		t.Fatal(err)
	}
	if len(cm) != 1 || cm[0].Type != layerdir.MountType {
		t.Fatalf("container mounts %+v, want one of type %s", cm, layerdir.MountType)
	}
	lowers := lowerdirs(t, cm[0])
	if len(lowers) != 2 {
		t.Fatalf("lowerdirs %v, want the two layers", lowers)
	}
	for j, l := range lowers {
		i := len(lowers) - 1 - j // the top layer first
		r, ok, err := layerdir.ReadRemote(l)
		if err != nil || !ok {
			t.Fatalf("lowerdir %s: remote %v, %v", l, ok, err)
		}
		if r.Layer != img.Manifest.Layers[i].Digest || r.Ref != strings.TrimSuffix(img.ref, ":v1")+"@"+img.manifest.String() || r.Config != e.cfg.Path {
			t.Fatalf("lowerdir %s describes %+v, want layer %d of %s@%s, config %s", l, r, i, img.ref, img.manifest, e.cfg.Path)
		}
		if ents, err := os.ReadDir(l); err != nil || len(ents) != 0 {
			t.Fatalf("remote layer's fs directory %s: %v entries (%v), want it empty", l, len(ents), err)
		}
	}
	// A view of the base layer is a bind mount: the helper's type, its
	// options kept.
	vm, err := e.sn.View(ctx, "view0", img.chain[0].String())
	if err != nil {
		t.Fatal(err)
	}
	if len(vm) != 1 || vm[0].Type != layerdir.MountType || !slices.Contains(vm[0].Options, "ro") || !slices.Contains(vm[0].Options, "rbind") {
		t.Fatalf("view mounts %+v, want a %s mount with ro, rbind", vm, layerdir.MountType)
	}
	// Once the helper has materialized a layer, its mounts are plain.
	marker := filepath.Join(filepath.Dir(vm[0].Source), layerdir.MarkerName)
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if vm, err := e.sn.Mounts(ctx, "view0"); err != nil || vm[0].Type != "bind" {
		t.Fatalf("view of a materialized layer: %+v, %v; want a bind mount", vm, err)
	}
	if err := os.Remove(marker); err != nil {
		t.Fatal(err)
	}

	// Usage: nothing until the layer is read through the store, then its
	// blocks there.
	fsDir := allocated(t, vm[0].Source) // the empty directory's own blocks
	if u, err := e.sn.Usage(ctx, img.chain[0].String()); err != nil || u.Size != fsDir {
		t.Fatalf("usage of an unread remote layer: %+v, %v; want its empty directory's %d bytes", u, err, fsDir)
	}
	readLayer(t, ctx, e, img, 0)
	readLayer(t, ctx, e, img, 1)
	base := func(i int) string {
		return filepath.Join(node.LayoutOf(e.cfg).ContentStore(), "layers", img.Manifest.Layers[i].Digest.Encoded())
	}
	want := fsDir + allocated(t, base(0)+".data") + allocated(t, base(0)+".chunks")
	if u, err := e.sn.Usage(ctx, img.chain[0].String()); err != nil || u.Size != want || want <= fsDir {
		t.Fatalf("usage of a read remote layer: %+v, %v; want the store's %d bytes", u, err, want)
	}
	if px.served(img.Manifest.Layers[0].Digest) >= img.Manifest.Layers[0].Size {
		t.Errorf("reading 4 KiB fetched the whole layer (%d bytes)", px.served(img.Manifest.Layers[0].Digest))
	}

	// Restart: the same snapshots, labels and mounts.
	var before []snapshots.Info
	if err := e.sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error { before = append(before, i); return nil }); err != nil {
		t.Fatal(err)
	}
	e.stop()
	if _, err := os.Stat(e.sock); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("socket after stop: %v, want it removed", err)
	}
	e.start()
	var after []snapshots.Info
	if err := e.sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error { after = append(after, i); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(before) != 4 || fmt.Sprint(before) != fmt.Sprint(after) {
		t.Fatalf("snapshots before the restart:\n%v\nafter:\n%v", before, after)
	}
	if cm2, err := e.sn.Mounts(ctx, "container"); err != nil || fmt.Sprint(cm2) != fmt.Sprint(cm) {
		t.Fatalf("container mounts after the restart: %+v, %v; want %+v", cm2, err, cm)
	}

	// Another image (another namespace's pull, say) whose one layer is
	// the same blob as this image's upper layer.
	other := pushImage(t, reg, px.addr, "snap/other", layers[1:])
	if other.Manifest.Layers[0].Digest != img.Manifest.Layers[1].Digest {
		t.Fatal("the other image's layer is not the same blob")
	}
	e.pullRemote(ctx, other) // its layer's index is in the node cache
	if !e.logs.Has(other.Manifest.Layers[0].Digest.String(), "remote", "node cache") {
		t.Errorf("no log line of the other image's layer indexed from the node cache:\n%s", e.logs)
	}

	// Remove: the container, the view, then the layers.
	for _, k := range []string{"container", "view0", img.chain[1].String()} {
		if err := e.sn.Remove(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(base(1) + ".data"); err != nil {
		t.Fatalf("layer 1's store files after the Remove of one of its two snapshots: %v, want them kept", err)
	}
	if err := e.sn.Remove(ctx, other.chain[0].String()); err != nil {
		t.Fatal(err)
	}
	if err := e.sn.Remove(ctx, img.chain[0].String()); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		for _, ext := range []string{".data", ".chunks"} {
			if _, err := os.Stat(base(i) + ext); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("layer %d's %s after the Remove of its last snapshot: %v, want it gone", i, ext, err)
			}
		}
	}
	if !e.logs.Has("last snapshot", img.Manifest.Layers[0].Digest.String(), "released") {
		t.Errorf("no log line of the release:\n%s", e.logs)
	}
	if err := e.sn.(snapshots.Cleaner).Cleanup(ctx); err != nil {
		t.Fatal(err)
	}
	if ents, err := os.ReadDir(filepath.Join(e.root, "snapshots")); err != nil || len(ents) != 0 {
		t.Fatalf("snapshot directories after Remove and Cleanup: %d (%v), want none", len(ents), err)
	}
}

// TestRemoteStreamed: an image without an index artifact is indexed by
// streaming each layer once, however many Prepares of its layers wait for
// it at once; its layers are remote all the same.
func TestRemoteStreamed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	reg := registrytest.Start(t, registrytest.Options{})
	px := startProxy(t, reg)
	e := newEnv(t, hostsDir(t, px.addr))
	img := pushImage(t, reg, px.addr, "snap/streamed", []lazyimagetest.Layer{
		{Dirs: []string{"data"}, Files: []lazyimagetest.File{{Name: "data/random", Data: lazyimagetest.Random(5, 6<<20)}}},
		{Dirs: []string{"data"}, Files: []lazyimagetest.File{{Name: "data/text", Data: lazyimagetest.Text(6, 1<<20)}}},
	})
	// containerd may prepare a layer from several pulls at once: one
	// resolve serves them all, and one snapshot results.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for k := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[k] = e.sn.Prepare(ctx, fmt.Sprintf("extract-%d", k), "", snapshots.WithLabels(img.criLabels(0)))
		}()
	}
	wg.Wait()
	for k, err := range errs {
		if !errdefs.IsAlreadyExists(err) {
			t.Fatalf("concurrent Prepare %d of layer 0: %v, want AlreadyExists\nlogs:\n%s", k, err, e.logs)
		}
	}
	e.pullRemote(ctx, img)
	for i, d := range img.Manifest.Layers {
		if n := px.served(d.Digest); n != d.Size {
			t.Errorf("layer %d: the registry served %d bytes of its %d, want each byte once (one streaming build)", i, n, d.Size)
		}
		if !e.logs.Has(d.Digest.String(), "remote", "built by streaming") {
			t.Errorf("no log line of layer %d made remote by streaming:\n%s", i, e.logs)
		}
	}
	var n int
	if err := e.sn.Walk(ctx, func(context.Context, snapshots.Info) error { n++; return nil }); err != nil || n != 2 {
		t.Fatalf("%d snapshots (%v), want the two layers' (concurrent Prepares leave nothing behind)", n, err)
	}
}

// TestPlainLayers: layers without CRI's labels (ctr pull) are ordinary
// overlay snapshots: written, committed, viewed and mounted for real.
func TestPlainLayers(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	m, err := e.sn.Prepare(ctx, "extract-plain", "", snapshots.WithLabels(map[string]string{LabelRef: "sha256:plain"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 1 || m[0].Type != "bind" {
		t.Fatalf("mounts %+v, want a bind mount of the new layer", m)
	}
	data := lazyimagetest.Random(3, 100<<10)
	if err := os.WriteFile(filepath.Join(m[0].Source, "file"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.sn.Commit(ctx, "plain", "extract-plain"); err != nil {
		t.Fatal(err)
	}
	u, err := e.sn.Usage(ctx, "plain")
	if err != nil || u.Size < int64(len(data)) {
		t.Fatalf("usage of a plain layer of %d bytes: %+v, %v", len(data), u, err)
	}
	upper, err := e.sn.Prepare(ctx, "extract-upper", "plain")
	if err != nil {
		t.Fatal(err)
	}
	if upper[0].Type != "overlay" {
		t.Fatalf("mounts over a plain layer %+v, want overlay", upper)
	}
	vm, err := e.sn.View(ctx, "view", "plain")
	if err != nil {
		t.Fatal(err)
	}
	if len(vm) != 1 || vm[0].Type != "bind" {
		t.Fatalf("view mounts %+v, want bind", vm)
	}
	target := t.TempDir()
	if err := mount.All(vm, target); err != nil {
		t.Fatal(err)
	}
	defer mount.UnmountAll(target, 0)
	got, err := os.ReadFile(filepath.Join(target, "file"))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("file through the view's mount: %d bytes, %v", len(got), err)
	}
	if strings.Contains(e.logs.String(), "remote") {
		t.Errorf("a layer without CRI labels logged a remote decision:\n%s", e.logs)
	}
}

// TestFallback: a layer that cannot be remote (its registry is down, its
// labels incomplete, remote off) is prepared as usual, with one log line
// naming it and why.
func TestFallback(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	down := registrytest.FreePort(t)
	e := newEnv(t, hostsDir(t, down))
	img := &image{ref: down + "/snap/gone:v1", manifest: digest.FromString("manifest"), chain: []digest.Digest{digest.FromString("chain0")}}
	layer := digest.FromString("layer")
	labels := map[string]string{
		LabelRef:                               img.chain[0].String(),
		snapshotters.TargetRefLabel:            img.ref,
		snapshotters.TargetManifestDigestLabel: img.manifest.String(),
		snapshotters.TargetLayerDigestLabel:    layer.String(),
	}
	m, err := e.sn.Prepare(ctx, "extract-0", "", snapshots.WithLabels(labels))
	if err != nil || len(m) != 1 || m[0].Type != "bind" {
		t.Fatalf("Prepare of a layer on a registry that is down: %+v, %v; want an ordinary active snapshot", m, err)
	}
	if !e.logs.Has(layer.String(), "downloaded by containerd") {
		t.Errorf("no log line naming the layer and its fallback:\n%s", e.logs)
	}
	delete(labels, snapshotters.TargetManifestDigestLabel)
	if m, err := e.sn.Prepare(ctx, "extract-1", "", snapshots.WithLabels(labels)); err != nil || m[0].Type != "bind" {
		t.Fatalf("Prepare without a manifest label: %+v, %v", m, err)
	}
	if !e.logs.Has(layer.String(), snapshotters.TargetManifestDigestLabel) {
		t.Errorf("no log line naming the missing label:\n%s", e.logs)
	}

	// A zstd image: the lazy-read index cannot read it.
	reg := registrytest.Start(t, registrytest.Options{})
	li := lazyimagetest.Write(t, "v1", []lazyimagetest.Layer{{Files: []lazyimagetest.File{{Name: "f", Data: []byte("zstd\n")}}}})
	testenv.Tool(t, "skopeo", "skopeo")
	if out, err := exec.Command("skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false", "--dest-compress-format", "zstd",
		"oci:"+li.Dir+":v1", "docker://"+reg.Addr+"/snap/zstd:v1").CombinedOutput(); err != nil {
		t.Fatalf("skopeo: %v\n%s", err, out)
	}
	e.cfg.KataFSX.Registry.ConfigPath = hostsDir(t, reg.Addr)
	e.stop()
	e.start()
	c := registry.New(registry.Options{ConfigPath: e.cfg.KataFSX.Registry.ConfigPath})
	zref, err := registry.ParseReference(reg.Addr + "/snap/zstd:v1")
	if err != nil {
		t.Fatal(err)
	}
	zm, zdesc, err := c.ImageManifest(ctx, zref)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(zm.Layers[0].MediaType, "zstd") {
		t.Fatalf("pushed layer %s, want zstd", zm.Layers[0].MediaType)
	}
	zl := map[string]string{
		LabelRef:                               digest.FromString("zstd chain").String(),
		snapshotters.TargetRefLabel:            zref.String(),
		snapshotters.TargetManifestDigestLabel: zdesc.Digest.String(),
		snapshotters.TargetLayerDigestLabel:    zm.Layers[0].Digest.String(),
	}
	if m, err := e.sn.Prepare(ctx, "extract-zstd", "", snapshots.WithLabels(zl)); err != nil || m[0].Type != "bind" {
		t.Fatalf("Prepare of a zstd layer: %+v, %v; want an ordinary active snapshot", m, err)
	}
	if !e.logs.Has(zm.Layers[0].Digest.String(), "downloaded by containerd", "zstd") {
		t.Errorf("no log line naming the zstd layer and why:\n%s", e.logs)
	}

	// remote = false: CRI's labels are ignored.
	e.stop()
	e.cfg.KataFSX.Snapshotter.Remote = false
	e.start()
	n := e.logs.Len()
	if m, err := e.sn.Prepare(ctx, "extract-2", "", snapshots.WithLabels(labels)); err != nil || m[0].Type != "bind" {
		t.Fatalf("Prepare with remote off: %+v, %v", m, err)
	}
	if e.logs.Len() != n {
		t.Errorf("remote off, yet a remote decision was logged:\n%s", e.logs)
	}
}

// TestListenRefusesLiveSocket: a second snapshotter on a socket a live
// one serves is refused; a stale socket is replaced.
func TestListenRefusesLiveSocket(t *testing.T) {
	e := newEnv(t, t.TempDir())
	if _, err := Listen(e.sock); err == nil || !strings.Contains(err.Error(), "another snapshotter serves it") {
		t.Fatalf("Listen on a live snapshotter's socket: %v", err)
	}
	stale := filepath.Join(t.TempDir(), "stale.sock")
	l, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	l2, err := Listen(stale)
	if err != nil {
		t.Fatalf("Listen on a stale socket: %v", err)
	}
	l2.Close()
}

// TestSecondSnapshotterOnRoot: a snapshotter holds its root's metadata
// database for as long as it runs; a second one on the same root is
// refused when it starts, instead of starting and then hanging every
// request behind the first one's lock. Once the first stops, the root
// opens again.
func TestSecondSnapshotterOnRoot(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root")
	cfg := config.Default()
	first, err := New(Options{Root: root, Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	ctx := context.Background()
	if _, err := first.Stat(ctx, "none"); !errdefs.IsNotFound(err) {
		t.Fatalf("Stat of no snapshot: %v", err)
	}
	wait := metaLockWait
	metaLockWait = 100 * time.Millisecond
	defer func() { metaLockWait = wait }()
	second, err := New(Options{Root: root, Config: cfg})
	if err == nil {
		second.Close()
		t.Fatal("a second snapshotter started on the root another one has open")
	}
	if !strings.Contains(err.Error(), "another process") {
		t.Fatalf("second snapshotter on the root: %v, want it to say another process holds the metadata", err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	third, err := New(Options{Root: root, Config: cfg})
	if err != nil {
		t.Fatalf("a snapshotter on the root after the first one stopped: %v", err)
	}
	defer third.Close()
	if _, err := third.Stat(ctx, "none"); !errdefs.IsNotFound(err) {
		t.Fatalf("Stat of no snapshot: %v", err)
	}
}
