package hostfs

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// TestHostOpenerRefusesFIFOsWithoutBlocking: a layer file or a cached blob
// replaced by a FIFO (or a device) is refused at once; a plain open would
// wait for a writer forever, in the thread serving the guest's reads.
func TestHostOpenerRefusesFIFOsWithoutBlocking(t *testing.T) {
	root, cache := t.TempDir(), t.TempDir()
	indextest.Must(t, unix.Mkfifo(filepath.Join(root, "fifo"), 0o644))
	blob, err := index.BlobPath(cache, "sha256:"+strings.Repeat("ab", 32))
	indextest.Must(t, err)
	indextest.Must(t, os.MkdirAll(filepath.Dir(blob), 0o755))
	indextest.Must(t, unix.Mkfifo(blob, 0o644))
	dfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	indextest.Must(t, err)
	defer unix.Close(dfd)
	devfd, err := unix.Open("/dev", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	indextest.Must(t, err)
	defer unix.Close(devfd)
	op := Opener{CacheDir: cache}
	for name, open := range map[string]func() (io.Closer, error){
		"dir source": func() (io.Closer, error) {
			r, err := op.Open(index.Source{Kind: index.SourceDir, ID: root}, "fifo")
			c, _ := r.(io.Closer)
			return c, err
		},
		"blob": func() (io.Closer, error) {
			r, err := op.Open(index.Source{Kind: index.SourceBlob, ID: "sha256:" + strings.Repeat("ab", 32)}, "")
			c, _ := r.(io.Closer)
			return c, err
		},
		"fallback walk": func() (io.Closer, error) { return openWalk(dfd, "fifo") },
		"device":        func() (io.Closer, error) { return OpenBeneath(devfd, "null") },
	} {
		done := make(chan error, 1)
		go func() {
			c, err := open()
			if err == nil {
				c.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			var nr *NotRegularError
			if !errors.As(err, &nr) || !errors.Is(err, index.ErrInvalid) {
				t.Errorf("%s: got %v, want a NotRegularError", name, err)
			}
		case <-time.After(10 * time.Second):
			for _, p := range []string{filepath.Join(root, "fifo"), blob} {
				if fd, err := unix.Open(p, unix.O_RDWR|unix.O_NONBLOCK, 0); err == nil {
					defer unix.Close(fd)
				}
			}
			t.Fatalf("%s: open blocked on a FIFO", name)
		}
	}
}
