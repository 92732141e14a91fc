package ext4

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// An image directory whose files were swapped for a FIFO, a symlink or a
// directory is refused at once by Open, instead of hanging on the FIFO or
// reading through the link.
func TestOpenRefusesNonRegularFiles(t *testing.T) {
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), []byte("data"), 0o644)
	img, err := Build(context.Background(), indexDir(t, src), Options{})
	must(t, err)
	defer img.Close()
	good := t.TempDir()
	must(t, img.WriteTo(good))

	for _, name := range []string{ManifestFile, MapFile, MetaFile} {
		for kind, mk := range map[string]func(p string) error{
			"fifo":      func(p string) error { return syscall.Mkfifo(p, 0o644) },
			"symlink":   func(p string) error { return os.Symlink(filepath.Join(good, name), p) },
			"directory": func(p string) error { return os.Mkdir(p, 0o755) },
		} {
			dir := t.TempDir()
			for _, f := range []string{ManifestFile, MapFile, MetaFile} {
				if f == name {
					must(t, mk(filepath.Join(dir, f)))
					continue
				}
				b, err := os.ReadFile(filepath.Join(good, f))
				must(t, err)
				must(t, os.WriteFile(filepath.Join(dir, f), b, 0o644))
			}
			done := make(chan error, 1)
			go func() {
				img, err := Open(dir)
				if err == nil {
					img.Close()
				}
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), name) {
					t.Errorf("%s as a %s: Open gave %v, want an error naming it", name, kind, err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s as a %s: Open still blocked after 10 s", name, kind)
			}
		}
	}
}
