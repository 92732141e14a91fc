// Package mount holds what the host shim and the guest agent both need to
// know about Linux mounts: mount(8) option words as mount(2) flags, and
// the mount table, read to keep a recursive remove from crossing into a
// mounted directory.
package mount

import (
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// flagWords maps mount(8) option words to the mount(2) flag each sets or
// clears; words not listed are filesystem data.
var flagWords = map[string]struct {
	clear bool
	flag  uintptr
}{
	"ro": {false, unix.MS_RDONLY}, "rw": {true, unix.MS_RDONLY},
	// rro is ro on the mount itself; RecursiveReadOnly says the caller
	// must also make every submount read-only (mount_setattr).
	"rro":    {false, unix.MS_RDONLY},
	"nosuid": {false, unix.MS_NOSUID}, "suid": {true, unix.MS_NOSUID},
	"nodev": {false, unix.MS_NODEV}, "dev": {true, unix.MS_NODEV},
	"noexec": {false, unix.MS_NOEXEC}, "exec": {true, unix.MS_NOEXEC},
	"sync": {false, unix.MS_SYNCHRONOUS}, "async": {true, unix.MS_SYNCHRONOUS},
	"dirsync": {false, unix.MS_DIRSYNC}, "remount": {false, unix.MS_REMOUNT},
	"bind": {false, unix.MS_BIND}, "rbind": {false, unix.MS_BIND | unix.MS_REC},
	"noatime": {false, unix.MS_NOATIME}, "atime": {true, unix.MS_NOATIME},
	"nodiratime": {false, unix.MS_NODIRATIME}, "diratime": {true, unix.MS_NODIRATIME},
	"relatime": {false, unix.MS_RELATIME}, "norelatime": {true, unix.MS_RELATIME},
	"strictatime": {false, unix.MS_STRICTATIME},
	"private":     {false, unix.MS_PRIVATE}, "rprivate": {false, unix.MS_PRIVATE | unix.MS_REC},
	"shared": {false, unix.MS_SHARED}, "rshared": {false, unix.MS_SHARED | unix.MS_REC},
	"slave": {false, unix.MS_SLAVE}, "rslave": {false, unix.MS_SLAVE | unix.MS_REC},
	"defaults": {false, 0},
}

// ParseOptions splits mount(8)-style options into mount(2) flags and the
// comma-joined filesystem data; a later word overrides an earlier one
// ("ro,rw" is read-write), as mount(8) reads them.
func ParseOptions(opts []string) (flags uintptr, data string) {
	var rest []string
	for _, o := range opts {
		if f, ok := flagWords[o]; ok {
			if f.clear {
				flags &^= f.flag
			} else {
				flags |= f.flag
			}
			continue
		}
		rest = append(rest, o)
	}
	return flags, strings.Join(rest, ",")
}

// ReadOnly reports whether the options make a read-only mount: the last
// of ro, rro and rw decides, as mount(8) reads them.
func ReadOnly(opts []string) bool {
	flags, _ := ParseOptions(opts)
	return flags&unix.MS_RDONLY != 0
}

// RecursiveReadOnly reports whether the options ask for a recursively
// read-only mount: rro is the last of ro, rw and rro, as runc reads it.
func RecursiveReadOnly(opts []string) bool {
	rro := false
	for _, o := range opts {
		switch o {
		case "rro":
			rro = true
		case "ro", "rw":
			rro = false
		}
	}
	return rro
}

// OptionWords lists, sorted, the option words ParseOptions turns into
// mount(2) flags; a runtime's features report names them as the mount
// options it understands.
func OptionWords() []string {
	words := make([]string, 0, len(flagWords))
	for w := range flagWords {
		words = append(words, w)
	}
	sort.Strings(words)
	return words
}
