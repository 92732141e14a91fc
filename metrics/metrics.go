// Package metrics writes and reads Prometheus' text exposition format
// (version 0.0.4): families of counters, gauges and histograms with
// labels, their HELP and TYPE lines, label value escaping, and a
// histogram's cumulative _bucket series with le, _sum and _count.
//
// It is what the shim serves on its metrics socket and what `kata-fsx
// monitor` parses and relabels; it keeps the shim free of the Prometheus
// client library (whose registry and process collectors would cost every
// pod's shim memory for what a scrape builds in a few hundred lines).
package metrics

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// ContentType is the Content-Type of the text format this package writes.
const ContentType = "text/plain; version=0.0.4; charset=utf-8"

// Type is a metric family's type, as its TYPE line says.
type Type string

// The family types of the text format.
const (
	Counter   Type = "counter"
	Gauge     Type = "gauge"
	Histogram Type = "histogram"
	Summary   Type = "summary"
	Untyped   Type = "untyped"
)

// Label is one label pair of a sample.
type Label struct {
	Name, Value string
}

// L is shorthand for a Label.
func L(name, value string) Label { return Label{Name: name, Value: value} }

// Sample is one line of a family: a series name (the family's, or with a
// histogram's _bucket, _sum or _count suffix), its labels and value.
type Sample struct {
	Name   string
	Labels []Label
	Value  float64
}

// Family is a metric family: its name, help text, type and samples.
type Family struct {
	Name    string
	Help    string
	Type    Type
	Samples []Sample
}

// Add appends a sample named after the family (a counter's or a gauge's value).
func (f *Family) Add(v float64, labels ...Label) {
	f.Samples = append(f.Samples, Sample{Name: f.Name, Labels: labels, Value: v})
}

// Buckets is a histogram's content: upper bounds ascending, the count of
// observations in each bucket (not cumulative; one more than the bounds,
// the last for observations above every bound) and their sum.
type Buckets struct {
	Bounds []float64
	Counts []uint64
	Sum    float64
}

// AddHistogram appends a histogram's series: a cumulative _bucket per
// bound and +Inf with the le label last, then _sum and _count.
func (f *Family) AddHistogram(b Buckets, labels ...Label) {
	var cum uint64
	for i, c := range b.Counts {
		cum += c
		le := "+Inf"
		if i < len(b.Bounds) {
			le = formatFloat(b.Bounds[i])
		}
		f.Samples = append(f.Samples, Sample{Name: f.Name + "_bucket", Labels: withLabel(labels, L("le", le)), Value: float64(cum)})
	}
	if len(b.Counts) <= len(b.Bounds) {
		// No overflow bucket given: +Inf holds them all.
		f.Samples = append(f.Samples, Sample{Name: f.Name + "_bucket", Labels: withLabel(labels, L("le", "+Inf")), Value: float64(cum)})
	}
	f.Samples = append(f.Samples,
		Sample{Name: f.Name + "_sum", Labels: labels, Value: b.Sum},
		Sample{Name: f.Name + "_count", Labels: labels, Value: float64(cum)})
}

// withLabel returns labels with l appended, never sharing labels' array.
func withLabel(labels []Label, l Label) []Label {
	out := make([]Label, 0, len(labels)+1)
	return append(append(out, labels...), l)
}

// Set is an exposition being assembled: families in the order first
// added, one per name.
type Set struct {
	fams   []*Family
	byName map[string]*Family
}

// Family returns the family called name, adding it with help and typ if
// it is new. A name already used with another type is an error.
func (s *Set) Family(name, help string, typ Type) (*Family, error) {
	if f, ok := s.byName[name]; ok {
		if f.Type != typ {
			return nil, fmt.Errorf("metrics: family %s is a %s, not a %s", name, f.Type, typ)
		}
		return f, nil
	}
	if !ValidMetricName(name) {
		return nil, fmt.Errorf("metrics: invalid metric name %q", name)
	}
	if s.byName == nil {
		s.byName = map[string]*Family{}
	}
	f := &Family{Name: name, Help: help, Type: typ}
	s.fams = append(s.fams, f)
	s.byName[name] = f
	return f, nil
}

// Counter returns the counter family name (see Family); it panics on a
// type clash or a bad name, which only a programming error causes.
func (s *Set) Counter(name, help string) *Family { return s.must(name, help, Counter) }

// Gauge returns the gauge family name (see Counter).
func (s *Set) Gauge(name, help string) *Family { return s.must(name, help, Gauge) }

// Histogram returns the histogram family name (see Counter).
func (s *Set) Histogram(name, help string) *Family { return s.must(name, help, Histogram) }

func (s *Set) must(name, help string, typ Type) *Family {
	f, err := s.Family(name, help, typ)
	if err != nil {
		panic(err)
	}
	return f
}

// Merge adds f's samples to the family of the same name (added if new,
// with f's help); a type clash is an error and adds nothing.
func (s *Set) Merge(f Family) error {
	if f.Type == "" {
		f.Type = Untyped
	}
	dst, err := s.Family(f.Name, f.Help, f.Type)
	if err != nil {
		return err
	}
	dst.Samples = append(dst.Samples, f.Samples...)
	return nil
}

// Families returns the families in the order first added.
func (s *Set) Families() []*Family { return s.fams }

// WriteTo writes the set in the text format. A family without samples is
// left out; a sample whose series or label names are invalid is an error.
func (s *Set) WriteTo(w io.Writer) (int64, error) {
	cw := &countWriter{w: w}
	bw := bufio.NewWriter(cw)
	for _, f := range s.fams {
		if err := writeFamily(bw, f); err != nil {
			return cw.n, err
		}
	}
	err := bw.Flush()
	return cw.n, err
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func writeFamily(w *bufio.Writer, f *Family) error {
	if len(f.Samples) == 0 {
		return nil
	}
	typ := f.Type
	if typ == "" {
		typ = Untyped
	}
	if f.Help != "" {
		fmt.Fprintf(w, "# HELP %s %s\n", f.Name, escapeHelp(f.Help))
	}
	fmt.Fprintf(w, "# TYPE %s %s\n", f.Name, typ)
	for _, sm := range f.Samples {
		if !belongs(f.Name, typ, sm.Name) {
			return fmt.Errorf("metrics: sample %q is not a series of %s family %s", sm.Name, typ, f.Name)
		}
		w.WriteString(sm.Name)
		if len(sm.Labels) > 0 {
			w.WriteByte('{')
			for i, l := range sm.Labels {
				if !ValidLabelName(l.Name) {
					return fmt.Errorf("metrics: %s: invalid label name %q", sm.Name, l.Name)
				}
				if i > 0 {
					w.WriteByte(',')
				}
				w.WriteString(l.Name)
				w.WriteString(`="`)
				w.WriteString(escapeLabelValue(l.Value))
				w.WriteByte('"')
			}
			w.WriteByte('}')
		}
		w.WriteByte(' ')
		w.WriteString(formatFloat(sm.Value))
		w.WriteByte('\n')
	}
	return nil
}

// belongs reports whether series name is one of family fam's (of type typ).
func belongs(fam string, typ Type, name string) bool {
	if name == fam {
		return typ != Histogram
	}
	suffix, ok := strings.CutPrefix(name, fam)
	if !ok {
		return false
	}
	switch typ {
	case Histogram:
		return suffix == "_bucket" || suffix == "_sum" || suffix == "_count"
	case Summary:
		return suffix == "_sum" || suffix == "_count"
	}
	return false
}

// formatFloat writes a value as the format spells it (+Inf, -Inf, NaN).
func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

// escapeHelp escapes a HELP text: backslash and line feed.
func escapeHelp(s string) string { return escape(s, false) }

// escapeLabelValue escapes a label value: backslash, double quote and line feed.
func escapeLabelValue(s string) string { return escape(s, true) }

func escape(s string, quote bool) string {
	if !strings.ContainsAny(s, "\\\n\"") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\':
			b.WriteString(`\\`)
		case c == '\n':
			b.WriteString(`\n`)
		case c == '"' && quote:
			b.WriteString(`\"`)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// ValidMetricName reports whether s matches [a-zA-Z_:][a-zA-Z0-9_:]*.
func ValidMetricName(s string) bool { return validName(s, true) }

// ValidLabelName reports whether s matches [a-zA-Z_][a-zA-Z0-9_]*.
func ValidLabelName(s string) bool { return validName(s, false) }

func validName(s string, colon bool) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z':
		case colon && c == ':':
		case i > 0 && c >= '0' && c <= '9':
		default:
			return false
		}
	}
	return true
}
