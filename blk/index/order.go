package index

import (
	"sort"
	"strings"
)

// ComparePaths orders index paths as Index requires: "." first, then byte
// order with '/' sorting below every other byte, so each directory's subtree
// directly follows the directory. It returns -1, 0 or +1.
func ComparePaths(a, b string) int {
	if a == b {
		return 0
	}
	if a == "." {
		return -1
	}
	if b == "." {
		return 1
	}
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		ca, cb := a[i], b[i]
		if ca == cb {
			continue
		}
		// Mapping '/' to the lowest value makes siblings sort by name while a
		// name that extends another ("a/x" vs "a-b") stays inside its parent.
		if ca == '/' {
			return -1
		}
		if cb == '/' {
			return 1
		}
		if ca < cb {
			return -1
		}
		return 1
	}
	switch {
	case len(a) < len(b):
		return -1
	case len(a) > len(b):
		return 1
	}
	return 0
}

// Lookup returns the position of the entry with the given path, or -1; it
// relies on the Index order and costs O(log n).
func (ix *Index) Lookup(p string) int {
	i := sort.Search(len(ix.Entries), func(i int) bool { return ComparePaths(ix.Entries[i].Path, p) >= 0 })
	if i < len(ix.Entries) && ix.Entries[i].Path == p {
		return i
	}
	return -1
}

// ParentPath returns the parent of a clean relative index path ("." for a
// top-level name).
func ParentPath(p string) string {
	i := strings.LastIndexByte(p, '/')
	if i < 0 {
		return "."
	}
	return p[:i]
}

// BaseName returns the last component of a clean relative index path.
func BaseName(p string) string {
	return p[strings.LastIndexByte(p, '/')+1:]
}

// JoinPath appends a name to an index directory path ("." is the root).
func JoinPath(dir, name string) string {
	if dir == "." {
		return name
	}
	return dir + "/" + name
}
