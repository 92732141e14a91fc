package layerdir

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/registry"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestIsTempMount(t *testing.T) {
	for p, want := range map[string]bool{
		"/var/lib/containerd/tmpmounts/containerd-mount123":               true,
		"/tmp/x/root/tmpmounts/containerd-mount9/":                        true,
		"/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/rootfs": false,
		"/var/lib/containerd/tmpmounts/other":                             false,
		"/tmpmounts":                                                      false,
	} {
		if got := isTempMount(p); got != want {
			t.Errorf("isTempMount(%q) = %v, want %v", p, got, want)
		}
	}
}

// TestSkeletonTempMount: containerd's temporary mount of a rootfs (where
// CRI reads /etc/passwd and /etc/group) gets skeletons: every small file
// with its data, the 6 MiB file absent rather than fetched, and the
// layers themselves stay remote; a mount elsewhere then materializes them.
func TestSkeletonTempMount(t *testing.T) {
	testenv.Root(t, "overlay mounts")
	helperPath(t)
	im := pushImage(t)
	// The index artifact, so that the node's resolve fetches no layer data
	// and the store holds only what the mounts read.
	opts := lazyimage.Options{Client: registry.New(registry.Options{ConfigPath: im.reg.HostsDir(t, "")})}
	ref, err := registry.ParseReference(im.ref)
	if err != nil {
		t.Fatal(err)
	}
	built, err := lazyimage.Build(testCtx(t), opts, ref)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lazyimage.Push(testCtx(t), opts, built); err != nil {
		t.Fatal(err)
	}
	n := newNode(t, im)
	root, lowers := snapshots(t, im, n)
	up, work := filepath.Join(root, "upper"), filepath.Join(root, "work")
	tmp := filepath.Join(root, "tmpmounts", "containerd-mount42")
	for _, d := range []string{up, work, tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mountFuse3(t, "overlay", tmp, "index=off", "lowerdir="+strings.Join(lowers, ":")+",upperdir="+up+",workdir="+work)
	for _, l := range lowers {
		if Materialized(l) {
			t.Errorf("%s materialized by containerd's temporary mount", l)
		}
		if _, err := os.Stat(filepath.Join(filepath.Dir(l), SkeletonMarkerName)); err != nil {
			t.Errorf("%s: no skeleton marker: %v", l, err)
		}
	}
	if got := readFile(t, filepath.Join(tmp, "etc/passwd")); string(got) != "root:x:0:0::/root:/bin/sh\n" {
		t.Errorf("etc/passwd in the temporary mount: %q", got)
	}
	if got := readFile(t, filepath.Join(tmp, "od/new")); string(got) != "new\n" {
		t.Errorf("od/new in the temporary mount: %q", got)
	}
	for _, gone := range []string{"big", "d/gone", "od/old"} {
		if _, err := os.Lstat(filepath.Join(tmp, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s in the temporary mount: %v, want absent", gone, err)
		}
	}
	if err := unix.Unmount(tmp, 0); err != nil {
		t.Fatal(err)
	}
	// The big file is a whiteout in its layer's skeleton: never fetched
	// for it, never shown as a lower layer's older file.
	if st := lstat(t, filepath.Join(filepath.Dir(lowers[1]), SkeletonName, "big")); st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("big in the skeleton: mode %#o rdev %d, want a whiteout", st.Mode, st.Rdev)
	}

	// The task's mount: the real layers.
	target := filepath.Join(root, "merged")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	mountFuse3(t, "overlay", target, "index=off", "lowerdir="+strings.Join(lowers, ":")+",upperdir="+up+",workdir="+work)
	if got := readFile(t, filepath.Join(target, "big")); !bytes.Equal(got, im.big) {
		t.Errorf("big in the task's mount: %d bytes, want the image's %d", len(got), len(im.big))
	}
	for _, l := range lowers {
		if !Materialized(l) {
			t.Errorf("%s not materialized by the task's mount", l)
		}
	}
}
