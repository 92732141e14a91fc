package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/kata-fsx/kata-fsx/content/lazyindex"
	"github.com/kata-fsx/kata-fsx/nodecache"
	"golang.org/x/sys/unix"
)

// The chunk map file: a header, then one byte per chunk (1: the chunk's
// bytes are durable in the data file). A byte per chunk rather than a bit
// lets processes sharing the directory each set their own chunks' entries
// with one pwrite, under that chunk's lock, without a read-modify-write
// of a byte another process may be writing.
const (
	mapMagic      = "KFSXCHM\n"
	mapVersion    = 1
	mapHeaderSize = 32 // magic, version u32, zero u32, chunk size u64, blob size u64
	// initLockWait bounds how long opening a layer's cache files waits for
	// another process initialising them.
	initLockWait = 10 * time.Second
	// diskRetry is how long a layer whose chunk write failed is served
	// from memory before writing to the node disk is tried again (space
	// may have been freed).
	diskRetry = time.Minute
)

// layer is one added layer: its index, its fetcher and its cache files.
type layer struct {
	s    *Store
	ix   *lazyindex.Index
	f    Fetcher
	name string // the blob digest, as logs and traces name the layer

	data *os.File // <Dir>/layers/<hex>.data; nil: memory only
	cmap *os.File // <Dir>/layers/<hex>.chunks

	// mu guards the fields below. It is the first of the package's
	// mutexes (Store.mu and memTier.mu may be taken under it) and is
	// never held across I/O, a file lock or a wait for a fetch.
	mu       sync.Mutex
	held     []bool // chunk durable on disk, as far as this process knows
	verified []bool // chunk read from disk and verified since Open
	badDisk  []bool // chunk on disk did not verify: fetch it, do not reread it
	inflight map[int64]*call
	spans    map[int64]*call
	// diskOff is when the node disk last refused a write (full or
	// failing): until diskRetry after it, the layer is served from memory.
	diskOff time.Time
}

// call is one chunk's (or span's) fetch in flight; done closes when b or
// err is set.
type call struct {
	done chan struct{}
	b    []byte
	err  error
}

func newCall() *call { return &call{done: make(chan struct{})} }

func newLayer(s *Store, ix *lazyindex.Index, f Fetcher) (*layer, error) {
	n := ix.NumChunks()
	l := &layer{s: s, ix: ix, f: f, name: ix.Digest, held: make([]bool, n), verified: make([]bool, n), badDisk: make([]bool, n),
		inflight: make(map[int64]*call), spans: make(map[int64]*call)}
	if s.opts.Dir == "" {
		return l, nil
	}
	if err := l.openFiles(); err != nil {
		// The layer still works from memory; the node cache is an
		// optimisation, and its failure is worth one line, not a pod.
		s.logf("node cache %s: layer %s served from memory only: %v", s.opts.Dir, l.name, err)
		l.close()
		l.data, l.cmap = nil, nil
	}
	return l, nil
}

func (l *layer) openFiles() error {
	for try := 0; ; try++ {
		err := l.openFilesOnce()
		if !errors.Is(err, errRemoved) || try == 3 {
			return err
		}
		// RemoveLayer unlinked the files between our opening and our
		// lock: open the new ones.
		l.close()
	}
}

func (l *layer) openFilesOnce() error {
	hex, _ := blobHex(l.ix.Digest)
	base := layerBase(l.s.opts.Dir, hex)
	var err error
	if l.data, err = os.OpenFile(base+".data", os.O_RDWR|os.O_CREATE, 0o600); err != nil {
		return err
	}
	if l.cmap, err = os.OpenFile(base+".chunks", os.O_RDWR|os.O_CREATE, 0o600); err != nil {
		return err
	}
	// The header lock's holders wait for nothing but their own I/O, except
	// RemoveLayer, which waits (bounded) for fetches; a fetch never waits
	// for this lock, so the bound is only against a stopped holder.
	ctx, cancel := context.WithTimeout(l.s.ctx, initLockWait)
	defer cancel()
	unlock, err := lockRange(ctx, l.cmap, 0, mapHeaderSize)
	if err != nil {
		return fmt.Errorf("lock %s: %w", l.cmap.Name(), err)
	}
	defer unlock()
	if unlinked(l.data) || unlinked(l.cmap) {
		return errRemoved
	}
	// Under the header lock, so that a prune (NodeCache) either removed
	// the files before (seen just above) or finds them in use.
	if err := markInUse(l.cmap); err != nil {
		return err
	}
	nodecache.Touch(l.cmap.Name())
	want := make([]byte, mapHeaderSize)
	copy(want, mapMagic)
	binary.LittleEndian.PutUint32(want[8:], mapVersion)
	binary.LittleEndian.PutUint64(want[16:], uint64(l.ix.ChunkSize))
	binary.LittleEndian.PutUint64(want[24:], uint64(l.ix.CompressedSize))
	n := int64(len(l.held))
	m := make([]byte, mapHeaderSize+n)
	got, err := l.cmap.ReadAt(m, 0)
	if err != nil && err != io.EOF {
		return fmt.Errorf("read %s: %w", l.cmap.Name(), err)
	}
	if got > 0 && (got < mapHeaderSize || !bytes.Equal(m[:mapHeaderSize], want)) {
		// Another index of this blob (another chunk size) or a damaged
		// header: the map starts over. The data file stays: its bytes sit
		// at blob offsets whatever the chunking and are verified before
		// use, so stale bytes there are never served.
		l.s.logf("node cache %s: chunk map %s does not match layer %s (chunks of %d, %d bytes): starting it over", l.s.opts.Dir, l.cmap.Name(), l.name, l.ix.ChunkSize, l.ix.CompressedSize)
		got = 0
		clear(m)
	}
	if got < len(m) {
		copy(m, want)
		if err := l.cmap.Truncate(0); err != nil {
			return err
		}
		if _, err := l.cmap.WriteAt(m, 0); err != nil {
			return fmt.Errorf("write %s: %w", l.cmap.Name(), err)
		}
		if err := l.cmap.Sync(); err != nil {
			return err
		}
	}
	if fi, err := l.data.Stat(); err != nil {
		return err
	} else if fi.Size() < l.ix.CompressedSize {
		if err := l.data.Truncate(l.ix.CompressedSize); err != nil {
			return fmt.Errorf("size %s: %w", l.data.Name(), err)
		}
	}
	for i := range l.held {
		l.held[i] = m[mapHeaderSize+i] == 1
	}
	return nil
}

func (l *layer) close() error {
	var errs []error
	for _, f := range []*os.File{l.data, l.cmap} {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	return errors.Join(errs...)
}

// onDisk reports whether the layer writes to the node disk tier.
func (l *layer) onDisk() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.data != nil && l.diskOnLocked()
}

func (l *layer) diskOnLocked() bool {
	return l.diskOff.IsZero() || time.Since(l.diskOff) >= l.s.diskRetry
}

// mapHeld reads the chunk map's entries for [lo, hi) as the file has them
// now (another process may have set some).
func (l *layer) mapHeld(lo, hi int64) ([]bool, error) {
	b := make([]byte, hi-lo)
	if _, err := l.cmap.ReadAt(b, mapHeaderSize+lo); err != nil {
		return nil, fmt.Errorf("read %s: %w", l.cmap.Name(), err)
	}
	out := make([]bool, len(b))
	for i, v := range b {
		out[i] = v == 1
	}
	return out, nil
}

// readDisk reads chunk i from the data file, verifying it the first time
// this Store reads it: a torn write or a crash before the bytes were
// durable shows as a mismatch, and the chunk is then fetched again.
func (l *layer) readDisk(i int64) ([]byte, error) {
	start, end := l.ix.ChunkRange(i)
	b := make([]byte, end-start)
	if _, err := l.data.ReadAt(b, start); err != nil {
		return nil, fmt.Errorf("read %s: %w", l.data.Name(), err)
	}
	l.mu.Lock()
	ok := l.verified[i]
	l.mu.Unlock()
	if !ok {
		if err := l.ix.VerifyChunk(i, b); err != nil {
			l.mu.Lock()
			l.badDisk[i] = true
			l.mu.Unlock()
			l.s.stats.verifyFailures.Add(1)
			l.s.logf("node cache %s: layer %s chunk %d (bytes [%d, %d)) on disk does not verify, fetching it again: %v", l.s.opts.Dir, l.name, i, start, end, err)
			return nil, err
		}
		l.mu.Lock()
		l.verified[i] = true
		l.mu.Unlock()
	}
	return b, nil
}

// writeDisk makes the verified chunks b (from chunk lo on) durable and
// only then marks them in the chunk map; the caller holds their range
// lock. It reports whether they are on disk.
func (l *layer) writeDisk(lo int64, b []byte) bool {
	start, _ := l.ix.ChunkRange(lo)
	hi := lo + (int64(len(b))+l.ix.ChunkSize-1)/l.ix.ChunkSize
	mapped := false
	err := func() error {
		if _, err := l.data.WriteAt(b, start); err != nil {
			return err
		}
		if err := unix.Fdatasync(int(l.data.Fd())); err != nil {
			return err
		}
		mapped = true
		ones := bytes.Repeat([]byte{1}, int(hi-lo))
		_, err := l.cmap.WriteAt(ones, mapHeaderSize+lo)
		return err
	}()
	if err == nil {
		l.mu.Lock()
		for i := lo; i < hi; i++ {
			l.held[i] = true
			l.verified[i] = true
			l.badDisk[i] = false
		}
		l.mu.Unlock()
		return true
	}
	if !mapped {
		// The chunks are not in the map, so they do not count and their
		// bytes in the data file are dead: give the blocks back so a full
		// disk is not left fuller. (Once the map write has begun, some
		// entries may be set over durable bytes, which must stay.)
		_ = unix.Fallocate(int(l.data.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, start, int64(len(b)))
	}
	full := errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
	l.mu.Lock()
	first := l.diskOnLocked() // not already off: say so once per episode
	l.diskOff = time.Now()
	l.mu.Unlock()
	if full {
		l.s.stats.diskFull.Add(1)
	}
	if first {
		if full {
			l.s.logf("node cache %s full: serving layer %s from memory; free space or lower the node's cache use (writing chunks %d-%d: %v)", l.s.opts.Dir, l.name, lo, hi-1, err)
		} else {
			l.s.logf("node cache %s: writing layer %s chunks %d-%d failed, serving the layer from memory: %v", l.s.opts.Dir, l.name, lo, hi-1, err)
		}
	}
	return false
}

// lockRange takes an OFD write lock on [start, start+n) of f, polling (a
// blocking wait could outlast the reader's deadline) until ctx ends. The
// range is locked in one call, whole or not at all, so a caller never
// holds part of it while it waits for the rest.
func lockRange(ctx context.Context, f *os.File, start, n int64) (func(), error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: start, Len: n}
	fd := f.Fd()
	for {
		err := unix.FcntlFlock(fd, unix.F_OFD_SETLK, &lk)
		if err == nil {
			return func() {
				ul := lk
				ul.Type = unix.F_UNLCK
				_ = unix.FcntlFlock(fd, unix.F_OFD_SETLK, &ul)
			}, nil
		}
		if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EACCES) {
			return nil, fmt.Errorf("lock bytes [%d, %d) of %s: %w", start, start+n, f.Name(), err)
		}
		t := time.NewTimer(lockPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("lock bytes [%d, %d) of %s: %w", start, start+n, f.Name(), ctx.Err())
		case <-t.C:
		}
	}
}
