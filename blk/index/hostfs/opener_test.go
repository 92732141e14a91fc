package hostfs

import (
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"golang.org/x/sys/unix"
)

func TestHostOpenerRefusesSymlinks(t *testing.T) {
	root := t.TempDir()
	indextest.Must(t, os.Mkdir(filepath.Join(root, "d"), 0o755))
	indextest.WriteFile(t, filepath.Join(root, "d", "f"), []byte("ok"), 0o644)
	indextest.Must(t, os.Symlink("d", filepath.Join(root, "dl")))
	indextest.Must(t, os.Symlink("d/f", filepath.Join(root, "fl")))
	indextest.Must(t, os.Symlink("/etc/passwd", filepath.Join(root, "esc")))
	src := index.Source{Kind: index.SourceDir, ID: root}
	op := Opener{}
	r, err := op.Open(src, "d/f")
	indextest.Must(t, err)
	r.(io.Closer).Close()
	for _, p := range []string{"dl/f", "fl", "esc", "../etc/passwd", "/etc/passwd", "d", "d/../d/f"} {
		if r, err := op.Open(src, p); err == nil {
			r.(io.Closer).Close()
			t.Errorf("opened %q", p)
		}
	}
	// The fallback walk for kernels without openat2 behaves the same.
	dfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	indextest.Must(t, err)
	defer unix.Close(dfd)
	f, err := openWalk(dfd, "d/f")
	indextest.Must(t, err)
	f.Close()
	for _, p := range []string{"dl/f", "fl", "esc", "../x", "d/./f"} {
		if f, err := openWalk(dfd, p); err == nil {
			f.Close()
			t.Errorf("walk opened %q", p)
		}
	}
	if _, err := op.Open(index.Source{Kind: index.SourceBlob, ID: "sha256:../../etc"}, ""); err == nil {
		t.Error("opened a blob by a bad digest")
	}
}
