package chart

import (
	"math"
	"strconv"
	"testing"
)

func TestFormatValue(t *testing.T) {
	cases := []struct {
		v    float64
		want string
	}{
		{0, "0"},
		{1, "1"},
		{1.07, "1.07"},
		{12.5, "12.5"},
		{58, "58"},
		{0.52, "0.52"},
		{2.81, "2.81"},
		{999.6, "1k"},
		{1234, "1.23k"},
		{2810, "2.81k"},
		{182000, "182k"},
		{182456, "182k"},
		{2.5e6, "2.5M"},
		{7.77e9, "7.77G"},
		{3e13, "30T"},
		{1e15, "1e+15"},
		{0.001234, "0.00123"},
		{0.0001234, "1.23e-04"},
		{5e-324, "4.94e-324"},
		{math.MaxFloat64, "1.8e+308"},
	}
	for _, c := range cases {
		if got := formatValue(c.v); got != c.want {
			t.Errorf("formatValue(%g) = %q, want %q", c.v, got, c.want)
		}
	}
}

// TestFormatValueThreeDigits checks the rounding against strconv over a
// spread of magnitudes in the fixed-notation range.
func TestFormatValueThreeDigits(t *testing.T) {
	for v := 0.001; v < 1e15; v *= 1.37 {
		got := formatValue(v)
		digits := 0
		for _, r := range got {
			if r >= '0' && r <= '9' {
				digits++
			}
		}
		want, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 3, 64), 64)
		// Undo the suffix to compare the value the label claims.
		mult := map[byte]float64{'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12}
		num, scale := got, 1.0
		if m, ok := mult[got[len(got)-1]]; ok {
			num, scale = got[:len(got)-1], m
		}
		parsed, err := strconv.ParseFloat(num, 64)
		if err != nil {
			t.Fatalf("formatValue(%g) = %q: not a number", v, got)
		}
		if math.Abs(parsed*scale-want) > want*1e-9 {
			t.Errorf("formatValue(%g) = %q, means %g, want %g", v, got, parsed*scale, want)
		}
	}
}

func TestLinearAxisTicks(t *testing.T) {
	cases := []struct {
		max    float64
		plotW  int
		labels []string
	}{
		{2810, 560, []string{"0", "500", "1000", "1500", "2000", "2500", "3000"}},
		{1, 560, []string{"0", "0.2", "0.4", "0.6", "0.8", "1"}},
		{0, 560, []string{"0", "0.2", "0.4", "0.6", "0.8", "1"}},
		{182000, 560, []string{"0", "50k", "100k", "150k", "200k"}},
		{2.43, 100, []string{"0", "5"}},
		{7.5e6, 560, []string{"0", "2M", "4M", "6M", "8M"}},
	}
	for _, c := range cases {
		a := linearAxis(c.max, c.plotW)
		var got []string
		for _, tk := range a.ticks {
			got = append(got, tk.label)
		}
		if !equal(got, c.labels) {
			t.Errorf("linearAxis(%g, %d) labels %q, want %q", c.max, c.plotW, got, c.labels)
		}
		if a.hi < c.max {
			t.Errorf("linearAxis(%g): axis ends at %g, below the largest value", c.max, a.hi)
		}
		if a.ticks[len(a.ticks)-1].pos != 1 || a.ticks[0].pos != 0 {
			t.Errorf("linearAxis(%g): ticks do not span the axis: %+v", c.max, a.ticks)
		}
	}
}

func TestLinearAxisExtremes(t *testing.T) {
	for _, m := range []float64{5e-324, 1e-310, math.MaxFloat64, 9e307, 1e-5, 1e20} {
		a := linearAxis(m, 400)
		if len(a.ticks) < 2 || a.hi < m || math.IsInf(a.hi, 0) {
			t.Errorf("linearAxis(%g): hi=%g, %d ticks", m, a.hi, len(a.ticks))
		}
		if f := a.frac(m); !(f > 0.3 && f <= 1) {
			t.Errorf("linearAxis(%g): largest value at %g of the axis", m, f)
		}
	}
}

func TestLogAxis(t *testing.T) {
	a := logAxis(2800, 182000, 560)
	var labels []string
	for _, tk := range a.ticks {
		if tk.label != "" {
			labels = append(labels, tk.label)
		}
	}
	if !equal(labels, []string{"1k", "10k", "100k", "1M"}) {
		t.Errorf("decade labels %q", labels)
	}
	// 10^lo would have a zero-length bar; the axis starts a decade lower.
	if a := logAxis(100, 1000, 560); a.lo != 1 || a.frac(100) <= 0 {
		t.Errorf("logAxis(100, 1000): lo=%g, frac(100)=%g", a.lo, a.frac(100))
	}
	// Hundreds of decades: labels are thinned, never overlapping.
	a = logAxis(5e-324, math.MaxFloat64, 400)
	last := math.Inf(-1)
	for _, tk := range a.ticks {
		if tk.label == "" {
			continue
		}
		x := tk.pos * 400
		if x-last < float64(textWidth(tk.label, 1)) {
			t.Fatalf("labels %q overlap at x=%g (previous at %g)", tk.label, x, last)
		}
		last = x
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
