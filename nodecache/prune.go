package nodecache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Unlimited as a budget makes Prune remove nothing.
const Unlimited int64 = -1

// PruneOptions tune one Prune.
type PruneOptions struct {
	// MinAge keeps entries used more recently than this: a build may have
	// written an entry and not yet taken the lock that marks it in use.
	MinAge time.Duration
	// DryRun lists what would be removed and removes nothing.
	DryRun bool
	// Logf receives one line per removal and per kept entry; nil discards.
	Logf func(format string, args ...any)
	// Now is the clock MinAge is measured on; nil is time.Now.
	Now func() time.Time
}

// Result is what one Prune did to one cache.
type Result struct {
	Cache  string // the cache's Name
	Budget int64  // bytes; Unlimited when the cache has none
	Before int64  // bytes of the cache's entries before the prune
	After  int64  // bytes left (in a dry run: that would be left)
	// Removed are the entries removed (in a dry run: that would be), least
	// recently used first.
	Removed []Entry
	// KeptInUse are entries Prune had to keep because a pod or a build
	// holds them, while the cache was still over its budget.
	KeptInUse []Entry
	// KeptRecent are entries kept because they were used within MinAge,
	// while the cache was still over its budget.
	KeptRecent []Entry
	// Failed are entries whose removal failed for another reason.
	Failed []Failure
	DryRun bool
}

// Failure is an entry Prune could not remove and why.
type Failure struct {
	Entry Entry
	Err   error
}

// OverBudget reports whether the cache is still over its budget after the
// prune: what running pods hold, or recent entries, do not fit in it.
func (r *Result) OverBudget() bool { return r.Budget >= 0 && r.After > r.Budget }

// Summary is a one-line account of the result for logs and the command line.
func (r *Result) Summary() string {
	verb := "removed"
	if r.DryRun {
		verb = "would remove"
	}
	budget := "unlimited"
	if r.Budget >= 0 {
		budget = Size(r.Budget)
	}
	s := fmt.Sprintf("cache %s: budget %s, %s before, %s after: %s %s (%s)",
		r.Cache, budget, Size(r.Before), Size(r.After), verb, entries(len(r.Removed)), Size(sumBytes(r.Removed)))
	if r.OverBudget() {
		s += fmt.Sprintf("; still over budget: %s in use (%s), %s used recently (%s), %d failed",
			entries(len(r.KeptInUse)), Size(sumBytes(r.KeptInUse)), entries(len(r.KeptRecent)), Size(sumBytes(r.KeptRecent)), len(r.Failed))
	}
	return s
}

// Size formats a byte count for people: bytes, KiB, MiB or GiB.
func Size(n int64) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
}

// entries is "1 entry", "2 entries".
func entries(n int) string {
	if n == 1 {
		return "1 entry"
	}
	return fmt.Sprintf("%d entries", n)
}

func sumBytes(es []Entry) int64 {
	var n int64
	for _, e := range es {
		n += e.Bytes
	}
	return n
}

// Prune removes c's least recently used entries that nothing holds until
// its entries take at most budget bytes. Entries in use are never removed
// (Remove refuses them with ErrInUse even when Entries saw them free), so
// a cache whose in-use entries exceed the budget stays over it: the result
// says so. A budget of Unlimited (any negative) removes nothing; 0 removes
// every entry not in use.
func Prune(ctx context.Context, c Cache, budget int64, o PruneOptions) (Result, error) {
	logf := o.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	now := time.Now
	if o.Now != nil {
		now = o.Now
	}
	r := Result{Cache: c.Name(), Budget: budget, DryRun: o.DryRun}
	if budget < 0 {
		r.Budget = Unlimited
	}
	es, err := c.Entries(ctx)
	if err != nil {
		return r, fmt.Errorf("prune cache %s: %w", c.Name(), err)
	}
	r.Before = sumBytes(es)
	r.After = r.Before
	if budget < 0 || r.After <= budget {
		return r, nil
	}
	// Oldest first; the key breaks ties so that a prune is reproducible.
	slices.SortFunc(es, func(a, b Entry) int {
		if c := a.LastUsed.Compare(b.LastUsed); c != 0 {
			return c
		}
		return compareStrings(a.Key, b.Key)
	})
	cutoff := now().Add(-o.MinAge)
	for _, e := range es {
		if r.After <= budget {
			break
		}
		if err := ctx.Err(); err != nil {
			return r, fmt.Errorf("prune cache %s: %w", c.Name(), err)
		}
		switch {
		case e.InUse:
			r.KeptInUse = append(r.KeptInUse, e)
			logf("cache %s: kept %s (%s): in use", r.Cache, e.Key, Size(e.Bytes))
			continue
		case o.MinAge > 0 && e.LastUsed.After(cutoff):
			r.KeptRecent = append(r.KeptRecent, e)
			logf("cache %s: kept %s (%s): used %s ago, within the minimum age %s", r.Cache, e.Key, Size(e.Bytes),
				now().Sub(e.LastUsed).Round(time.Second), o.MinAge)
			continue
		}
		if o.DryRun {
			r.Removed = append(r.Removed, e)
			r.After -= e.Bytes
			logf("cache %s: would remove %s (%s, last used %s)", r.Cache, e.Key, Size(e.Bytes), e.LastUsed.UTC().Format(time.RFC3339))
			continue
		}
		err := c.Remove(ctx, e.Key)
		switch {
		case errors.Is(err, ErrInUse):
			e.InUse = true
			r.KeptInUse = append(r.KeptInUse, e)
			logf("cache %s: kept %s (%s): in use", r.Cache, e.Key, Size(e.Bytes))
			continue
		case err != nil:
			r.Failed = append(r.Failed, Failure{Entry: e, Err: err})
			logf("cache %s: could not remove %s: %v", r.Cache, e.Key, err)
			continue
		}
		r.Removed = append(r.Removed, e)
		r.After -= e.Bytes
		logf("cache %s: removed %s (%s, last used %s)", r.Cache, e.Key, Size(e.Bytes), e.LastUsed.UTC().Format(time.RFC3339))
	}
	return r, nil
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Budgeted is a cache with its budget in bytes (Unlimited for none).
type Budgeted struct {
	Cache  Cache
	Budget int64
}

// PruneAll prunes each cache to its budget, in order, and returns every
// result; one cache's failure does not stop the others.
func PruneAll(ctx context.Context, cs []Budgeted, o PruneOptions) ([]Result, error) {
	var (
		out  []Result
		errs []error
	)
	for _, b := range cs {
		r, err := Prune(ctx, b.Cache, b.Budget, o)
		out = append(out, r)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}
