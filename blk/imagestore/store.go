// Package imagestore is the node's store of synthesized images: the ext4
// metadata, block map and manifest of one index built with one set of
// options, content-addressed by a key over both, built once however many
// pods (threads or processes) ask for it at the same time, and then shared
// read-only by every pod that serves it, through the page cache.
//
// On disk, under the store directory (<imagefs_blk.state_dir>/cache/images):
//
//	<key>/          a complete entry: meta.bin, blockmap.bin, manifest.json, used
//	<key>.lock      its hold lock: shared by each pod serving the entry (and by
//	                each Acquire while it looks or builds), exclusive only to
//	                a pruner removing the entry, which never waits for it
//	<key>.build     its build lock: exclusive to the one Acquire building the
//	                entry; present only while a build runs or is waited for
//	.tmp-<key>-*    a build in progress (or a dead builder's leftover): never served
//	.trash-<key>-*  an entry being removed: never served
//
// An entry appears only by the rename of a complete, fsynced staging
// directory, and disappears only by a rename under the exclusive hold lock,
// so a process killed at any point leaves either a whole entry or nothing a
// later open would serve.
//
// Lock order: hold lock (shared) before build lock (exclusive). No one
// waits for a lock while holding one that a waiter of the first could need:
// readers and builders hold the hold lock only shared, so they never wait
// on each other through it; a builder waits only for the build lock, which
// no reader holds and whose holder waits for nothing but its own build; the
// pruner takes both locks without waiting. Serving an entry (the hold lock
// kept shared for a pod's life) therefore never keeps another pod of the
// same image from starting.
package imagestore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
)

// Names in the store directory and in an entry.
const (
	lockSuffix   = ".lock"
	buildSuffix  = ".build"
	stagingPre   = ".tmp-"
	trashPre     = ".trash-"
	usedFile     = "used" // its mtime is the entry's last use
	keyFormatTag = "kata-fsx imagestore v1: ext4 manifest format 1\n"
)

// Store is a directory of synthesized images.
type Store struct {
	dir string
	// afterWrite, when set (tests only), runs in a build after the staging
	// directory's files are written and before it is renamed into place.
	afterWrite func(staging string)
}

// New returns the store kept in dir (created on first use).
func New(dir string) *Store { return &Store{dir: dir} }

// Entry is one image of the store held for serving: until Close, the
// store's pruner cannot remove it.
type Entry struct {
	// Key is the entry's content address.
	Key string
	// Dir is the entry's directory.
	Dir string
	// Image is the entry opened read-only: the metadata file is read with
	// pread, so every pod of the image shares its pages in the page cache.
	Image *ext4.Image
	// Built says this Acquire synthesized the entry; false means another
	// pod (a thread or a process) had built it or was building it.
	Built bool
	// Synthesis is how long the build took (zero when not Built).
	Synthesis time.Duration

	lock *os.File
}

// Close releases the image and the entry's shared lock.
func (e *Entry) Close() error {
	var err error
	if e.Image != nil {
		err = e.Image.Close()
		e.Image = nil
	}
	if e.lock != nil {
		err = errors.Join(err, e.lock.Close()) // closing the descriptor drops its flock
		e.lock = nil
	}
	return err
}

// Normalize returns idx without the sources no entry reads, Data.Source
// ids renumbered to match, so that what differs between pods of one image
// without changing the filesystem (each container's own empty upper
// directory, say) does not make their keys differ. idx itself is returned
// when every source is used; it is never modified.
func Normalize(idx *index.Index) *index.Index {
	used := make([]bool, len(idx.Sources))
	for i := range idx.Entries {
		e := &idx.Entries[i]
		if e.Type == index.TypeRegular && int(e.Data.Source) < len(used) {
			used[e.Data.Source] = true
		}
	}
	renum := make([]uint32, len(idx.Sources))
	var kept []index.Source
	for i, u := range used {
		if u {
			renum[i] = uint32(len(kept))
			kept = append(kept, idx.Sources[i])
		}
	}
	if len(kept) == len(idx.Sources) {
		return idx
	}
	out := &index.Index{Sources: kept, Entries: make([]index.Entry, len(idx.Entries))}
	copy(out.Entries, idx.Entries)
	for i := range out.Entries {
		e := &out.Entries[i]
		if e.Type == index.TypeRegular && int(e.Data.Source) < len(renum) {
			e.Data.Source = renum[e.Data.Source]
		}
	}
	return out
}

// Key is the content address of idx synthesized with opts: a SHA-256 over
// the store's format, every option that changes the image's bytes and the
// normalized index's canonical encoding. Budgets and TempDir change no
// byte and are left out. It returns the normalized index the key covers,
// which is what a build must synthesize.
func Key(idx *index.Index, opts ext4.Options) (string, *index.Index, error) {
	if idx == nil {
		return "", nil, errors.New("imagestore: nil index")
	}
	norm := Normalize(idx)
	o := byteOptions(opts)
	h := sha256.New()
	t := "zero"
	if !o.Time.IsZero() {
		t = fmt.Sprintf("%d.%09d", o.Time.Unix(), o.Time.Nanosecond())
	}
	fmt.Fprintf(h, "%sblock_size=%d\nwritable_size=%d\nno_journal=%t\njournal_size=%d\nfree_inodes=%d\ntime=%s\nuuid=%x\nhash_seed=%x\nvolume=%q\nindex:\n",
		keyFormatTag, o.BlockSize, o.WritableSize, o.NoJournal, o.JournalSize, o.FreeInodes, t, o.UUID, o.HashSeed, o.VolumeName)
	if err := index.Encode(h, norm); err != nil {
		return "", nil, fmt.Errorf("imagestore: key: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), norm, nil
}

// byteOptions is opts with the fields that do not change the image's
// bytes cleared and the zero defaults that do spelled out, so equal images
// get equal keys.
func byteOptions(opts ext4.Options) ext4.Options {
	o := ext4.Options{BlockSize: opts.BlockSize, WritableSize: opts.WritableSize, JournalSize: opts.JournalSize,
		NoJournal: opts.NoJournal, FreeInodes: opts.FreeInodes, Time: opts.Time, UUID: opts.UUID,
		HashSeed: opts.HashSeed, VolumeName: opts.VolumeName}
	if o.BlockSize == 0 {
		o.BlockSize = ext4.DefaultBlockSize
	}
	if o.WritableSize == 0 {
		o.WritableSize = ext4.DefaultWritableSize
	}
	if o.WritableSize < 0 {
		o.WritableSize = -1
	}
	if o.NoJournal {
		o.JournalSize = 0
	}
	return o
}

// ValidKey says whether key has the form Key returns, so a name from the
// command line or a directory listing cannot reach outside the store.
func ValidKey(key string) bool {
	if len(key) != 2*sha256.Size {
		return false
	}
	for _, c := range key {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Acquire returns the entry for idx synthesized with opts, holding it
// (shared) until Entry.Close: found in the store, or built once while any
// other pod asking for the same key waits for that build. opts.Time and
// opts.UUID left zero make the build a function of the key (the epoch and
// a UUID derived from the index), so that every build of a key writes the
// same bytes.
func (s *Store) Acquire(ctx context.Context, idx *index.Index, opts ext4.Options) (*Entry, error) {
	key, norm, err := Key(idx, opts)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	dir := filepath.Join(s.dir, key)
	lockPath := dir + lockSuffix
	for {
		// The shared hold lock keeps a pruner from the entry while we look,
		// build, and then serve it.
		f, err := lockFile(ctx, lockPath, unix.LOCK_SH)
		if err != nil {
			return nil, err
		}
		if exists(dir) {
			return s.open(key, f, false, 0)
		}
		built, took, err := s.buildOnce(ctx, key, norm, opts)
		if err != nil {
			f.Close()
			return nil, err
		}
		if exists(dir) {
			return s.open(key, f, built, took)
		}
		// The shared hold lock keeps pruners out, so only a hand outside
		// the store can have taken the entry since: look again.
		f.Close()
	}
}

// buildOnce builds the entry key unless another Acquire did while this one
// waited for the build lock; the caller holds the hold lock shared. Once
// the entry is published the build lock file goes: a waiter still holding
// the unlinked file notices (lockFile) and finds the entry.
func (s *Store) buildOnce(ctx context.Context, key string, idx *index.Index, opts ext4.Options) (bool, time.Duration, error) {
	dir := filepath.Join(s.dir, key)
	buildPath := dir + buildSuffix
	b, err := lockFile(ctx, buildPath, unix.LOCK_EX)
	if err != nil {
		return false, 0, err
	}
	defer b.Close()
	built, took := false, time.Duration(0)
	if !exists(dir) {
		start := time.Now()
		if err := s.build(ctx, key, idx, opts); err != nil {
			return false, 0, err
		}
		built, took = true, time.Since(start)
	}
	if err := os.Remove(buildPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, 0, fmt.Errorf("imagestore: %w", err)
	}
	return built, took, nil
}

// open opens the entry key for serving; lock (held shared) goes to the entry.
func (s *Store) open(key string, lock *os.File, built bool, took time.Duration) (*Entry, error) {
	dir := filepath.Join(s.dir, key)
	now := time.Now()
	// The last-use stamp is an mtime: atime is not updated on noatime or
	// relatime mounts.
	if err := os.Chtimes(filepath.Join(dir, usedFile), now, now); err != nil {
		lock.Close()
		return nil, fmt.Errorf("imagestore: entry %s: stamp last use: %w", key, err)
	}
	img, err := ext4.Open(dir)
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("imagestore: entry %s: %w", key, err)
	}
	return &Entry{Key: key, Dir: dir, Image: img, Built: built, Synthesis: took, lock: lock}, nil
}

// build synthesizes idx into a staging directory and renames it into
// place; the caller holds the key's build lock.
func (s *Store) build(ctx context.Context, key string, idx *index.Index, opts ext4.Options) (err error) {
	// Staging directories of this key are a dead builder's: a live one
	// would hold the lock we hold.
	if err := removeStaging(s.dir, key); err != nil {
		return err
	}
	staging, err := os.MkdirTemp(s.dir, stagingPre+key+"-")
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(staging)
		}
	}()
	// The metadata is made beside the entry it becomes, not in a tmpfs
	// /tmp that the guests' memory may share.
	opts.TempDir = staging
	img, err := ext4.Build(ctx, idx, opts)
	if err != nil {
		return fmt.Errorf("imagestore: synthesize ext4: %w", err)
	}
	err = img.WriteTo(staging)
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := os.WriteFile(filepath.Join(staging, usedFile), nil, 0o644); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if s.afterWrite != nil {
		s.afterWrite(staging)
	}
	for _, name := range []string{ext4.MetaFile, ext4.MapFile, ext4.ManifestFile, usedFile, "."} {
		if err := syncPath(filepath.Join(staging, name)); err != nil {
			return fmt.Errorf("imagestore: %w", err)
		}
	}
	if err := os.Chmod(staging, 0o755); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := os.Rename(staging, filepath.Join(s.dir, key)); err != nil {
		return fmt.Errorf("imagestore: publish entry: %w", err)
	}
	if err := syncPath(s.dir); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	return nil
}

// removeStaging deletes key's staging directories (all of them when key is
// "": the caller then knows no build runs).
func removeStaging(dir, key string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), stagingPre+key) {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// exists says whether the entry directory is there; only a complete entry
// is ever renamed to that name.
func exists(dir string) bool {
	fi, err := os.Lstat(dir)
	return err == nil && fi.IsDir()
}

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
