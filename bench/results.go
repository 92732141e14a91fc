package bench

import (
	"bufio"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Workload describes one measured quantity of the workload script.
type Workload struct {
	Name  string
	Label string
	Unit  string // s, MB/s, IOPS, ops/s
	Group string // chart and table the workload belongs to
}

// HigherIsBetter says whether a bigger value means faster.
func (w Workload) HigherIsBetter() bool { return w.Unit != "s" }

// Chart and table groups.
const (
	GroupTree  = "Tree and metadata workloads (seconds, lower is better)"
	GroupApps  = "Applications (seconds, lower is better)"
	GroupBytes = "Throughput (MB/s, higher is better)"
	GroupIOPS  = "Random I/O (IOPS, higher is better)"
)

// Workloads lists what the script measures, in report order; coldstart
// comes from the driver, not the script.
func Workloads() []Workload {
	return []Workload{
		{"install", "install: extract node_modules tarball", "s", GroupTree},
		{"install-sync", "install + sync", "s", GroupTree},
		{"chown", "chown -R node_modules", "s", GroupTree},
		{"chown-sync", "chown -R + sync", "s", GroupTree},
		{"stat", "stat every entry of node_modules", "s", GroupTree},
		{"find", "find -name '*.json' over node_modules", "s", GroupTree},
		{"rm", "rm -rf the installed tree", "s", GroupTree},
		{"rm-sync", "rm -rf + sync", "s", GroupTree},
		{"rg", "rg over node_modules", "s", GroupApps},
		{"sqlite-insert", "sqlite3 inserts in transactions", "s", GroupApps},
		{"sqlite-select", "sqlite3 indexed selects", "s", GroupApps},
		{"coldstart", "cold start: run to the process's first output", "s", GroupApps},
		{"fio-seqread", "fio 128k sequential read", "MB/s", GroupBytes},
		{"fio-seqwrite", "fio 128k sequential write", "MB/s", GroupBytes},
		{"dbench", "dbench", "MB/s", GroupBytes},
		{"fio-randread", "fio 4k random read", "IOPS", GroupIOPS},
		{"fio-randwrite", "fio 4k random write", "IOPS", GroupIOPS},
	}
}

// Output is what one run of the workload script reported.
type Output struct {
	Samples  map[string][]float64 `json:"samples"`
	Units    map[string]string    `json:"units,omitempty"`
	Failures map[string][]string  `json:"failures,omitempty"`
	Info     map[string]string    `json:"info,omitempty"`
	Started  bool                 `json:"started"`
	Done     bool                 `json:"done"`
	// sampleRep is the repetition of each of Samples' values, and tried the
	// last repetition each name reported (result or failure): the
	// script runs repetition-major, so they tell where a hung boot stopped.
	sampleRep map[string][]int
	tried     map[string]int
	// hung is the workload a hung boot was charged with, once it has been.
	hung string
}

// repsDone is how many whole repetitions the script reported (@@INFO
// reps_done), 0 when it reported none.
func (o *Output) repsDone() int {
	n, err := strconv.Atoi(o.Info["reps_done"])
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// dropRep removes name's samples of repetition rep.
func (o *Output) dropRep(name string, rep int) {
	v, reps := o.Samples[name], o.sampleRep[name]
	if len(v) != len(reps) {
		return // not from ParseOutput: the repetitions are unknown
	}
	var keptV []float64
	var keptR []int
	for i := range v {
		if reps[i] != rep {
			keptV, keptR = append(keptV, v[i]), append(keptR, reps[i])
		}
	}
	if len(keptV) == 0 {
		delete(o.Samples, name)
		delete(o.sampleRep, name)
		return
	}
	o.Samples[name], o.sampleRep[name] = keptV, keptR
}

// maxLine bounds one protocol line; the script's lines are short.
const maxLine = 64 << 10

// ParseOutput reads the workload script's line protocol (@@START, @@INFO,
// @@RESULT, @@FAIL, @@DONE); other lines are ignored. Malformed protocol
// lines are errors: they mean the script and the driver disagree.
func ParseOutput(text string) (*Output, error) {
	o := &Output{Samples: map[string][]float64{}, Units: map[string]string{}, Failures: map[string][]string{}, Info: map[string]string{},
		sampleRep: map[string][]int{}, tried: map[string]int{}}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 4096), maxLine)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		if !strings.HasPrefix(line, "@@") {
			continue
		}
		f := strings.Fields(line)
		bad := func(why string) error { return fmt.Errorf("workload output: %s: %q", why, truncate(line, 200)) }
		switch f[0] {
		case "@@START":
			o.Started = true
		case "@@DONE":
			o.Done = true
		case "@@INFO":
			if len(f) < 2 {
				return nil, bad("INFO without a key")
			}
			o.Info[f[1]] = strings.Join(f[2:], " ")
		case "@@RESULT":
			if len(f) != 5 {
				return nil, bad("want @@RESULT workload rep value unit")
			}
			rep, err := strconv.Atoi(f[2])
			if err != nil {
				return nil, bad("repetition is not a number")
			}
			v, err := strconv.ParseFloat(f[3], 64)
			if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				return nil, bad("value is not a finite non-negative number")
			}
			if !slices.Contains([]string{"s", "MB/s", "IOPS", "ops/s"}, f[4]) {
				return nil, bad("unknown unit")
			}
			if u, ok := o.Units[f[1]]; ok && u != f[4] {
				return nil, bad("unit differs from the workload's earlier results")
			}
			o.Units[f[1]] = f[4]
			o.Samples[f[1]] = append(o.Samples[f[1]], v)
			o.sampleRep[f[1]] = append(o.sampleRep[f[1]], rep)
			o.tried[f[1]] = max(o.tried[f[1]], rep)
		case "@@FAIL":
			if len(f) < 3 {
				return nil, bad("want @@FAIL workload rep message")
			}
			o.Failures[f[1]] = append(o.Failures[f[1]], fmt.Sprintf("rep %s: %s", f[2], strings.Join(f[3:], " ")))
			if rep, err := strconv.Atoi(f[2]); err == nil {
				o.tried[f[1]] = max(o.tried[f[1]], rep)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("workload output: %w", err)
	}
	return o, nil
}

// Stats summarises repetitions: the median and the range.
type Stats struct {
	N                int
	Median, Min, Max float64
}

// Summarize computes Stats; ok is false for no samples.
func Summarize(v []float64) (Stats, bool) {
	if len(v) == 0 {
		return Stats{}, false
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	med := s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return Stats{N: n, Median: med, Min: s[0], Max: s[n-1]}, true
}

// Speedup is how many times faster a is than base for workload w (above 1: a is faster).
func Speedup(w Workload, a, base float64) float64 {
	if a <= 0 || base <= 0 {
		return math.NaN()
	}
	if w.HigherIsBetter() {
		return a / base
	}
	return base / a
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
