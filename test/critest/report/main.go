// Command report renders docs/conformance.md from the JUnit reports
// TestCritest writes (build/critest/<containerd>/<handler>[-chunk].xml):
// one row per critest spec, one column per containerd version and runtime
// handler, and the reason for every kata-fsx result that differs from
// runc's, from the reasons file (a spec regexp and a reason per line).
package main

import (
	"bufio"
	"encoding/xml"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"
)

// The handlers in column order; runc is the reference.
var handlers = []string{"runc", "kata-fsx", "kata-fsx-virtiofs", "kata-fsx-imagefs-blk"}

// short column names keep the table readable.
var short = map[string]string{"runc": "runc", "kata-fsx": "auto", "kata-fsx-virtiofs": "vfs", "kata-fsx-imagefs-blk": "blk"}

type junit struct {
	Suites []struct {
		Cases []testcase `xml:"testcase"`
	} `xml:"testsuite"`
}

type testcase struct {
	Name    string `xml:"name,attr"`
	Status  string `xml:"status,attr"`
	Failure *struct {
		Message string `xml:"message,attr"`
		Body    string `xml:",chardata"`
	} `xml:"failure"`
	Skipped *struct {
		Message string `xml:"message,attr"`
	} `xml:"skipped"`
}

// result is one spec's outcome on one containerd and handler.
type result struct {
	status  string // passed, failed, skipped, or "" (not run)
	message string // the failure or skip message
}

// rank orders outcomes when chunks report the same spec: a spec outside
// a chunk's focus is reported as skipped with no message.
func (r result) rank() int {
	switch {
	case r.status == "passed" || r.status == "failed":
		return 3
	case r.status == "skipped" && r.message != "":
		return 2
	case r.status != "":
		return 1
	}
	return 0
}

type reason struct {
	re   *regexp.Regexp
	text string
}

func main() {
	dir := flag.String("dir", "build/critest", "directory of <containerd version>/<handler>*.xml reports")
	out := flag.String("out", "docs/conformance.md", "the document to write")
	reasonsPath := flag.String("reasons", "test/critest/reasons.txt", "spec regexp<TAB>reason lines")
	note := flag.String("note", "", "a line on how the run was made (versions, date, durations)")
	versions := flag.String("versions", "2.2,1.7", "the containerd versions (major.minor) that get columns, run or not")
	flag.Parse()
	if err := run(*dir, *out, *reasonsPath, *note, strings.Split(*versions, ",")); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
		os.Exit(1)
	}
}

func run(dir, out, reasonsPath, note string, versions []string) error {
	reasons, err := readReasons(reasonsPath)
	if err != nil {
		return err
	}
	// results[spec][version/handler]
	results := map[string]map[string]result{}
	var cols []string
	found := false
	for _, v := range versions {
		for _, h := range handlers {
			col := v + "/" + h
			cols = append(cols, col)
			files, _ := filepath.Glob(filepath.Join(dir, v, h+"*.xml"))
			for _, f := range files {
				base := strings.TrimSuffix(filepath.Base(f), ".xml")
				// kata-fsx*.xml also matches the other kata-fsx handlers.
				if base != h && (!strings.HasPrefix(base, h+"-") || isHandlerPrefix(base, h)) {
					continue
				}
				if err := readJUnit(f, col, results); err != nil {
					return err
				}
				found = true
			}
		}
	}
	if !found {
		return fmt.Errorf("no reports under %s", dir)
	}
	specs := make([]string, 0, len(results))
	for s := range results {
		specs = append(specs, s)
	}
	sort.Strings(specs)
	return os.WriteFile(out, []byte(render(specs, cols, results, reasons, note)), 0o644)
}

// isHandlerPrefix reports whether base names a longer handler than h
// (kata-fsx-virtiofs for h = kata-fsx).
func isHandlerPrefix(base, h string) bool {
	for _, o := range handlers {
		if o != h && strings.HasPrefix(o, h) && (base == o || strings.HasPrefix(base, o+"-")) {
			return true
		}
	}
	return false
}

func readJUnit(path, col string, results map[string]map[string]result) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var j junit
	if err := xml.Unmarshal(b, &j); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	for _, s := range j.Suites {
		for _, c := range s.Cases {
			name, ok := strings.CutPrefix(c.Name, "[It] ")
			if !ok || strings.Contains(name, " benchmark ") {
				continue // suite setup nodes; benchmarks run only with -benchmark
			}
			r := result{status: c.Status}
			switch {
			case c.Failure != nil:
				r.message = firstLine(c.Failure.Message)
				if r.message == "" {
					r.message = firstLine(c.Failure.Body)
				}
			case c.Skipped != nil && c.Skipped.Message != "skipped":
				// A bare "skipped" is ginkgo's word for a spec
				// outside the focus; Skip() adds its reason.
				r.message = firstLine(c.Skipped.Message)
			}
			if results[name] == nil {
				results[name] = map[string]result{}
			}
			if old := results[name][col]; r.rank() > old.rank() {
				results[name][col] = r
			}
		}
	}
	return nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}

func readReasons(path string) ([]reason, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reasons: %w", err)
	}
	defer f.Close()
	var rs []reason
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		pat, text, ok := strings.Cut(line, "\t")
		if !ok {
			return nil, fmt.Errorf("%s:%d: want 'regexp<TAB>reason'", path, n)
		}
		re, err := regexp.Compile(pat)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		rs = append(rs, reason{re, strings.TrimSpace(text)})
	}
	return rs, sc.Err()
}

func mark(r result) string {
	switch r.status {
	case "passed":
		return "pass"
	case "failed":
		return "**FAIL**"
	case "skipped":
		if r.message == "" {
			return "·"
		}
		return "skip"
	}
	return "–"
}

func render(specs, cols []string, results map[string]map[string]result, reasons []reason, note string) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	p("# CRI conformance (critest)")
	p("")
	p("Generated by `make critest` (test/critest, rendered by test/critest/report) from")
	p("cri-tools' critest v1.37.0 run against a private containerd whose CRI runtime")
	p("handlers are runc and kata-fsx: `auto` is the `kata-fsx` handler on the default")
	p("backend policy, `vfs` is `kata-fsx-virtiofs` (shared_fs = virtio-fs) and `blk` is")
	p("`kata-fsx-imagefs-blk` (shared_fs = imagefs-blk), each pinned through the")
	p("handler's ConfigPath. Images are look-alikes of critest's test images, built from")
	p("Debian's busybox-static and served by a loopback docker-registry through")
	p("hosts.toml mirrors for registry.k8s.io, gcr.io and k8s.gcr.io.")
	p("")
	p("CI runs the named subset `make critest-ci`: the specs of the Makefile's")
	p("CRITEST_FOCUS on containerd 2.x, on runc and both pinned kata-fsx handlers,")
	p("with ginkgo `-nodes 2`; every one must pass. The full run below does not fit")
	p("CI's time budget and is run by `make critest`.")
	p("")
	if note != "" {
		p("%s", note)
		p("")
	}
	p("pass / **FAIL** / skip (critest skipped it) / · (not in the run's focus) / – (no")
	p("report). The reason column explains every kata-fsx result that differs from")
	p("runc's on the same containerd, and every spec that fails everywhere; a")
	p("difference without a reason in test/critest/reasons.txt is marked")
	p("*unexplained* with the first line of the failure: a defect to fix.")
	p("")
	header := "| spec |"
	sep := "|---|"
	for _, c := range cols {
		v, h, _ := strings.Cut(c, "/")
		header += fmt.Sprintf(" %s %s |", v, short[h])
		sep += "---|"
	}
	p("%s reason |", header)
	p("%s---|", sep)
	counts := map[string]map[string]int{}
	for _, s := range specs {
		row := "| " + escape(s) + " |"
		var diff []string
		for _, c := range cols {
			r := results[s][c]
			row += " " + mark(r) + " |"
			if counts[c] == nil {
				counts[c] = map[string]int{}
			}
			counts[c][mark(r)]++
			v, h, _ := strings.Cut(c, "/")
			ref, hasRef := results[s][v+"/runc"]
			if h == "runc" {
				if r.status == "failed" {
					diff = append(diff, c+": "+r.message)
				}
				continue
			}
			ran := func(m string) bool { return m != "·" && m != "–" }
			if hasRef && ran(mark(ref)) && ran(mark(r)) && mark(ref) != mark(r) {
				diff = append(diff, c+": "+r.message)
			}
		}
		why := ""
		if len(diff) > 0 {
			why = explain(s, reasons)
			if why == "" {
				why = "*unexplained*: " + escape(diff[0])
			}
		}
		p("%s %s |", row, why)
	}
	p("")
	p("## Totals")
	p("")
	p("| column | pass | FAIL | skip | not in focus | not run |")
	p("|---|---|---|---|---|---|")
	for _, c := range cols {
		p("| %s | %d | %d | %d | %d | %d |", c, counts[c]["pass"], counts[c]["**FAIL**"], counts[c]["skip"], counts[c]["·"], counts[c]["–"])
	}
	p("")
	p("_Rendered %s._", time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	return b.String()
}

func explain(spec string, reasons []reason) string {
	for _, r := range reasons {
		if r.re.MatchString(spec) {
			return r.text
		}
	}
	return ""
}

func escape(s string) string {
	return strings.NewReplacer("|", "\\|", "\n", " ").Replace(s)
}
