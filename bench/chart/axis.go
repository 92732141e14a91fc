package chart

import (
	"math"
	"strconv"
	"strings"
)

// tick is one mark on the value axis.
type tick struct {
	pos   float64 // 0 at the bars' origin, 1 at the far end of the axis
	label string  // empty for an unlabelled minor tick
	minor bool
}

// axis maps values onto [0, 1] along the plot width.
type axis struct {
	log    bool
	lo, hi float64 // linear: value range; log: decade exponents
	ticks  []tick
}

// frac is the position of a non-negative finite value, clamped to [0, 1].
func (a *axis) frac(v float64) float64 {
	var f float64
	if a.log {
		if v <= 0 {
			return 0
		}
		f = (log10(v) - a.lo) / (a.hi - a.lo)
	} else {
		f = (v - a.lo) / (a.hi - a.lo)
	}
	if math.IsNaN(f) || f < 0 {
		return 0
	}
	return math.Min(f, 1)
}

// Tick spacing needs room for the widest label plus this gap.
const (
	tickLabelGap    = 14
	minTickSpacing  = 50
	maxLinearTicks  = 200
	maxSearchSteps  = 64
	siLargestGroup  = 4 // T
	fixedMaxExp     = 15
	fixedMinExp     = -3
	siFirstExponent = 4 // 1000..9999 read better without a suffix on an axis
)

var siSuffix = [...]string{"", "k", "M", "G", "T"}

// linearAxis picks round ticks from 0 to at least maxV so that labels do not
// collide on a plot plotW pixels wide.
func linearAxis(maxV float64, plotW int) axis {
	if maxV <= 0 {
		maxV = 1 // all values are zero: any positive range shows that
	}
	target := max(plotW/90, 1)
	m, k := niceStep(maxV / float64(target))
	for range maxSearchSteps {
		step := decimal(int64(m), k)
		if step == 0 || math.IsInf(step, 0) {
			break
		}
		n := math.Ceil(maxV/step - 1e-9)
		top := decimal(int64(n)*int64(m), k)
		if n < 1 || n > maxLinearTicks || math.IsInf(top, 0) {
			if n > maxLinearTicks {
				m, k = nextStep(m, k)
				continue
			}
			break
		}
		q := siGroup(top)
		// The tolerance in n may leave top a hair below maxV; frac clamps.
		a := axis{lo: 0, hi: math.Max(top, maxV)}
		widest := 0
		for i := 0; i <= int(n); i++ {
			label := formatScaled(int64(i)*int64(m), k, q)
			widest = max(widest, textWidth(label, 1))
			a.ticks = append(a.ticks, tick{pos: float64(i) / n, label: label})
		}
		spacing := float64(plotW) / n
		if n == 1 || spacing >= float64(max(widest+tickLabelGap, minTickSpacing)) {
			return a
		}
		m, k = nextStep(m, k)
	}
	// Values too close to the float limits for round steps: label the ends.
	return axis{lo: 0, hi: maxV, ticks: []tick{{pos: 0, label: "0"}, {pos: 1, label: formatValue(maxV)}}}
}

// niceStep rounds raw up to m*10^k with m in {1, 2, 5}.
func niceStep(raw float64) (m, k int) {
	if !(raw > 0) || math.IsInf(raw, 0) {
		return 1, 0
	}
	k = int(math.Floor(log10(raw)))
	f := raw / decimal(1, k)
	switch {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return 1, k
	case f <= 1:
		return 1, k
	case f <= 2:
		return 2, k
	case f <= 5:
		return 5, k
	default:
		return 1, k + 1
	}
}

// nextStep is the next larger round step after m*10^k.
func nextStep(m, k int) (int, int) {
	switch m {
	case 1:
		return 2, k
	case 2:
		return 5, k
	default:
		return 1, k + 1
	}
}

// logAxis spans whole decades around [minV, maxV], both positive.
func logAxis(minV, maxV float64, plotW int) axis {
	lo := math.Floor(log10(minV))
	if log10(minV) == lo {
		// Keep the smallest bar visible instead of starting the axis at it.
		lo--
	}
	hi := math.Ceil(log10(maxV))
	if hi <= lo {
		hi = lo + 1
	}
	a := axis{log: true, lo: lo, hi: hi}
	decades := int(hi - lo)
	perDecade := float64(plotW) / float64(decades)

	widest := 0
	for e := int(lo); e <= int(hi); e++ {
		widest = max(widest, textWidth(decadeLabel(e), 1))
	}
	every := 1
	for float64(every)*perDecade < float64(widest+tickLabelGap) && every < decades {
		every++
	}
	for i := 0; i <= decades; i++ {
		e := int(lo) + i
		label := ""
		if i%every == 0 {
			label = decadeLabel(e)
		}
		a.ticks = append(a.ticks, tick{pos: float64(i) / float64(decades), label: label, minor: label == ""})
		if i == decades || perDecade < 60 {
			continue
		}
		for d := 2; d <= 9; d++ {
			label := ""
			if decades <= 2 && perDecade >= 150 && (d == 2 || d == 5) && e >= fixedMinExp && e < fixedMaxExp-1 {
				label = formatScaled(int64(d), e, siGroupExp(e))
			}
			pos := (float64(i) + math.Log10(float64(d))) / float64(decades)
			a.ticks = append(a.ticks, tick{pos: pos, label: label, minor: true})
		}
	}
	return a
}

// decadeLabel names 10^e compactly: "0.01", "100", "10k", "1e-9".
func decadeLabel(e int) string {
	if e < fixedMinExp || e >= fixedMaxExp {
		return "1e" + strconv.Itoa(e)
	}
	q := 0
	if e >= 3 {
		q = min(e/3, siLargestGroup)
	}
	return formatScaled(1, e, q)
}

// siGroup is the SI suffix index used for axis labels up to top.
func siGroup(top float64) int {
	if !(top > 0) || math.IsInf(top, 0) {
		return 0
	}
	return siGroupExp(int(math.Floor(log10(top))))
}

// siGroupExp is the SI suffix index for a number with decimal exponent e,
// or -1 when such numbers are written in exponent notation.
func siGroupExp(e int) int {
	switch {
	case e < fixedMinExp || e >= fixedMaxExp:
		return -1
	case e < siFirstExponent:
		return 0
	default:
		return min(e/3, siLargestGroup)
	}
}

// formatScaled writes n*10^k exactly in decimal, divided by 1000^q with the
// matching SI suffix, without trailing fractional zeros; q < 0 selects
// exponent notation instead.
func formatScaled(n int64, k, q int) string {
	if n == 0 {
		return "0"
	}
	if q < 0 {
		return strconv.FormatFloat(decimal(n, k), 'g', 3, 64)
	}
	exp := k - 3*q
	digits := strconv.FormatInt(n, 10)
	var s string
	if exp >= 0 {
		s = digits + strings.Repeat("0", exp)
	} else {
		frac := -exp
		if len(digits) <= frac {
			digits = strings.Repeat("0", frac-len(digits)+1) + digits
		}
		s = digits[:len(digits)-frac] + "." + digits[len(digits)-frac:]
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s + siSuffix[q]
}

// formatValue prints a non-negative finite value rounded to 3 significant
// digits (trailing zeros dropped, as bar labels read better as "58" than
// "58.0"), with k/M/G/T suffixes from 1000 up and exponent notation at the
// extremes.
func formatValue(v float64) string {
	if v == 0 {
		return "0"
	}
	s := strconv.FormatFloat(v, 'e', 2, 64) // d.dde±XX
	mant, expStr, ok := strings.Cut(s, "e")
	if !ok || len(mant) != 4 {
		return s
	}
	exp, err := strconv.Atoi(expStr)
	if err != nil {
		return s
	}
	if exp < fixedMinExp || exp >= fixedMaxExp {
		return strings.TrimRight(strings.TrimRight(mant, "0"), ".") + "e" + expStr
	}
	n, err := strconv.ParseInt(mant[:1]+mant[2:], 10, 64)
	if err != nil {
		return s
	}
	q := 0
	if exp >= 3 {
		q = min(exp/3, siLargestGroup)
	}
	return formatScaled(n, exp-2, q)
}

// decimal is the float nearest to n*10^k; unlike math.Pow10 products it is
// correctly rounded for subnormal results and yields ±Inf or 0 beyond range.
func decimal(n int64, k int) float64 {
	f, _ := strconv.ParseFloat(strconv.FormatInt(n, 10)+"e"+strconv.Itoa(k), 64)
	return f
}

// log10 is math.Log10 made accurate for subnormal inputs, where the library
// function is off by whole decades.
func log10(v float64) float64 {
	if v > 0 && v < 0x1p-1022 {
		return math.Log10(v*0x1p64) - 64*math.Log10(2)
	}
	return math.Log10(v)
}
