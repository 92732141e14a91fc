package ext4

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/blk/index"
)

// emptyDirsIndex is n empty directories under the root.
func emptyDirsIndex(n int) *index.Index {
	ents := []index.Entry{{Path: ".", Type: index.TypeDir, Mode: 0o755}}
	for i := 0; i < n; i++ {
		ents = append(ents, index.Entry{Path: fmt.Sprintf("d%06d", i), Type: index.TypeDir, Mode: 0o755})
	}
	return &index.Index{Entries: ents}
}

// TestBudgetsNamed builds 5,000 empty directories (20 MiB of metadata)
// under budgets too small for them: each refusal is a BudgetError naming
// its budget, and the defaults build them.
func TestBudgetsNamed(t *testing.T) {
	idx := emptyDirsIndex(5000)
	for _, c := range []struct {
		opts   Options
		budget string
	}{
		{Options{MaxMetadataBytes: 8 << 20}, BudgetMetadata},
		{Options{MaxBuildMemory: 1 << 20}, BudgetBuildMemory},
	} {
		_, err := Build(context.Background(), idx, c.opts)
		var be *BudgetError
		if !errors.As(err, &be) || be.Budget != c.budget || !strings.Contains(err.Error(), c.budget) || be.Need <= be.Limit {
			t.Errorf("%+v: %v; want a BudgetError naming %s", c.opts, err, c.budget)
		}
	}
	img, err := Build(context.Background(), idx, Options{})
	must(t, err)
	defer img.Close()
	if img.Manifest.MetaBytes < 5000*4096 {
		t.Errorf("%d metadata bytes for 5000 directories", img.Manifest.MetaBytes)
	}
	if _, err := Build(context.Background(), idx, Options{MaxMetadataBytes: -1}); err == nil {
		t.Error("a negative budget accepted")
	}
}
