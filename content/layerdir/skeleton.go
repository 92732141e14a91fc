package layerdir

import (
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// A skeleton is what containerd's own short-lived mounts of a snapshot get
// in place of a remote layer: CRI mounts a container's rootfs in a
// temporary directory to read /etc/passwd and /etc/group (the user and its
// groups) and to copy the image's volumes, before the shim ever sees the
// rootfs. Materializing the whole layer for that would fetch every byte of
// the image at container creation and defeat the lazy pull. A skeleton has
// every entry of the layer, and the data of every file up to
// SkeletonMaxFile and of every file under one of the image's volumes; a
// larger file is left out, as a whiteout, so a merged view never shows a
// lower layer's older file in its place: it is absent, never wrong.
const (
	// SkeletonName is the skeleton directory, beside the fs directory.
	SkeletonName = "kata-fsx-skeleton"
	// SkeletonMarkerName marks a complete skeleton.
	SkeletonMarkerName = "kata-fsx-skeleton-done"
	// SkeletonMaxFile is the largest file a skeleton holds outside volumes.
	SkeletonMaxFile = 1 << 20

	skeletonStageName = SkeletonName + ".stage"
)

// tempMountDir is the directory containerd (1.6 to 2.x) makes its
// temporary mounts in, under its root: <root>/tmpmounts/containerd-mountN.
const tempMountDir = "tmpmounts"

// isTempMount reports whether target is one of containerd's temporary
// mounts.
func isTempMount(target string) bool {
	t := filepath.Clean(target)
	return filepath.Base(filepath.Dir(t)) == tempMountDir && strings.HasPrefix(filepath.Base(t), "containerd-mount")
}

// MaterializeSkeleton writes the skeleton of the remote layer whose fs
// directory is lower (once; later calls find it) and returns its path.
func MaterializeSkeleton(ctx context.Context, lower string, logf func(format string, args ...any)) (string, error) {
	if err := writeTree(ctx, lower, logf, true); err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(filepath.Clean(lower)), SkeletonName), nil
}

// prepareSkeleton clears what an interrupted skeleton left and reads the
// image's volumes once the image is known (resolve runs after it).
func (m *materializer) prepareSkeleton() error {
	for _, n := range []string{skeletonStageName, SkeletonName} {
		if err := os.RemoveAll(filepath.Join(m.snap, n)); err != nil {
			return fmt.Errorf("remove what an interrupted skeleton left: %w", err)
		}
	}
	return nil
}

// leaveOut reports whether a skeleton leaves out the file at p of size n.
func (m *materializer) leaveOut(p string, n int64) bool {
	if !m.skeleton || n <= SkeletonMaxFile {
		return false
	}
	if m.volumes == nil && m.img != nil {
		m.volumes = []string{}
		for v := range m.img.Config.Config.Volumes {
			c := strings.TrimPrefix(path.Clean("/"+v), "/")
			if c == "" {
				c = "."
			}
			m.volumes = append(m.volumes, c)
		}
	}
	for _, v := range m.volumes {
		if v == "." || p == v || strings.HasPrefix(p, v+"/") {
			return false
		}
	}
	return true
}

// writeLeftOut writes a left-out file as a whiteout.
func (m *materializer) writeLeftOut(pfd int, name, p string) error {
	m.left++
	return m.writeNode(pfd, name, &index.Entry{Path: p, Type: index.TypeChar})
}
