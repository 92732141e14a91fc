package mount

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestParseOptions(t *testing.T) {
	for _, tc := range []struct {
		in        []string
		flags     uintptr
		data      string
		whyItTest string
	}{
		{[]string{"ro", "rbind", "nosuid", "lowerdir=/a:/b", "upperdir=/u", "index=off"},
			unix.MS_RDONLY | unix.MS_BIND | unix.MS_REC | unix.MS_NOSUID, "lowerdir=/a:/b,upperdir=/u,index=off", "containerd's overlay rootfs"},
		{[]string{"ro", "nosuid", "trans=virtio", "rw", "rbind", "version=9p2000.L"},
			unix.MS_NOSUID | unix.MS_BIND | unix.MS_REC, "trans=virtio,version=9p2000.L", "a 9p storage; rw clears an earlier ro"},
		{[]string{"ro", "rw"}, 0, "", "the later word wins"},
		{[]string{"rprivate", "atime", "noatime", "defaults"}, unix.MS_PRIVATE | unix.MS_REC | unix.MS_NOATIME, "", "propagation flags"},
		{nil, 0, "", "no options"},
		{[]string{"rbind", "rro", "rprivate"}, unix.MS_BIND | unix.MS_REC | unix.MS_RDONLY | unix.MS_PRIVATE, "", "CRI's recursive read-only volume"},
	} {
		flags, data := ParseOptions(tc.in)
		if flags != tc.flags || data != tc.data {
			t.Errorf("%s: ParseOptions(%q) = %#x, %q; want %#x, %q", tc.whyItTest, tc.in, flags, data, tc.flags, tc.data)
		}
	}
}

func TestReadOnly(t *testing.T) {
	for _, tc := range []struct {
		in   []string
		want bool
	}{
		{[]string{"rbind", "ro"}, true},
		{[]string{"rbind", "rro"}, true},
		{[]string{"ro", "rw"}, false},
		{[]string{"rw", "ro"}, true},
		{[]string{"rbind"}, false},
	} {
		if got := ReadOnly(tc.in); got != tc.want {
			t.Errorf("ReadOnly(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestRecursiveReadOnly(t *testing.T) {
	for _, tc := range []struct {
		in   []string
		want bool
	}{
		{[]string{"rbind", "rro", "rprivate"}, true},
		{[]string{"rbind", "ro"}, false},
		{[]string{"rro", "rw"}, false},
		{[]string{"rro", "ro"}, false},
		{[]string{"ro", "rro"}, true},
		{nil, false},
	} {
		if got := RecursiveReadOnly(tc.in); got != tc.want {
			t.Errorf("RecursiveReadOnly(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestOptionWordsAreParsed(t *testing.T) {
	words := OptionWords()
	for _, w := range []string{"ro", "rro", "rbind", "nosuid", "rprivate"} {
		if !slices.Contains(words, w) {
			t.Errorf("OptionWords() = %q, lacks %q", words, w)
		}
	}
	for _, w := range words {
		if _, data := ParseOptions([]string{w}); data != "" {
			t.Errorf("OptionWords() lists %q, which ParseOptions passes on as data %q", w, data)
		}
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b`:    "/a b",
		`/plain`:     "/plain",
		`/tab\011x`:  "/tab\tx",
		`/trail\04`:  `/trail\04`, // too short to be an escape
		`/back\134s`: `/back\s`,
	} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestRemoveUnmountedRefusesMounts mounts a tmpfs below a directory (whose
// name needs a mountinfo escape) and checks the remove is refused and the
// file behind the mount survives, then that it goes once unmounted.
func TestRemoveUnmountedRefusesMounts(t *testing.T) {
	testenv.Root(t, "mounting a tmpfs")
	dir := filepath.Join(t.TempDir(), "pod dir")
	mp := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, ""); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	mounted := true
	defer func() {
		if mounted {
			unix.Unmount(mp, unix.MNT_DETACH)
		}
	}()
	keep := filepath.Join(mp, "keep")
	if err := os.WriteFile(keep, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := Under(dir)
	if err != nil || len(got) != 1 || got[0] != mp {
		t.Fatalf("Under(%q) = %q, %v; want [%q]", dir, got, err, mp)
	}
	err = RemoveUnmounted(dir)
	if err == nil || !strings.Contains(err.Error(), "still has mounts") {
		t.Fatalf("RemoveUnmounted with a mount below: %v", err)
	}
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("the file behind the mount is gone: %v", err)
	}
	if err := unix.Unmount(mp, 0); err != nil {
		t.Fatal(err)
	}
	mounted = false
	if err := RemoveUnmounted(dir); err != nil {
		t.Fatalf("RemoveUnmounted after unmount: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("%s still exists: %v", dir, err)
	}
}
