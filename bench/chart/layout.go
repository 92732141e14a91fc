package chart

import (
	"fmt"
	"image"
	"math"
)

// Layout constants in pixels; the bitmap font is 7x13.
const (
	margin          = 12
	titleScale      = 2
	titleGap        = 10
	swatchSize      = 11
	swatchTextGap   = 5
	legendEntryGap  = 18
	legendRowHeight = lineHeight + 5
	legendGap       = 8
	labelPad        = 8 // between category labels and the axis
	valuePad        = 4 // between a bar's end and its value label
	tickLen         = 4
	unitGap         = 6
	defaultPlotW    = 560
	minDefaultW     = 480
	minPlotW        = 60
	defaultPitch    = 18  // vertical pixels per bar, gap included
	barFill         = 0.8 // share of the pitch the bar covers
	groupGapRatio   = 0.7 // gap between groups, in pitches
	minPitch        = 2
	minLabelPitch   = 11 // below this, value labels would overlap
	// axisEndReserve leaves room for half of the last tick label.
	axisEndReserve = 4*glyphAdvance + 2
	naLabel        = "n/a"
)

type legendEntry struct {
	x, y int // swatch top-left
	name string
	idx  uint8
}

// layout is every position paint needs, computed once from the chart.
type layout struct {
	w, h         int
	title        string
	titleScale   int
	titleBase    int
	legend       []legendEntry
	plot         image.Rectangle
	pitch        float64
	groupH       float64
	categories   []string
	values       [][]string // per series, per category; naLabel for NaN
	unit         string
	showValues   bool
	showCategory bool
	axis         axis
}

// layout sizes the image and places title, legend, plot and axis.
func (c *Chart) layout() (*layout, error) {
	nCat, nSer := len(c.Categories), len(c.Series)
	l := &layout{
		categories: make([]string, nCat),
		values:     make([][]string, nSer),
		unit:       sanitize(c.Unit),
	}

	labelW := 0
	for i, name := range c.Categories {
		l.categories[i] = sanitize(name)
		labelW = max(labelW, textWidth(l.categories[i], 1))
	}
	valueW := textWidth(naLabel, 1)
	minV, maxV := math.Inf(1), 0.0
	for si, s := range c.Series {
		l.values[si] = make([]string, nCat)
		for ci, v := range s.Values {
			if math.IsNaN(v) {
				l.values[si][ci] = naLabel
				continue
			}
			l.values[si][ci] = formatValue(v)
			valueW = max(valueW, textWidth(l.values[si][ci], 1))
			minV, maxV = math.Min(minV, v), math.Max(maxV, v)
		}
	}
	reserve := max(valuePad+valueW+2, axisEndReserve)
	title := sanitize(c.Title)

	// Width.
	l.w = c.Width
	if l.w == 0 {
		l.w = 2*margin + labelW + labelPad + defaultPlotW + reserve
		l.w = max(l.w, minDefaultW, textWidth(title, titleScale)+2*margin)
		l.w = min(l.w, MaxSize)
	}
	labelW = min(labelW, l.w*2/5)
	plotW := l.w - 2*margin - labelW - labelPad - reserve
	if plotW < minPlotW {
		return nil, fmt.Errorf("%w: width %d leaves %d px for bars, need %d", ErrInvalid, l.w, plotW, minPlotW)
	}
	for i, s := range l.categories {
		l.categories[i] = fit(s, labelW, 1)
	}
	// A title too long for the large font is still better read whole in the small one.
	l.titleScale = titleScale
	if textWidth(title, titleScale) > l.w-2*margin {
		l.titleScale = 1
	}
	l.title = fit(title, l.w-2*margin, l.titleScale)
	l.unit = fit(l.unit, plotW+reserve, 1)

	// Top: title, then legend rows that wrap at the right margin.
	y := margin
	if l.title != "" {
		l.titleBase = y + glyphAscent*l.titleScale
		y += lineHeight*l.titleScale + titleGap
	}
	x := margin
	nameMax := l.w - 2*margin - swatchSize - swatchTextGap
	for si, s := range c.Series {
		name := fit(sanitize(s.Name), nameMax, 1)
		entryW := swatchSize + swatchTextGap + textWidth(name, 1)
		if x > margin && x+entryW > l.w-margin {
			x = margin
			y += legendRowHeight
		}
		l.legend = append(l.legend, legendEntry{x: x, y: y + (lineHeight-swatchSize)/2, name: name, idx: seriesIndex(si)})
		x += entryW + legendEntryGap
	}
	y += legendRowHeight + legendGap
	plotTop := y

	bottom := tickLen + 2 + lineHeight + margin
	if l.unit != "" {
		bottom += unitGap + lineHeight
	}

	// Height: either grow with the bars or fit the bars into what was asked.
	groups := float64(nCat) * (float64(nSer) + groupGapRatio)
	l.h = c.Height
	if l.h == 0 {
		need := float64(plotTop+bottom) + groups*defaultPitch
		if need > MaxSize {
			return nil, fmt.Errorf("%w: %d bars need %.0f px height, more than %d", ErrInvalid, nCat*nSer, need, MaxSize)
		}
		l.h = int(math.Ceil(need))
	}
	plotH := l.h - plotTop - bottom
	l.pitch = float64(plotH) / groups
	if plotH <= 0 || l.pitch < minPitch {
		return nil, fmt.Errorf("%w: height %d is too small for %d bars", ErrInvalid, l.h, nCat*nSer)
	}
	if int64(l.w)*int64(l.h) > MaxPixels {
		return nil, fmt.Errorf("%w: %dx%d exceeds %d pixels", ErrInvalid, l.w, l.h, MaxPixels)
	}
	l.groupH = l.pitch * (float64(nSer) + groupGapRatio)
	l.showValues = l.pitch >= minLabelPitch
	l.showCategory = l.groupH >= lineHeight

	left := margin + labelW + labelPad
	l.plot = image.Rect(left, plotTop, left+plotW, plotTop+plotH)
	if c.Log {
		l.axis = logAxis(minV, maxV, plotW)
	} else {
		l.axis = linearAxis(maxV, plotW)
	}
	return l, nil
}

// bar is the rectangle a value occupies; its width may be zero.
func (l *layout) bar(ci, si int, v float64) image.Rectangle {
	top := float64(l.plot.Min.Y) + float64(ci)*l.groupH + l.pitch*(groupGapRatio/2+float64(si))
	y0 := int(math.Round(top))
	y1 := max(int(math.Round(top+l.pitch*barFill)), y0+1)
	x1 := l.plot.Min.X + int(math.Round(l.axis.frac(v)*float64(l.plot.Dx())))
	return image.Rect(l.plot.Min.X, y0, x1, y1)
}

// paint draws the laid-out chart onto a fresh paletted image.
func (c *Chart) paint(l *layout) *image.Paletted {
	img := image.NewPaletted(image.Rect(0, 0, l.w, l.h), palette())
	p := l.plot

	if l.title != "" {
		drawText(img, (l.w-textWidth(l.title, l.titleScale))/2, l.titleBase, l.title, idxText, l.titleScale)
	}
	for _, e := range l.legend {
		fill(img, image.Rect(e.x, e.y, e.x+swatchSize, e.y+swatchSize), e.idx)
		drawText(img, e.x+swatchSize+swatchTextGap, e.y+swatchSize-1, e.name, idxText, 1)
	}

	// Grid behind the bars.
	for _, t := range l.axis.ticks {
		x := p.Min.X + int(math.Round(t.pos*float64(p.Dx())))
		idx := uint8(idxGrid)
		if t.minor {
			idx = idxMinorGrid
		}
		fill(img, image.Rect(x, p.Min.Y, x+1, p.Max.Y), idx)
	}

	for si, s := range c.Series {
		for ci, v := range s.Values {
			r := l.bar(ci, si, v)
			if !math.IsNaN(v) {
				fill(img, r, seriesIndex(si))
			}
			if !l.showValues {
				continue
			}
			idx := uint8(idxText)
			if math.IsNaN(v) {
				idx = idxMuted
			}
			drawText(img, r.Max.X+valuePad, centerBaseline(r.Min.Y, r.Max.Y), l.values[si][ci], idx, 1)
		}
	}

	// Axes over the bars' roots, ticks and their labels below the plot.
	fill(img, image.Rect(p.Min.X-1, p.Min.Y, p.Min.X, p.Max.Y+1), idxAxis)
	fill(img, image.Rect(p.Min.X-1, p.Max.Y, p.Max.X+1, p.Max.Y+1), idxAxis)
	for _, t := range l.axis.ticks {
		x := p.Min.X + int(math.Round(t.pos*float64(p.Dx())))
		length := tickLen
		if t.minor {
			length = tickLen / 2
		}
		fill(img, image.Rect(x, p.Max.Y+1, x+1, p.Max.Y+1+length), idxAxis)
		if t.label != "" {
			tw := textWidth(t.label, 1)
			lx := min(max(x-tw/2, 0), l.w-tw)
			drawText(img, lx, p.Max.Y+1+tickLen+2+glyphAscent, t.label, idxText, 1)
		}
	}
	if l.unit != "" {
		tw := textWidth(l.unit, 1)
		ux := min(max(p.Min.X+(p.Dx()-tw)/2, 0), l.w-tw)
		drawText(img, ux, p.Max.Y+1+tickLen+2+lineHeight+unitGap+glyphAscent, l.unit, idxText, 1)
	}

	if l.showCategory {
		for ci, name := range l.categories {
			top := float64(p.Min.Y) + float64(ci)*l.groupH
			base := centerBaseline(int(math.Round(top)), int(math.Round(top+l.groupH)))
			drawText(img, p.Min.X-labelPad-textWidth(name, 1), base, name, idxText, 1)
		}
	}
	return img
}

// centerBaseline is the baseline that centres digits and capitals, which
// span roughly the 9 rows above the baseline in the 7x13 font, in [y0, y1).
func centerBaseline(y0, y1 int) int { return (y0+y1)/2 + 5 }
