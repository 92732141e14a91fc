// Package indextest holds the fixtures that the tests of package index and
// of its source packages share: generated host trees, overlay layer
// directories, layer tars, and checks of an index against what an Opener
// reads. Only tests import it.
package indextest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"golang.org/x/sys/unix"
)

// Must fails the test on a non-nil err.
func Must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// WriteFile writes a file with exactly mode, whatever the umask.
func WriteFile(t testing.TB, p string, data []byte, mode os.FileMode) {
	t.Helper()
	Must(t, os.WriteFile(p, data, mode))
	Must(t, os.Chmod(p, mode)) // umask-independent
}

// Normalize returns a copy of ix in which nil and empty xattr values compare
// equal.
func Normalize(ix *index.Index) *index.Index {
	out := *ix
	out.Entries = slices.Clone(ix.Entries)
	for i := range out.Entries {
		xs := slices.Clone(out.Entries[i].Xattrs)
		for j := range xs {
			if xs[j].Value == nil {
				xs[j].Value = []byte{}
			}
		}
		out.Entries[i].Xattrs = xs
	}
	return &out
}

// Lxattrs reads a path's xattrs the plain path-based way, sorted.
func Lxattrs(t testing.TB, p string) []index.Xattr {
	t.Helper()
	sz, err := unix.Llistxattr(p, nil)
	Must(t, err)
	if sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	Must(t, err)
	var out []index.Xattr
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		vs, err := unix.Lgetxattr(p, name, nil)
		Must(t, err)
		v := make([]byte, vs)
		vs, err = unix.Lgetxattr(p, name, v)
		Must(t, err)
		out = append(out, index.Xattr{Name: name, Value: v[:vs]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// ReadEntry reads a regular entry's bytes through an Opener.
func ReadEntry(t testing.TB, ix *index.Index, op index.Opener, e *index.Entry) []byte {
	t.Helper()
	src := ix.Sources[e.Data.Source]
	r, err := op.Open(src, e.Data.Path)
	if err != nil {
		t.Fatalf("%.100q: open: %v", e.Path, err)
	}
	if c, ok := r.(io.Closer); ok {
		defer c.Close()
	}
	b := make([]byte, e.Size)
	if _, err := r.ReadAt(b, e.Data.Offset); err != nil && !(err == io.EOF && e.Size == 0) {
		t.Fatalf("%.100q: read: %v", e.Path, err)
	}
	return b
}

// CheckContents compares every regular file of ix, read through op, with
// want(path).
func CheckContents(t *testing.T, ix *index.Index, op index.Opener, want func(p string) ([]byte, error)) {
	t.Helper()
	for i := range ix.Entries {
		e := &ix.Entries[i]
		if e.Type != index.TypeRegular {
			continue
		}
		w, err := want(e.Path)
		Must(t, err)
		if got := ReadEntry(t, ix, op, e); !bytes.Equal(got, w) {
			t.Errorf("%.100q: content differs (%d vs %d bytes)", e.Path, len(got), len(w))
		}
	}
}

// DigestOf returns b's "sha256:<hex>" digest.
func DigestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// Paths lists the paths of ix in order.
func Paths(ix *index.Index) []string {
	var out []string
	for _, e := range ix.Entries {
		out = append(out, e.Path)
	}
	return out
}

// Lookup returns the entry at p, failing the test when there is none.
func Lookup(t *testing.T, ix *index.Index, p string) *index.Entry {
	t.Helper()
	i := ix.Lookup(p)
	if i < 0 {
		t.Fatalf("%q missing from %q", p, Paths(ix))
	}
	return &ix.Entries[i]
}
