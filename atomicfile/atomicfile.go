// Package atomicfile replaces files whole. Its one durability rule: a
// write that returned nil survives a crash, and a crash at any point
// leaves the old file or the new one, never part of one. So the data is
// written to a temporary file beside the target, fsynced, renamed over
// the target, and the directory is fsynced after the rename; on failure
// the temporary file is removed. (continuity.AtomicWriteFile, which
// containerd uses, syncs the data but not the directory, keeps its
// temporary file when a step fails, and takes only a byte slice.)
package atomicfile

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// TempPrefix starts the name of every temporary file Write makes: a
// node cache takes a file so named, once old, for a crash's leftover.
const TempPrefix = ".tmp-"

// WriteFile replaces path with data, with permissions perm.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	return Write(path, perm, func(w io.Writer) error {
		_, err := io.Copy(w, bytes.NewReader(data))
		return err
	})
}

// Write replaces path with what fill writes, with permissions perm; when
// fill fails, path is left as it was and fill's error is returned as it
// is (the caller's own, with its context).
func Write(path string, perm os.FileMode, fill func(io.Writer) error) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, TempPrefix+"*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := fill(f); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	err = f.Chmod(perm)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("write %s: %w", path, err)
	}
	return SyncDir(dir)
}

// SyncDir fsyncs the directory dir, so that the names made, renamed or
// removed in it survive a crash.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory: %w", err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}
