package mount

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// nsGetNSType is linux/nsfs.h's NS_GET_NSTYPE, _IO(0xb7, 0x3), which
// x/sys/unix does not define.
const nsGetNSType = 0xb703

// Namespace is a mount namespace held open by a descriptor, for reading
// host paths as the host sees them from a process that has a mount
// namespace of its own. A nil *Namespace is the caller's own.
type Namespace struct {
	f     *os.File
	inode uint64
}

// NamespaceOf takes f, an open /proc/<pid>/ns/mnt, as a Namespace; it
// refuses anything else.
func NamespaceOf(f *os.File) (*Namespace, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("mount namespace %s: %w", f.Name(), err)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		return nil, fmt.Errorf("mount namespace %s: %w", f.Name(), err)
	}
	if fs.Type != unix.NSFS_MAGIC {
		return nil, fmt.Errorf("mount namespace %s: not a namespace file", f.Name())
	}
	// The namespace's type is checked by setns itself when it is used;
	// asking here keeps a wrong descriptor from surfacing only then.
	kind, err := unix.IoctlRetInt(int(f.Fd()), nsGetNSType)
	if err != nil {
		return nil, fmt.Errorf("mount namespace %s: its type: %w", f.Name(), err)
	}
	if kind != unix.CLONE_NEWNS {
		return nil, fmt.Errorf("mount namespace %s: a namespace of another kind (%#x)", f.Name(), kind)
	}
	return &Namespace{f: f, inode: st.Ino}, nil
}

// OwnNamespace returns the inode of the calling process's mount namespace.
func OwnNamespace() (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &st); err != nil {
		return 0, fmt.Errorf("own mount namespace: %w", err)
	}
	return st.Ino, nil
}

// Inode identifies the namespace (it is what /proc/<pid>/ns/mnt links to).
func (n *Namespace) Inode() uint64 { return n.inode }

// Close releases the namespace's descriptor.
func (n *Namespace) Close() error {
	if n == nil || n.f == nil {
		return nil
	}
	return n.f.Close()
}

// Clone is the package's Clone of path as the namespace sees it: the copy
// is made on a thread that has joined the namespace, so it holds the
// mounts made there since this process left it and keeps their peer
// groups, which propagation from the host needs. A nil n clones in the
// caller's own namespace.
func (n *Namespace) Clone(path string, recursive bool) (*Source, error) {
	if n == nil {
		return Clone(path, recursive)
	}
	type result struct {
		src *Source
		err error
	}
	done := make(chan result, 1)
	go func() {
		// The thread joins another namespace and never leaves it: it stays
		// locked, so the runtime ends it with the goroutine instead of
		// handing it to other goroutines.
		runtime.LockOSThread()
		// setns of a mount namespace needs a filesystem context of the
		// thread's own, not the one it shares with the process.
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			done <- result{err: fmt.Errorf("clone %s in the host's mount namespace: unshare the filesystem context: %w", path, err)}
			return
		}
		if err := unix.Setns(int(n.f.Fd()), unix.CLONE_NEWNS); err != nil {
			done <- result{err: fmt.Errorf("clone %s in the host's mount namespace: join it: %w", path, err)}
			return
		}
		src, err := Clone(path, recursive)
		done <- result{src, err}
	}()
	r := <-done
	return r.src, r.err
}
