package nodecache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/atomicfile"
)

// TempPrefix starts the names of the temporary files the caches write and
// rename into place (atomicfile's).
const TempPrefix = atomicfile.TempPrefix

// StaleTemp is the age after which a temporary file is taken for one left
// by a crash: younger, it may be a write in progress.
const StaleTemp = time.Hour

// Usage is the disk space a file takes (its allocated blocks: the lazy
// store's files are sparse) and its modification time, the caches' stamp
// of last use.
func Usage(st *unix.Stat_t) (bytes int64, mtime time.Time) {
	return st.Blocks * 512, time.Unix(st.Mtim.Unix())
}

// Touch stamps p as used now (its mtime, which Entries report as
// LastUsed; atime is not kept on most mounts). Failure only loses the
// stamp.
func Touch(p string) {
	ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_NOW}}
	_ = unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// errReplaced: the path names another file than the one opened.
var errReplaced = errors.New("replaced while opening it")

// LockShared takes a shared flock on f, the cache file at p, held for as
// long as f stays open: a pruner's RemoveUnlocked then refuses the entry.
// It waits (flock(2) takes no deadline) only while RemoveUnlocked or
// HeldShared holds the lock exclusive, which they take without waiting
// and keep for an lstat and an unlink at most; the caller's own locks
// are no concern, as those holders wait for nothing.
// It re-checks after locking that p still names f, as a prune may have
// unlinked it in between: a removed file is fs.ErrNotExist, one replaced
// errReplaced (open again). It stamps the file as used (Touch).
func LockShared(f *os.File, p string) error {
	if err := flock(f, unix.LOCK_SH); err != nil {
		return fmt.Errorf("lock %s: %w", p, err)
	}
	same, err := samePath(f, p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s: %w (removed by a prune)", p, fs.ErrNotExist)
	case err != nil:
		return err
	case !same:
		return fmt.Errorf("%s: %w", p, errReplaced)
	}
	Touch(p)
	return nil
}

func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			return err
		}
	}
}

// samePath reports whether the path p names the file f has open.
func samePath(f *os.File, p string) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &a); err != nil {
		return false, err
	}
	if err := unix.Lstat(p, &b); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, fs.ErrNotExist
		}
		return false, err
	}
	return a.Dev == b.Dev && a.Ino == b.Ino, nil
}

// RemoveUnlocked unlinks p unless a user holds its shared flock
// (LockShared): it takes the exclusive lock without waiting (ErrInUse
// when refused) and unlinks p only if p still names the file it locked.
// A user that opens p meanwhile waits for the lock, then finds p gone. A
// missing p is not an error.
func RemoveUnlocked(p string) error {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if err := flock(f, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return ErrInUse
		}
		return fmt.Errorf("lock %s: %w", p, err)
	}
	same, err := samePath(f, p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !same {
		// Replaced since we opened it: the new file may be in use.
		return ErrInUse
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// HeldShared reports whether some user holds p's shared flock.
func HeldShared(p string) bool {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	return errors.Is(flock(f, unix.LOCK_EX|unix.LOCK_NB), unix.EWOULDBLOCK)
}

// Dir is a cache of one file per entry in one directory (the index
// caches, the blob cache): entry key = file name less Suffix. A file's
// removal is one unlink, so a crash never tears an entry. Temporary files
// (TempPrefix) are entries too once older than StaleTemp: a crash left
// them.
type Dir struct {
	CacheName string
	Path      string
	// Suffix ends every entry's file name (".idx"); other files are not
	// the cache's.
	Suffix string
	// Locked says users hold shared flocks on entries (LockShared): an
	// entry so held is in use, and Remove refuses it.
	Locked bool
	// Note describes an entry for `kata-fsx cache ls`; nil for none.
	Note func(key string) string
}

var _ Cache = (*Dir)(nil)

// Name implements Cache.
func (d *Dir) Name() string { return d.CacheName }

// Entries implements Cache; a missing directory is an empty cache.
func (d *Dir) Entries(ctx context.Context) ([]Entry, error) {
	des, err := os.ReadDir(d.Path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cache %s: %w", d.CacheName, err)
	}
	var out []Entry
	for _, de := range des {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		name := de.Name()
		temp := strings.HasPrefix(name, TempPrefix)
		if !de.Type().IsRegular() || (!temp && !strings.HasSuffix(name, d.Suffix)) {
			continue
		}
		p := filepath.Join(d.Path, name)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			continue // removed meanwhile
		}
		e := Entry{Key: strings.TrimSuffix(name, d.Suffix)}
		e.Bytes, e.LastUsed = Usage(&st)
		switch {
		case temp:
			e.Key = name
			e.Note = "unfinished write"
			// A writer still at it keeps touching its file.
			e.InUse = time.Since(e.LastUsed) < StaleTemp
		case d.Locked:
			e.InUse = HeldShared(p)
		}
		if d.Note != nil && !temp {
			e.Note = d.Note(e.Key)
		}
		out = append(out, e)
	}
	return out, nil
}

// Remove implements Cache.
func (d *Dir) Remove(ctx context.Context, key string) error {
	if key == "" || strings.ContainsRune(key, '/') || key == "." || key == ".." {
		return fmt.Errorf("cache %s: bad key %q", d.CacheName, key)
	}
	p := filepath.Join(d.Path, key)
	if !strings.HasPrefix(key, TempPrefix) {
		p += d.Suffix
	} else {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err == nil {
			if _, mt := Usage(&st); time.Since(mt) < StaleTemp {
				return ErrInUse
			}
		}
	}
	var err error
	if d.Locked {
		err = RemoveUnlocked(p)
	} else if err = os.Remove(p); errors.Is(err, fs.ErrNotExist) {
		err = nil
	}
	if err != nil && !errors.Is(err, ErrInUse) {
		return fmt.Errorf("cache %s: remove %s: %w", d.CacheName, key, err)
	}
	return err
}

// Union is one cache made of several (the "indexes" cache is the
// per-layer index cache and the lazy images' one): an entry's key is its
// part's prefix, a slash and its key in that part.
type Union struct {
	CacheName string
	Parts     []Part
}

// Part is one cache of a Union and the prefix of its keys.
type Part struct {
	Prefix string
	Cache  Cache
}

var _ Cache = (*Union)(nil)

// Name implements Cache.
func (u *Union) Name() string { return u.CacheName }

// Entries implements Cache.
func (u *Union) Entries(ctx context.Context) ([]Entry, error) {
	var out []Entry
	for _, p := range u.Parts {
		es, err := p.Cache.Entries(ctx)
		if err != nil {
			return nil, err
		}
		for _, e := range es {
			e.Key = p.Prefix + "/" + e.Key
			out = append(out, e)
		}
	}
	return out, nil
}

// Remove implements Cache.
func (u *Union) Remove(ctx context.Context, key string) error {
	prefix, k, ok := strings.Cut(key, "/")
	if ok {
		for _, p := range u.Parts {
			if p.Prefix == prefix {
				return p.Cache.Remove(ctx, k)
			}
		}
	}
	return fmt.Errorf("cache %s: no part holds key %q", u.CacheName, key)
}

// TryLock takes the exclusive flock of the file p (created if need be)
// without waiting: ok is false when another process holds it. Automatic
// prunes take one so that two shims do not prune the same caches at once.
// As nobody waits for such a lock, its holder may wait for anything.
func TryLock(p string) (unlock func(), ok bool, err error) {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return nil, false, err
	}
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, false, err
	}
	if err := flock(f, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("lock %s: %w", p, err)
	}
	return func() { f.Close() }, true, nil
}
