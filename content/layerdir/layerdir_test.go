package layerdir

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/test/logtest"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// Environment of a re-executed test binary that materializes one layer
// (TestConcurrent, TestKilled).
const (
	envChildLower = "KATA_FSX_LAYERDIR_TEST_LOWER"
	envChildMode  = "KATA_FSX_LAYERDIR_TEST_MODE" // "slow" or "hang"
)

// TestMain makes the test binary the mount helper when mount.fuse3 runs it
// under HelperName, and a materializing child under envChildLower.
func TestMain(m *testing.M) {
	if filepath.Base(os.Args[0]) == HelperName {
		os.Exit(HelperMain(os.Args))
	}
	if lower := os.Getenv(envChildLower); lower != "" {
		os.Exit(child(lower, os.Getenv(envChildMode)))
	}
	os.Exit(m.Run())
}

// child materializes lower, printing its log lines; "slow" holds each
// progress line, "hang" stops for good at the first one that is not the
// last, for the parent to kill it there.
func child(lower, mode string) int {
	logf := func(format string, args ...any) {
		line := fmt.Sprintf(format, args...)
		fmt.Println(line)
		if !strings.Contains(line, "materialized ") {
			return
		}
		switch mode {
		case "slow":
			time.Sleep(300 * time.Millisecond)
		case "hang":
			var done, total float64
			if _, err := fmt.Sscanf(line[strings.Index(line, "materialized "):], "materialized %f MiB of %f MiB", &done, &total); err == nil && done < total {
				fmt.Println("HANGING")
				select {}
			}
		}
	}
	if err := Materialize(context.Background(), lower, logf); err != nil {
		fmt.Println("ERROR:", err)
		return 1
	}
	fmt.Println("DONE")
	return 0
}

// member is one tar entry of a test layer.
type member struct {
	hdr  tar.Header
	data []byte
}

func layerTar(t *testing.T, ms []member) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, m := range ms {
		h := m.hdr
		h.Size = int64(len(m.data))
		h.Format = tar.FormatPAX
		if h.ModTime.IsZero() {
			h.ModTime = time.Unix(1700000000, 0)
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func dir(name string, mode int64, uid, gid int) member {
	return member{hdr: tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: mode, Uid: uid, Gid: gid}}
}

func file(name string, mode int64, uid, gid int, data []byte) member {
	return member{hdr: tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode, Uid: uid, Gid: gid}, data: data}
}

func tarNode(name string, typ byte, mode int64, link string) member {
	return member{hdr: tar.Header{Name: name, Typeflag: typ, Mode: mode, Linkname: link}}
}

// image is the test image: two layers with every kind of entry.
type image struct {
	reg     *registrytest.Registry
	ref     string // pinned to the manifest
	layers  [][]byte
	digests []digest.Digest
	outside string // a host directory a layer's symlink points at
	big     []byte
}

func pushImage(t *testing.T) *image {
	t.Helper()
	reg := registrytest.Start(t, registrytest.Options{})
	im := &image{reg: reg, outside: t.TempDir()}
	rng := rand.New(rand.NewPCG(1, 2))
	im.big = make([]byte, 6<<20+123)
	for i := range im.big {
		im.big[i] = byte(rng.Uint32())
	}
	xa := file("xa", 0o644, 0, 0, []byte("with xattrs\n"))
	xa.hdr.PAXRecords = map[string]string{"SCHILY.xattr.user.test": "hello", "SCHILY.xattr.trusted.kfsx": "v\x00w"}
	xd := dir("xd/", 0o700, 7, 8)
	xd.hdr.PAXRecords = map[string]string{"SCHILY.xattr.user.dir": "d"}
	dev := tarNode("null", tar.TypeChar, 0o666, "")
	dev.hdr.Devmajor, dev.hdr.Devminor = 1, 3
	blk := tarNode("loop9", tar.TypeBlock, 0o660, "")
	blk.hdr.Devmajor, blk.hdr.Devminor = 7, 9
	setuid := file("x/setuid", 0o4755, 0, 0, []byte("#!/bin/sh\n"))
	l1 := layerTar(t, []member{
		dir("./", 0o755, 0, 0),
		dir("etc/", 0o750, 5, 6),
		file("etc/passwd", 0o644, 0, 0, []byte("root:x:0:0::/root:/bin/sh\n")),
		dir("d/", 0o755, 0, 0),
		file("d/keep", 0o640, 1000, 1000, []byte("kept\n")),
		file("d/gone", 0o644, 0, 0, []byte("whited out\n")),
		dir("od/", 0o711, 0, 0),
		file("od/old", 0o644, 0, 0, []byte("hidden by opaque\n")),
		file("big", 0o755, 0, 0, im.big),
		dir("x/", 0o755, 0, 0),
		setuid,
		xa, xd,
		tarNode("fifo", tar.TypeFifo, 0o600, ""),
		dev, blk,
		file("hl1", 0o600, 3, 4, []byte("linked\n")),
		tarNode("hl2", tar.TypeLink, 0, "hl1"),
		tarNode("abs", tar.TypeSymlink, 0o777, "/etc/passwd"),
		tarNode("rel", tar.TypeSymlink, 0o777, "../../x"),
		tarNode("esc", tar.TypeSymlink, 0o777, im.outside),
		file("empty", 0o644, 0, 0, nil),
	})
	l2 := layerTar(t, []member{
		tarNode("d/.wh.gone", tar.TypeReg, 0o644, ""),
		dir("od/", 0o755, 0, 0),
		tarNode("od/.wh..wh..opq", tar.TypeReg, 0o644, ""),
		file("od/new", 0o644, 0, 0, []byte("new\n")),
		file("etc/newfile", 0o600, 0, 0, []byte("implied parent\n")),
		tarNode("lowerlink", tar.TypeLink, 0, "d/keep"),
		tarNode("lowerlink2", tar.TypeLink, 0, "d/keep"),
		file("impl/sub/f", 0o644, 0, 0, []byte("deep\n")),
		dir("esc/", 0o755, 0, 0),
		file("esc/f", 0o644, 0, 0, []byte("must stay in the layer\n")),
		tarNode("sym2", tar.TypeSymlink, 0o777, "../../../../../etc/shadow"),
	})
	im.layers = [][]byte{l1, l2}
	oci := t.TempDir()
	registrytest.WriteOCI(t, oci, "v1", l1, l2)
	reg.Push(t, oci, "v1", "layerdir/img:v1")
	ref, err := registry.ParseReference(reg.Addr + "/layerdir/img:v1")
	if err != nil {
		t.Fatal(err)
	}
	client := registry.New(registry.Options{ConfigPath: reg.HostsDir(t, "")})
	m, desc, err := client.ImageManifest(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range m.Layers {
		im.digests = append(im.digests, l.Digest)
	}
	ref.Tag, ref.Digest = "", desc.Digest
	im.ref = ref.String()
	return im
}

// node is one node's kata-fsx configuration and state.
type nodeEnv struct {
	config string
	state  string
}

func newNode(t *testing.T, im *image) nodeEnv {
	t.Helper()
	d := t.TempDir()
	n := nodeEnv{config: filepath.Join(d, "configuration.toml"), state: filepath.Join(d, "state")}
	cfg := fmt.Sprintf("[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nstate_dir = %q\n[kata_fsx.registry]\nconfig_path = %q\nread_timeout = 5\n",
		n.state, im.reg.HostsDir(t, ""))
	if err := os.WriteFile(n.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return n
}

// snapshot makes a snapshot directory as the snapshotter commits a remote
// layer: an empty fs directory and the sidecar. It returns the fs path.
func snapshot(t *testing.T, root string, id int, r Remote) string {
	t.Helper()
	snap := filepath.Join(root, "snapshots", fmt.Sprint(id))
	if err := os.MkdirAll(filepath.Join(snap, "fs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := WriteRemote(snap, r); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(snap, "fs")
}

// snapshots makes one snapshot per layer of im; top first, as lowerdir
// lists them.
func snapshots(t *testing.T, im *image, n nodeEnv) (root string, lowers []string) {
	t.Helper()
	root = t.TempDir()
	for i := len(im.digests) - 1; i >= 0; i-- {
		lowers = append(lowers, snapshot(t, root, i+1, Remote{Ref: im.ref, Layer: im.digests[i], Config: n.config}))
	}
	return root, lowers
}

// logBuf records what the code under test logged.
type logBuf = logtest.Lines

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestMaterialize(t *testing.T) {
	testenv.Root(t, "writing owners, devices and trusted xattrs")
	im := pushImage(t)
	n := newNode(t, im)
	_, lowers := snapshots(t, im, n)
	ctx := testCtx(t)
	var logs logBuf
	for _, l := range lowers {
		if err := Materialize(ctx, l, logs.Logf); err != nil {
			t.Fatal(err)
		}
		if !Materialized(l) {
			t.Fatalf("%s: no marker after Materialize", l)
		}
	}
	if !strings.Contains(logs.String(), "materialized 6.0 MiB of 6.0 MiB") {
		t.Errorf("no final progress line for the 6 MiB layer:\n%s", logs.String())
	}
	l2, l1 := lowers[0], lowers[1]
	compareLayer(t, l1, im.layers[0], nil)
	compareLayer(t, l2, im.layers[1], map[string][]byte{"lowerlink": []byte("kept\n"), "lowerlink2": []byte("kept\n")})

	// Implied directories: etc keeps the lower layer's metadata, impl and
	// impl/sub are fresh.
	checkMeta(t, filepath.Join(l2, "etc"), fs.ModeDir|0o750, 5, 6)
	checkMeta(t, filepath.Join(l2, "impl"), fs.ModeDir|0o755, 0, 0)
	checkMeta(t, filepath.Join(l2, "impl/sub"), fs.ModeDir|0o755, 0, 0)
	// Two links to one lower file are one copy.
	if ino(t, filepath.Join(l2, "lowerlink")) != ino(t, filepath.Join(l2, "lowerlink2")) {
		t.Error("lowerlink and lowerlink2 are not one inode")
	}
	checkMeta(t, filepath.Join(l2, "lowerlink"), 0o640, 1000, 1000)
	// The symlink to a host directory was written, never followed.
	if ents, _ := os.ReadDir(im.outside); len(ents) != 0 {
		t.Fatalf("%s (a symlink's target) got %d entries", im.outside, len(ents))
	}
	for _, l := range lowers {
		snap := filepath.Dir(l)
		for _, n := range []string{stageName, trashName, pendingName} {
			if _, err := os.Lstat(filepath.Join(snap, n)); err == nil {
				t.Errorf("%s left in %s", n, snap)
			}
		}
	}

	// Again: marked, nothing to do, nothing fetched.
	var again logBuf
	if err := Materialize(ctx, l1, again.Logf); err != nil || again.String() != "" {
		t.Fatalf("second Materialize: %v, logs %q", err, again.String())
	}

	// Another snapshot of the same layer on this node needs no registry:
	// the indexes and the chunks are in the node's store, shared.
	im.reg.Stop()
	other := snapshot(t, t.TempDir(), 3, Remote{Ref: im.ref, Layer: im.digests[0], Config: n.config})
	if err := Materialize(ctx, other, nil); err != nil {
		t.Fatalf("from the node's store alone: %v", err)
	}
	compareLayer(t, other, im.layers[0], nil)
}

// compareLayer checks every entry of the layer tar against the directory
// written from it; lowerCopies are the contents of hard links into lower
// layers.
func compareLayer(t *testing.T, root string, layer []byte, lowerCopies map[string][]byte) {
	t.Helper()
	seen := map[string]bool{".": true}
	tr := tar.NewReader(bytes.NewReader(layer))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		name := path.Clean(h.Name)
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			seen[d] = true
		}
		base, parent := path.Base(name), path.Dir(name)
		if base == ".wh..wh..opq" {
			if v := getxattr(t, filepath.Join(root, parent), "trusted.overlay.opaque"); v != "y" {
				t.Errorf("%s: opaque marker %q, want y", parent, v)
			}
			continue
		}
		if w, ok := strings.CutPrefix(base, ".wh."); ok {
			name = path.Join(parent, w)
			seen[name] = true
			st := lstat(t, filepath.Join(root, name))
			if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
				t.Errorf("%s: whiteout is mode %#o rdev %d, want a char device 0:0", name, st.Mode, st.Rdev)
			}
			continue
		}
		seen[name] = true
		p := filepath.Join(root, name)
		st := lstat(t, p)
		want := map[byte]uint32{tar.TypeDir: unix.S_IFDIR, tar.TypeReg: unix.S_IFREG, tar.TypeSymlink: unix.S_IFLNK,
			tar.TypeLink: unix.S_IFREG, tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[h.Typeflag]
		if st.Mode&unix.S_IFMT != want {
			t.Errorf("%s: type %#o, want %#o", name, st.Mode&unix.S_IFMT, want)
			continue
		}
		if h.Typeflag == tar.TypeLink {
			if c, ok := lowerCopies[name]; ok {
				if got := readFile(t, p); !bytes.Equal(got, c) {
					t.Errorf("%s: copy of lower %s holds %q", name, h.Linkname, got)
				}
			} else if ino(t, p) != ino(t, filepath.Join(root, h.Linkname)) {
				t.Errorf("%s: not a hard link of %s", name, h.Linkname)
			}
			continue
		}
		if h.Typeflag != tar.TypeSymlink && st.Mode&07777 != uint32(h.Mode) {
			t.Errorf("%s: mode %#o, want %#o", name, st.Mode&07777, h.Mode)
		}
		if int(st.Uid) != h.Uid || int(st.Gid) != h.Gid {
			t.Errorf("%s: owner %d:%d, want %d:%d", name, st.Uid, st.Gid, h.Uid, h.Gid)
		}
		if h.Typeflag != tar.TypeDir && st.Mtim.Sec != h.ModTime.Unix() {
			t.Errorf("%s: mtime %d, want %d", name, st.Mtim.Sec, h.ModTime.Unix())
		}
		switch h.Typeflag {
		case tar.TypeReg:
			data, _ := io.ReadAll(tr)
			got := readFile(t, p)
			if st.Size != h.Size || sha256.Sum256(got) != sha256.Sum256(data) {
				t.Errorf("%s: %d bytes (sha256 %x), want %d (%x)", name, st.Size, sha256.Sum256(got), h.Size, sha256.Sum256(data))
			}
		case tar.TypeSymlink:
			if got, err := os.Readlink(p); err != nil || got != h.Linkname {
				t.Errorf("%s: link %q (%v), want %q", name, got, err, h.Linkname)
			}
		case tar.TypeChar, tar.TypeBlock:
			if unix.Major(st.Rdev) != uint32(h.Devmajor) || unix.Minor(st.Rdev) != uint32(h.Devminor) {
				t.Errorf("%s: device %d:%d, want %d:%d", name, unix.Major(st.Rdev), unix.Minor(st.Rdev), h.Devmajor, h.Devminor)
			}
		case tar.TypeDir:
			// Directory mtimes are set after their entries are written.
			if st.Mtim.Sec != h.ModTime.Unix() {
				t.Errorf("%s: mtime %d, want %d", name, st.Mtim.Sec, h.ModTime.Unix())
			}
		}
		for k, v := range h.PAXRecords {
			if x, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
				if got := getxattr(t, p, x); got != v {
					t.Errorf("%s: xattr %s = %q, want %q", name, x, got, v)
				}
			}
		}
	}
	// Nothing else is in the directory.
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if !seen[filepath.ToSlash(rel)] {
			t.Errorf("%s: not in the layer", rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func lstat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

func ino(t *testing.T, p string) uint64 { return lstat(t, p).Ino }

func checkMeta(t *testing.T, p string, mode fs.FileMode, uid, gid uint32) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	st := lstat(t, p)
	if fi.Mode() != mode || st.Uid != uid || st.Gid != gid {
		t.Errorf("%s: %v %d:%d, want %v %d:%d", p, fi.Mode(), st.Uid, st.Gid, mode, uid, gid)
	}
}

func readFile(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func getxattr(t *testing.T, p, name string) string {
	t.Helper()
	b := make([]byte, 1024)
	n, err := unix.Lgetxattr(p, name, b)
	if err != nil {
		t.Errorf("%s: xattr %s: %v", p, name, err)
		return ""
	}
	return string(b[:n])
}

// helperPath puts the test binary on PATH as the mount helper.
func helperPath(t *testing.T) {
	t.Helper()
	testenv.Tool(t, "mount.fuse3", "fuse3")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	if err := os.Symlink(exe, filepath.Join(bin, HelperName)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
}

func mountFuse3(t *testing.T, source, target string, opts ...string) {
	t.Helper()
	args := []string{source, target}
	for _, o := range opts {
		args = append(args, "-o", o)
	}
	args = append(args, "-t", HelperName)
	if out, err := exec.Command("mount.fuse3", args...).CombinedOutput(); err != nil {
		t.Fatalf("mount.fuse3 %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
}

// TestHelperOverlay mounts the image's two remote layers as containerd
// would, through mount.fuse3 and the helper.
func TestHelperOverlay(t *testing.T) {
	testenv.Root(t, "overlay mounts")
	helperPath(t)
	im := pushImage(t)
	n := newNode(t, im)
	root, lowers := snapshots(t, im, n)
	up, work, target := filepath.Join(root, "upper"), filepath.Join(root, "work"), filepath.Join(root, "merged")
	for _, d := range []string{up, work, target} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// containerd passes options one -o each; mount.fuse3 adds its own.
	mountFuse3(t, "overlay", target, "index=off", "lowerdir="+strings.Join(lowers, ":")+",upperdir="+up+",workdir="+work, "nodev")
	for _, l := range lowers {
		if !Materialized(l) {
			t.Errorf("%s not materialized by the mount", l)
		}
	}
	for _, gone := range []string{"d/gone", "od/old"} {
		if _, err := os.Lstat(filepath.Join(target, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s in the merged tree: %v", gone, err)
		}
	}
	for name, want := range map[string][]byte{"od/new": []byte("new\n"), "d/keep": []byte("kept\n"), "lowerlink": []byte("kept\n"),
		"big": im.big, "etc/passwd": []byte("root:x:0:0::/root:/bin/sh\n"), "esc/f": []byte("must stay in the layer\n")} {
		if got := readFile(t, filepath.Join(target, name)); !bytes.Equal(got, want) {
			t.Errorf("%s in the merged tree: %d bytes, want %d", name, len(got), len(want))
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil || st.Type != unix.OVERLAYFS_SUPER_MAGIC {
		t.Fatalf("%s: file system %#x (%v), want overlayfs", target, st.Type, err)
	}
	if st.Flags&unix.ST_NODEV == 0 {
		t.Error("nodev was not applied")
	}
	if err := unix.Unmount(target, 0); err != nil {
		t.Fatal(err)
	}

	// A single layer's view: a read-only bind mount.
	view := filepath.Join(root, "view")
	if err := os.Mkdir(view, 0o755); err != nil {
		t.Fatal(err)
	}
	mountFuse3(t, lowers[1], view, "bind", "ro")
	if got := readFile(t, filepath.Join(view, "d/gone")); string(got) != "whited out\n" {
		t.Errorf("bind view: d/gone holds %q", got)
	}
	if err := os.WriteFile(filepath.Join(view, "new"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write into the ro bind view: %v, want EROFS", err)
	}
}

// TestHelperErrors: a failing mount exits non-zero naming the layer.
func TestHelperErrors(t *testing.T) {
	testenv.Root(t, "overlay mounts")
	helperPath(t)
	root := t.TempDir()
	lower := snapshot(t, root, 1, Remote{Ref: "127.0.0.1:1/no/such@" + digest.FromString("m").String(), Layer: digest.FromString("l"),
		Config: filepath.Join(root, "missing.toml")})
	target := filepath.Join(root, "t")
	os.Mkdir(target, 0o755)
	out, err := exec.Command("mount.fuse3", "overlay", target, "-o", "lowerdir="+lower+",upperdir=/u,workdir=/w", "-t", HelperName).CombinedOutput()
	if err == nil {
		unix.Unmount(target, unix.MNT_DETACH)
		t.Fatal("mount of a layer with a missing configuration succeeded")
	}
	t.Logf("helper output:\n%s", out)
	for _, want := range []string{lower, "missing.toml", "configuration"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("error output lacks %q:\n%s", want, out)
		}
	}
	if Materialized(lower) {
		t.Error("marker written")
	}
	out, err = exec.Command("mount.fuse3", "overlay", target, "-o", "uidmap=0:1000:1,lowerdir=/a", "-t", HelperName).CombinedOutput()
	if err == nil || !bytes.Contains(out, []byte("idmapped")) {
		t.Errorf("uidmap: %v\n%s", err, out)
	}
}

// TestConcurrent: two processes materialize one layer at once; the second
// waits for the first and finds its result.
func TestConcurrent(t *testing.T) {
	testenv.Root(t, "writing owners, devices and trusted xattrs")
	im := pushImage(t)
	n := newNode(t, im)
	_, lowers := snapshots(t, im, n)
	l1 := lowers[1]
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func() (*exec.Cmd, *bufio.Scanner, *bytes.Buffer) {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), envChildLower+"="+l1, envChildMode+"=slow")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd, bufio.NewScanner(out), &stderr
	}
	a, aout, _ := start()
	// The first holds the lock once it starts writing.
	var alog []string
	for aout.Scan() {
		alog = append(alog, aout.Text())
		if strings.Contains(aout.Text(), "materializing") {
			break
		}
	}
	b, bout, _ := start()
	var blog []string
	for bout.Scan() {
		blog = append(blog, bout.Text())
	}
	for aout.Scan() {
		alog = append(alog, aout.Text())
	}
	if err := a.Wait(); err != nil {
		t.Fatalf("first: %v\n%s", err, strings.Join(alog, "\n"))
	}
	if err := b.Wait(); err != nil {
		t.Fatalf("second: %v\n%s", err, strings.Join(blog, "\n"))
	}
	bl := strings.Join(blog, "\n")
	if !strings.Contains(bl, "another process is materializing it") || strings.Contains(bl, " entries, ") || !strings.Contains(bl, "DONE") {
		t.Errorf("the second did not wait for the first's result:\n%s", bl)
	}
	compareLayer(t, l1, im.layers[0], nil)
}

// TestKilled: a run killed mid-way leaves no marker; the next redoes it.
func TestKilled(t *testing.T) {
	testenv.Root(t, "writing owners, devices and trusted xattrs")
	im := pushImage(t)
	n := newNode(t, im)
	_, lowers := snapshots(t, im, n)
	l1 := lowers[1]
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), envChildLower+"="+l1, envChildMode+"=hang")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if sc.Text() == "HANGING" {
			break
		}
	}
	if len(lines) == 0 || lines[len(lines)-1] != "HANGING" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("the child never stopped mid-way:\n%s", strings.Join(lines, "\n"))
	}
	cmd.Process.Kill()
	cmd.Wait()
	snap := filepath.Dir(l1)
	if Materialized(l1) {
		t.Fatal("a killed run left the marker")
	}
	if _, err := os.Stat(filepath.Join(snap, stageName)); err != nil {
		t.Fatalf("the killed run's stage is not there to clear: %v", err)
	}
	if ents, _ := os.ReadDir(l1); len(ents) != 0 {
		t.Fatalf("the fs directory got %d entries from a killed run", len(ents))
	}
	if err := Materialize(testCtx(t), l1, nil); err != nil {
		t.Fatal(err)
	}
	compareLayer(t, l1, im.layers[0], nil)
	if _, err := os.Stat(filepath.Join(snap, stageName)); err == nil {
		t.Fatal("stage left after the retry")
	}

	// Killed between the swap and the marker: the tree is redone.
	if err := os.Remove(filepath.Join(snap, MarkerName)); err != nil {
		t.Fatal(err)
	}
	if err := Materialize(testCtx(t), l1, nil); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("a full fs directory without marker or pending note: %v, want a refusal", err)
	}
	if err := os.WriteFile(filepath.Join(snap, pendingName), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var logs logBuf
	if err := Materialize(testCtx(t), l1, logs.Logf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "interrupted materialization") {
		t.Errorf("no word of the interrupted tree:\n%s", logs.String())
	}
	compareLayer(t, l1, im.layers[0], nil)
}

// TestRegistryGone: a registry lost mid-way fails the run cleanly.
func TestRegistryGone(t *testing.T) {
	testenv.Root(t, "writing owners, devices and trusted xattrs")
	im := pushImage(t)
	n := newNode(t, im)
	_, lowers := snapshots(t, im, n)
	// The image resolves (indexes in the node cache), then the registry
	// dies before a byte of file data is read.
	c, err := config.LoadFile(n.config)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := registry.ParseReference(im.ref)
	if _, err := lazyimage.Resolve(testCtx(t), lazyroot.ImageOptions(node.LazyRootOptions(c, nil)), ref); err != nil {
		t.Fatal(err)
	}
	im.reg.Stop()
	err = Materialize(testCtx(t), lowers[1], nil)
	if err == nil {
		t.Fatal("materialized with no registry")
	}
	t.Logf("no registry: %v", err)
	if !strings.Contains(err.Error(), lowers[1]) || !strings.Contains(err.Error(), im.digests[0].String()) {
		t.Errorf("error does not name the layer: %v", err)
	}
	snap := filepath.Dir(lowers[1])
	if Materialized(lowers[1]) {
		t.Fatal("marker written")
	}
	if _, err := os.Stat(filepath.Join(snap, stageName)); err == nil {
		t.Fatal("stage left behind")
	}
	im.reg.Start()
	if err := Materialize(testCtx(t), lowers[1], nil); err != nil {
		t.Fatal(err)
	}
	compareLayer(t, lowers[1], im.layers[0], nil)
}

// TestHostile: sidecars that name no layer of the image, a bad digest, a
// missing configuration: clear errors, nothing written.
func TestHostile(t *testing.T) {
	im := pushImage(t)
	n := newNode(t, im)
	ctx := testCtx(t)
	for _, c := range []struct {
		name    string
		sidecar string
		want    string
	}{
		{"layer not in image", fmt.Sprintf(`{"ref":%q,"layer":%q,"config":%q}`, im.ref, digest.FromString("other"), n.config), "has no layer"},
		{"bad digest", fmt.Sprintf(`{"ref":%q,"layer":"sha256:zz","config":%q}`, im.ref, n.config), "both must be set"},
		{"missing config", fmt.Sprintf(`{"ref":%q,"layer":%q,"config":"/nonexistent/kata.toml"}`, im.ref, im.digests[0]), "/nonexistent/kata.toml"},
		{"bad ref", fmt.Sprintf(`{"ref":"UPPER/../x","layer":%q,"config":%q}`, im.digests[0], n.config), "UPPER/../x"},
		{"not json", `{"ref":`, SidecarName},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			snap := filepath.Join(root, "snap")
			lower := filepath.Join(snap, "fs")
			if err := os.MkdirAll(lower, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(snap, SidecarName), []byte(c.sidecar), 0o600); err != nil {
				t.Fatal(err)
			}
			before := listing(t, root)
			err := Materialize(ctx, lower, nil)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Materialize: %v, want an error with %q", err, c.want)
			}
			t.Logf("%v", err)
			after := listing(t, root)
			delete(after, "snap/"+lockName)
			if fmt.Sprint(before) != fmt.Sprint(after) {
				t.Errorf("files changed:\nbefore %v\nafter  %v", before, after)
			}
		})
	}
	// Not a remote layer; not absolute.
	plain := t.TempDir()
	if err := Materialize(ctx, plain, nil); err == nil || !strings.Contains(err.Error(), "not a remote layer") {
		t.Errorf("plain directory: %v", err)
	}
	if err := Materialize(ctx, "rel/fs", nil); err == nil || !strings.Contains(err.Error(), "absolute") {
		t.Errorf("relative path: %v", err)
	}
}

func listing(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, _ := d.Info()
		out[rel] = fmt.Sprint(fi.Mode(), fi.Size())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestParseOptions(t *testing.T) {
	s, err := parseOptions([]string{"index=off", `lowerdir=/a/fs:/b\:c/fs,upperdir=/u,workdir=/w,nodev,dev,suid,ro,noauto,x-foo=1,rprivate,weird`})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(s.lowers) != "[/a/fs /b:c/fs]" || s.flags != unix.MS_RDONLY || s.pflags != unix.MS_PRIVATE|unix.MS_REC ||
		strings.Join(s.data, ",") != `index=off,lowerdir=/a/fs:/b\:c/fs,upperdir=/u,workdir=/w` || fmt.Sprint(s.dropped) != "[weird]" {
		t.Fatalf("parsed %+v", s)
	}
	for _, c := range []struct{ opts, want string }{
		{"upperdir=/u", "no lowerdir"},
		{"lowerdir=", "without directories"},
		{"lowerdir=/a::/b", "empty lower"},
		{"lowerdir=/a,lowerdir=/b", "twice"},
		{"bind,lowerdir=/a", "bind mount"},
		{"lowerdir=/a,gidmap=0:1:1", "idmapped"},
		{"lowerdir=/a,loop", "loop"},
	} {
		if _, err := parseOptions([]string{c.opts}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.opts, err, c.want)
		}
	}
}

func TestParseArgs(t *testing.T) {
	// The form mount.fuse3 3.14 runs the helper with.
	a, err := parseArgs([]string{"/usr/bin/" + HelperName, "overlay", "/t", "-o", "lowerdir=/a,dev,suid"})
	if err != nil || a.source != "overlay" || a.target != "/t" || fmt.Sprint(a.options) != "[lowerdir=/a,dev,suid]" {
		t.Fatalf("%+v %v", a, err)
	}
	for _, bad := range [][]string{{HelperName}, {HelperName, "overlay"}, {HelperName, "", "/t"}, {HelperName, "s", "/t", "-o"}, {HelperName, "s", "/t", "-x"}} {
		if _, err := parseArgs(bad); err == nil || !strings.Contains(err.Error(), "usage") {
			t.Errorf("%q: %v", bad, err)
		}
	}
	var stderr bytes.Buffer
	if code := helperMain([]string{HelperName}, &stderr); code != 2 || !strings.Contains(stderr.String(), "usage") {
		t.Errorf("exit %d, stderr %q", code, stderr.String())
	}
}

// TestCompact: lowerdir options over a page are mounted relative to the
// layers' common parent, as containerd does for its own overlay mounts
// (but not for a helper's).
func TestCompact(t *testing.T) {
	testenv.Root(t, "overlay mounts")
	root := t.TempDir()
	base := filepath.Join(root, strings.Repeat("long-snapshot-root-", 8), "snapshots")
	var lowers []string
	for i := 0; i < 60; i++ {
		d := filepath.Join(base, fmt.Sprint(1000+i), "fs")
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, fmt.Sprint("f", i)), []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
		lowers = append(lowers, d)
	}
	opts := "lowerdir=" + strings.Join(lowers, ":")
	if len(opts) <= maxData {
		t.Fatalf("options of %d bytes do not need compacting", len(opts))
	}
	target := filepath.Join(root, "m")
	os.Mkdir(target, 0o755)
	// Through mount.fuse3, which passes the options whole.
	helperPath(t)
	mountFuse3(t, "overlay", target, opts, "ro")
	ents, err := os.ReadDir(target)
	if err != nil || len(ents) != 60 {
		t.Fatalf("merged tree has %d entries (%v), want 60", len(ents), err)
	}
	// Without a common parent it fails, saying why.
	var scattered []string
	for i := 0; i < 300; i++ {
		scattered = append(scattered, fmt.Sprintf("/%s%d/fs", strings.Repeat("x", 10), i))
	}
	err = Mount(testCtx(t), "overlay", target, []string{"lowerdir=" + strings.Join(scattered, ":")}, nil)
	if err == nil || !strings.Contains(err.Error(), "exceed the kernel's page") {
		t.Fatalf("scattered lowerdirs: %v", err)
	}
}

func FuzzParseArgs(f *testing.F) {
	f.Add("kata-fsx-overlay\x00overlay\x00/t\x00-o\x00lowerdir=/a:/b,upperdir=/u,workdir=/w,dev,suid")
	f.Add("kata-fsx-overlay\x00/src\x00/t\x00-o\x00bind,ro,dev,suid")
	f.Add(`h` + "\x00s\x00t\x00-o\x00" + `lowerdir=/a\:b\,c,x-y,uidmap=1,rprivate`)
	f.Fuzz(func(t *testing.T, in string) {
		a, err := parseArgs(strings.Split(in, "\x00"))
		if err != nil {
			return
		}
		s, err := parseOptions(a.options)
		if err != nil {
			return
		}
		if !s.bind && len(s.lowers) == 0 {
			t.Fatalf("overlay without lower directories: %+v", s)
		}
		for _, l := range s.lowers {
			if l == "" {
				t.Fatalf("empty lower directory from %q", in)
			}
		}
		// The kept options parse to themselves.
		again, err := parseOptions([]string{strings.Join(s.data, ",")})
		if !s.bind && (err != nil || fmt.Sprint(again.data) != fmt.Sprint(s.data) || fmt.Sprint(again.lowers) != fmt.Sprint(s.lowers)) {
			t.Fatalf("options %q reparse to %+v, %v (from %+v)", s.data, again, err, s)
		}
	})
}

// TestOpenBeneath: a hard link's target directory is reached without
// following a symlink, with openat2 and without.
func TestOpenBeneath(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "a/b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(root, "a/link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..", filepath.Join(root, "a/up")); err != nil {
		t.Fatal(err)
	}
	rootfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rootfd)
	for name, open := range map[string]func(int, string) (int, error){"openat2": openBeneath, "walk": walkBeneath} {
		fd, err := open(rootfd, "a/b")
		if err != nil {
			t.Fatalf("%s a/b: %v", name, err)
		}
		unix.Close(fd)
		for _, bad := range []string{"a/link", "a/link/x", "a/up", "a/up/a", "a/../..", "a/b/../../.."} {
			if fd, err := open(rootfd, bad); err == nil {
				unix.Close(fd)
				t.Errorf("%s %s: opened", name, bad)
			}
		}
	}
}
