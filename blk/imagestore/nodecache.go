package imagestore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/nodecache"
)

// CacheName is the store's name in configuration keys and `kata-fsx cache`.
const CacheName = "metadata"

// NodeCache is the store in dir as a node cache, for listing and pruning.
func NodeCache(dir string) nodecache.Cache { return &nodeCache{dir: dir} }

type nodeCache struct {
	dir string
	// afterRename, when set (tests only), runs in Remove once the entry
	// has been renamed away.
	afterRename func()
}

var _ nodecache.Cache = (*nodeCache)(nil)

func (*nodeCache) Name() string { return CacheName }

// Entries lists the complete entries. It first deletes what no one will
// serve: trash left by a killed Remove, and staging directories and build
// lock files of dead builders (those whose build lock it can take
// exclusively without waiting).
func (c *nodeCache) Entries(ctx context.Context) ([]nodecache.Entry, error) {
	ents, err := os.ReadDir(c.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("imagestore: list %s: %w", c.dir, err)
	}
	var out []nodecache.Entry
	for _, de := range ents {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		name := de.Name()
		switch {
		case strings.HasPrefix(name, trashPre):
			os.RemoveAll(filepath.Join(c.dir, name)) // best effort: listed again next time
			continue
		case strings.HasPrefix(name, stagingPre):
			c.sweepStaging(name)
			continue
		case strings.HasSuffix(name, buildSuffix):
			c.sweepBuildLock(name)
			continue
		case !de.IsDir() || !ValidKey(name):
			continue
		}
		e, err := c.entry(name)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) { // removed while we listed
				continue
			}
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// sweepStaging removes a staging directory whose builder is gone. A live
// builder holds its key's build lock from before it makes the staging
// directory until after the rename, so a build lock taken here without
// waiting (or no build lock file at all) means none runs; it is taken
// last, after no other lock, and never waited for.
func (c *nodeCache) sweepStaging(name string) {
	key, _, _ := strings.Cut(strings.TrimPrefix(name, stagingPre), "-")
	if !ValidKey(key) {
		return
	}
	f, err := os.OpenFile(filepath.Join(c.dir, key+buildSuffix), os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		os.RemoveAll(filepath.Join(c.dir, name))
		return
	}
	if err != nil {
		return
	}
	defer f.Close()
	if ok, _ := tryLock(f, unix.LOCK_EX); ok {
		os.RemoveAll(filepath.Join(c.dir, name))
	}
}

// sweepBuildLock unlinks the build lock file of a dead builder (a live
// one, or an Acquire waiting for it, holds or is about to hold it; the
// latter notices the unlink and opens the file again).
func (c *nodeCache) sweepBuildLock(name string) {
	path := filepath.Join(c.dir, name)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	if ok, _ := tryLock(f, unix.LOCK_EX); ok && sameFile(f, path) {
		os.Remove(path)
	}
}

func (c *nodeCache) entry(key string) (nodecache.Entry, error) {
	dir := filepath.Join(c.dir, key)
	e := nodecache.Entry{Key: key}
	st, err := os.Stat(filepath.Join(dir, usedFile))
	if err != nil {
		return e, fmt.Errorf("imagestore: entry %s: %w", key, err)
	}
	e.LastUsed = st.ModTime()
	files, err := os.ReadDir(dir)
	if err != nil {
		return e, fmt.Errorf("imagestore: entry %s: %w", key, err)
	}
	for _, f := range files {
		var s unix.Stat_t
		if unix.Lstat(filepath.Join(dir, f.Name()), &s) == nil {
			e.Bytes += s.Blocks * 512
		}
	}
	if js, err := os.ReadFile(filepath.Join(dir, ext4.ManifestFile)); err == nil {
		var mf ext4.Manifest
		if json.Unmarshal(js, &mf) == nil {
			e.Note = fmt.Sprintf("%d inodes, %d layers, %d MiB filesystem", mf.UsedInodes, len(mf.Sources), mf.SizeBytes>>20)
		}
	}
	if f, err := os.OpenFile(filepath.Join(c.dir, key+lockSuffix), os.O_RDWR, 0); err == nil {
		ok, lerr := tryLock(f, unix.LOCK_EX)
		e.InUse = !ok || lerr != nil
		f.Close()
	}
	return e, nil
}

// Remove deletes the entry key unless a pod serves it (ErrInUse). Under
// the exclusive lock the entry is renamed out of its name first, then its
// lock file unlinked, then the renamed directory deleted: a process killed
// in between leaves the whole entry or trash that is never served.
func (c *nodeCache) Remove(ctx context.Context, key string) error {
	if !ValidKey(key) {
		return fmt.Errorf("imagestore: %q is not an entry key", key)
	}
	dir := filepath.Join(c.dir, key)
	lockPath := dir + lockSuffix
	if !exists(dir) {
		return nil
	}
	// O_CREATE: an entry always has a lock file, but one lost (a crash
	// between Remove's steps) must not make the entry unremovable.
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("imagestore: remove %s: %w", key, err)
	}
	defer f.Close()
	// Never wait: a pruner skips what a pod serves or a build holds.
	ok, err := tryLock(f, unix.LOCK_EX)
	if err != nil {
		return err
	}
	if !ok || !sameFile(f, lockPath) {
		return fmt.Errorf("imagestore: entry %s: %w", key, nodecache.ErrInUse)
	}
	if exists(dir) {
		trash, err := os.MkdirTemp(c.dir, trashPre+key+"-")
		if err != nil {
			return fmt.Errorf("imagestore: remove %s: %w", key, err)
		}
		// rename(2) onto the empty directory MkdirTemp reserved replaces
		// it (os.Rename refuses an existing directory).
		if err := unix.Rename(dir, trash); err != nil {
			os.Remove(trash)
			return fmt.Errorf("imagestore: remove %s: %w", key, err)
		}
		if err := syncPath(c.dir); err != nil {
			return fmt.Errorf("imagestore: remove %s: %w", key, err)
		}
		defer os.RemoveAll(trash)
		if c.afterRename != nil {
			c.afterRename()
		}
	}
	if err := os.Remove(lockPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("imagestore: remove %s: %w", key, err)
	}
	return nil
}
