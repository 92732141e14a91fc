package bench

import "time"

// defaultBootCost is what one pod boot is taken to cost before the row has
// timed one: about what a TCG boot to the first output takes here.
const defaultBootCost = 15 * time.Second

// budgetShare is a row's part of the matrix budget when it starts: what is
// left of total after spent, divided among the rows still to run, this one
// included. Rows share out what earlier ones did not use, so a fast row's
// leftover goes to the slow ones after it. Nothing left gives 0, which the
// row's script budget turns into a single repetition.
func budgetShare(total, spent time.Duration, rowsLeft int) time.Duration {
	left := total - spent
	if left <= 0 || rowsLeft < 1 {
		return 0
	}
	return left / time.Duration(rowsLeft)
}

// budgetSecs is BENCH_BUDGET_SECS for a workload run starting now: the
// row's share less what the row has spent already (image copy or export,
// a hung boot) and the boots still ahead of it, at least 1 s, so even a
// spent budget runs repetition 1 and no row is skipped.
func budgetSecs(share, rowSpent time.Duration, boots int, perBoot time.Duration) int {
	left := share - rowSpent - time.Duration(boots)*perBoot
	return max(1, int(left/time.Second))
}

// runnable counts the rows that will run on this host: skipped ones (DAX
// without QEMU support, no root) take no share.
func runnable(rows []Row, caps HostCaps) int {
	n := 0
	for _, r := range rows {
		if r.SkipReason(caps) == "" {
			n++
		}
	}
	return n
}

// rowClock is what a row needs to give its workload script a budget.
type rowClock struct {
	share   time.Duration // the row's part of the matrix budget
	started time.Time
}

// scriptBudget is BENCH_BUDGET_SECS for a workload run of the row starting
// now with boots pod starts still ahead (its own included), each costing
// perBoot; 0 (no budget) when the matrix has none.
func (d *driver) scriptBudget(c rowClock, boots int, perBoot time.Duration) int {
	if d.o.Budget <= 0 {
		return 0
	}
	return budgetSecs(c.share, time.Since(c.started), boots, perBoot)
}
