package index_test

import (
	"reflect"
	"slices"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

func TestComparePathsOrder(t *testing.T) {
	paths := []string{"a-b", "a/x", ".", "a", "a/x/y", "ab", "a\x01", "b", "a/x-y", "a!"}
	slices.SortFunc(paths, index.ComparePaths)
	want := []string{".", "a", "a/x", "a/x/y", "a/x-y", "a\x01", "a!", "a-b", "ab", "b"}
	if !reflect.DeepEqual(paths, want) {
		t.Fatalf("order %q, want %q", paths, want)
	}
}
