package blk

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
)

// The budgets in Options reach the index and the synthesis that Build
// runs for the shim: a layer over one is refused naming its key, and
// nothing is left in the disk directory.
func TestBuildHonoursBudgets(t *testing.T) {
	layer := t.TempDir()
	for i := 0; i < 200; i++ {
		if err := os.Mkdir(filepath.Join(layer, fmt.Sprintf("d%03d", i)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name    string
		budgets Budgets
		want    string
	}{
		{"entries", Budgets{MaxEntries: 100}, "max_entries"},
		{"metadata", Budgets{MaxMetadataBytes: 64 << 10}, ext4.BudgetMetadata},
		{"build memory", Budgets{MaxBuildMemory: 4 << 10}, ext4.BudgetBuildMemory},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			img, err := build(context.Background(), []string{layer}, dir, Options{Budgets: tc.budgets})
			if err == nil {
				img.Close()
				t.Fatalf("200 directories under %+v: built", tc.budgets)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %s", err, tc.want)
			}
			var be *ext4.BudgetError
			if tc.want != "max_entries" && !errors.As(err, &be) {
				t.Errorf("error %q is not an ext4.BudgetError", err)
			}
			if left, _ := os.ReadDir(dir); len(left) != 0 {
				t.Errorf("refused build left %d entries in its directory", len(left))
			}
		})
	}
	img, err := build(context.Background(), []string{layer}, t.TempDir(), Options{})
	if err != nil {
		t.Fatalf("default budgets: %v", err)
	}
	img.Close()
}

// build indexes layers (lowest first; a plain directory is one layer) and
// synthesizes the image into dir/image.
func build(ctx context.Context, layers []string, dir string, opts Options) (*ext4.Image, error) {
	idx, err := overlayfs.FromLayers(ctx, layers, opts.Budgets.indexOptions(opts.CacheDir, opts.LayerKeys))
	if err != nil {
		return nil, fmt.Errorf("imagefs-blk: index rootfs: %w", err)
	}
	return synthesize(ctx, idx, dir, opts)
}
