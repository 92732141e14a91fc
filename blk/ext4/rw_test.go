package ext4

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestReadWriteMount mounts an exported image read-write, as the guest
// will, runs a mixed workload over image files and new ones, and checks
// that the kernel left a filesystem e2fsck still finds clean: free counts,
// bitmaps, uninitialised inode table space and htrees all have to be right
// for that.
func TestReadWriteMount(t *testing.T) {
	testenv.Tool(t, "e2fsck", "e2fsprogs")
	testenv.Root(t, "a loop mount")
	testenv.Tool(t, "mount", "mount")
	src := t.TempDir()
	makeTree(t, src, false)
	idx := indexDir(t, src)
	_, raw := buildExport(t, idx, Options{Time: time.Unix(testTime, 0), WritableSize: 256 << 20}, t.TempDir())
	mnt := t.TempDir()
	if out, err := exec.Command("mount", "-t", "ext4", "-o", "loop", raw, mnt).CombinedOutput(); err != nil {
		t.Fatalf("loop mount: %v: %s", err, out)
	}
	mounted := true
	defer func() {
		if mounted {
			exec.Command("umount", mnt).Run()
		}
	}()
	// New files across many directories, enough to use inode groups the
	// image left untouched.
	for d := 0; d < 40; d++ {
		dir := filepath.Join(mnt, "new", fmt.Sprintf("d%d", d))
		must(t, os.MkdirAll(dir, 0o755))
		for f := 0; f < 200; f++ {
			must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", f)), bytes.Repeat([]byte{byte(f)}, f*37), 0o644))
		}
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20) // 64 MiB
	must(t, os.WriteFile(filepath.Join(mnt, "new", "big"), big, 0o644))
	// Changes to image content: htree inserts, appends, deletes, renames,
	// chown, xattrs.
	for i := 0; i < 2000; i++ {
		must(t, os.WriteFile(filepath.Join(mnt, "wide", fmt.Sprintf("added-%d", i)), nil, 0o644))
	}
	f, err := os.OpenFile(filepath.Join(mnt, "sizes", "f4097"), os.O_APPEND|os.O_WRONLY, 0)
	must(t, err)
	_, err = f.Write(bytes.Repeat([]byte("z"), 100000))
	must(t, err)
	must(t, f.Close())
	must(t, os.Remove(filepath.Join(mnt, "sizes", "f8192")))
	must(t, os.RemoveAll(filepath.Join(mnt, "links", "sub0")))
	must(t, os.Rename(filepath.Join(mnt, "names"), filepath.Join(mnt, "renamed")))
	must(t, filepath.Walk(filepath.Join(mnt, "renamed"), func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, 1234, 5678)
	}))
	must(t, os.WriteFile(filepath.Join(mnt, "sparse", "ext10"), []byte("truncated"), 0o644))
	must(t, os.Remove(filepath.Join(mnt, "sparse", "ext2000")))
	if out, err := exec.Command("sync").CombinedOutput(); err != nil {
		t.Fatalf("sync: %v %s", err, out)
	}
	if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
		t.Fatalf("umount: %v: %s", err, out)
	}
	mounted = false
	fsck(t, raw)
}
