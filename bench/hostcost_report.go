package bench

import (
	"fmt"
	"sort"
	"strings"
)

// hostCostSection owns the host-cost pass's part of the Markdown file.
const hostCostSection = "host-cost"

// HostCostMarkdown renders a host-cost report: requests and system calls
// per workload (rows) and backend (columns), less the baseline step, then
// what they were made of.
func HostCostMarkdown(rep *HostCostReport, jsonPath string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Host cost of each workload, counted by `%s` on %s (%s CPUs, %s; %s; virtiofsd %s). Raw counts: [%s](%s).\n",
		rep.Command, rep.Date, rep.Host["cpus"], accelLabel(rep.Host["accel"]), rep.Host["qemu"], rep.Host["virtiofsd"], baseName(jsonPath), relLink(jsonPath))
	var rows []*HostCostRow
	var notes []string
	for _, r := range rep.Rows {
		if r.Skipped != "" {
			notes = append(notes, fmt.Sprintf("- %s: skipped: %s\n", r.Spec, r.Skipped))
			continue
		}
		if r.Error != "" {
			notes = append(notes, fmt.Sprintf("- %s: **failed**: %s\n", r.Spec, oneLine(r.Error, 300)))
		}
		for _, s := range sortedKeys(r.Failed) {
			notes = append(notes, fmt.Sprintf("- %s, %s: **failed**: %s\n", r.Spec, s, oneLine(r.Failed[s], 300)))
		}
		rows = append(rows, r)
	}
	if len(notes) > 0 {
		b.WriteString("\n" + strings.Join(notes, ""))
	}
	if len(rows) == 0 {
		b.WriteString("\nNo row was counted.\n")
		return b.String()
	}
	b.WriteString("\n**Requests served / system calls of the serving process / those of them that are not waits, timers or signals**, per workload, less the baseline step:\n\n")
	stepTable(&b, rep.Steps, rows, costCell)
	b.WriteString("| *baseline, as measured (not subtracted)* |")
	for _, r := range rows {
		if c, ok := r.Raw[baselineStep]; ok {
			fmt.Fprintf(&b, " *%s / %s / %s* |", requestsStr(r, c), num(c.SyscallTotal()), num(c.WorkSyscalls()))
		} else {
			b.WriteString(" — |")
		}
	}
	b.WriteString("\n\n")

	b.WriteString("**The most frequent system calls** of each cell above (net of the baseline; a negative count is one the baseline made more of):\n\n")
	stepTable(&b, rep.Steps, rows, func(r *HostCostRow, step string) string {
		c, ok := r.Net[step]
		if !ok {
			return "—"
		}
		return top(c.Syscalls, 4)
	})
	b.WriteString("\n**Requests by operation** (net of the baseline):\n\n")
	stepTable(&b, rep.Steps, rows, func(r *HostCostRow, step string) string {
		c, ok := r.Net[step]
		switch {
		case !ok:
			return "—"
		case requestSource(r.Kind) == "":
			return "not counted"
		}
		return top(c.Requests, 5)
	})
	b.WriteString("\nThe workloads (fixed amounts of work, run in the pod's container after `sync` and a drop of the guest's caches):\n\n")
	for _, st := range rep.Steps {
		fmt.Fprintf(&b, "- **%s**: %s: `%s`\n", st.Name, st.What, st.Cmd)
	}
	b.WriteString("\nHow each row was counted:\n\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "- %s: system calls of %s; requests: %s.\n", r.Spec, r.Serving, r.Requests)
	}
	return b.String()
}

// stepTable writes a table with a row per workload step but the baseline
// and a column per backend row, each cell what cell says of the pair.
func stepTable(b *strings.Builder, steps []HostCostStep, rows []*HostCostRow, cell func(r *HostCostRow, step string) string) {
	tableHead(b, "workload", rows)
	for _, st := range steps {
		if st.Name == baselineStep {
			continue
		}
		fmt.Fprintf(b, "| %s |", st.Name)
		for _, r := range rows {
			fmt.Fprintf(b, " %s |", cell(r, st.Name))
		}
		b.WriteString("\n")
	}
}

func tableHead(b *strings.Builder, first string, rows []*HostCostRow) {
	fmt.Fprintf(b, "| %s |", first)
	for _, r := range rows {
		fmt.Fprintf(b, " %s |", r.Spec)
	}
	b.WriteString("\n|---|")
	for range rows {
		b.WriteString("---:|")
	}
	b.WriteString("\n")
}

// costCell is "requests / system calls" of a workload on a row, net.
func costCell(r *HostCostRow, step string) string {
	if _, failed := r.Failed[step]; failed {
		return "failed"
	}
	c, ok := r.Net[step]
	if !ok {
		return "—"
	}
	return requestsStr(r, c) + " / " + num(c.SyscallTotal()) + " / " + num(c.WorkSyscalls())
}

func requestsStr(r *HostCostRow, c Counts) string {
	if requestSource(r.Kind) == "" {
		return "n/c"
	}
	return num(c.RequestTotal())
}

// top lists the n largest counts of m, "name count, ...", largest first.
func top(m map[string]int64, n int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	if len(keys) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range keys[:min(n, len(keys))] {
		parts = append(parts, fmt.Sprintf("%s %s", k, num(m[k])))
	}
	return strings.Join(parts, ", ")
}

// num writes n with thousands separators.
func num(n int64) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []byte
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "−" + string(out)
	}
	return string(out)
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func accelLabel(a string) string {
	if a == "" {
		return "accelerator unknown"
	}
	return a
}

func baseName(p string) string {
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return p[i+1:]
	}
	return p
}

// relLink makes a docs/ path relative to docs/benchmarks.md.
func relLink(p string) string { return strings.TrimPrefix(p, "docs/") }
