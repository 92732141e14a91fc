// Package chart renders grouped horizontal bar charts as PNG images for the
// benchmark reports that `kata-fsx bench` embeds in docs/benchmarks.md.
//
// It depends only on the standard library and the bitmap font from
// golang.org/x/image, and it draws onto a fixed palette without
// anti-aliasing, so the same Chart always encodes to the same bytes.
package chart

import (
	"errors"
	"fmt"
	"image"
	"image/png"
	"io"
	"math"
)

// MaxSize is the largest width or height, in pixels, that Render accepts.
const MaxSize = 8000

// MaxPixels caps width*height so a single chart cannot allocate more than
// this many bytes of paletted image.
const MaxPixels = 16_000_000

// MaxSeries is the number of distinct colours in the palette and hence the
// largest number of series a chart may have.
const MaxSeries = 10

// ErrInvalid is wrapped by every error Render returns for a chart it refuses to draw.
var ErrInvalid = errors.New("chart: invalid chart")

// Series is one bar per category in a single colour, typically one backend.
type Series struct {
	// Name is shown in the legend.
	Name string
	// Values[i] is the value for Chart.Categories[i]; NaN marks a missing
	// result, drawn as an "n/a" label without a bar.
	Values []float64
}

// Chart describes a grouped horizontal bar chart: one group per category,
// one bar per series inside each group, each bar labelled with its value
// unless a requested Height makes bars thinner than the font.
type Chart struct {
	// Title is drawn large above the legend; empty means no title.
	Title string
	// Unit labels the value axis, e.g. "seconds (lower is better)".
	Unit string
	// Categories names the groups (workloads), top to bottom.
	Categories []string
	// Series holds the bars of each group (backends), one colour each.
	Series []Series
	// Log selects a base-10 logarithmic value axis, for values spanning
	// orders of magnitude; all non-NaN values must then be positive.
	Log bool
	// Width and Height are the image size in pixels; 0 picks a size that
	// grows with the label lengths and the number of bars.
	Width, Height int
}

// Render validates the chart and writes it to w as a PNG image.
func (c *Chart) Render(w io.Writer) error {
	img, err := c.draw()
	if err != nil {
		return err
	}
	if err := png.Encode(w, img); err != nil {
		return fmt.Errorf("chart: encode png: %w", err)
	}
	return nil
}

// validate checks everything that does not depend on the layout.
func (c *Chart) validate() error {
	if c == nil {
		return fmt.Errorf("%w: nil chart", ErrInvalid)
	}
	if len(c.Categories) == 0 {
		return fmt.Errorf("%w: no categories", ErrInvalid)
	}
	if len(c.Series) == 0 {
		return fmt.Errorf("%w: no series", ErrInvalid)
	}
	if len(c.Series) > MaxSeries {
		return fmt.Errorf("%w: %d series, at most %d have distinct colours", ErrInvalid, len(c.Series), MaxSeries)
	}
	if c.Width < 0 || c.Height < 0 {
		return fmt.Errorf("%w: negative size %dx%d", ErrInvalid, c.Width, c.Height)
	}
	if c.Width > MaxSize || c.Height > MaxSize {
		return fmt.Errorf("%w: size %dx%d exceeds %d px", ErrInvalid, c.Width, c.Height, MaxSize)
	}
	present := 0
	for si, s := range c.Series {
		if len(s.Values) != len(c.Categories) {
			return fmt.Errorf("%w: series %d (%q) has %d values for %d categories",
				ErrInvalid, si, sanitize(s.Name), len(s.Values), len(c.Categories))
		}
		for ci, v := range s.Values {
			switch {
			case math.IsNaN(v):
				continue
			case math.IsInf(v, 0):
				return fmt.Errorf("%w: series %q, category %q: infinite value",
					ErrInvalid, sanitize(s.Name), sanitize(c.Categories[ci]))
			case v < 0:
				return fmt.Errorf("%w: series %q, category %q: negative value %g",
					ErrInvalid, sanitize(s.Name), sanitize(c.Categories[ci]), v)
			case v == 0 && c.Log:
				return fmt.Errorf("%w: series %q, category %q: zero cannot be shown on a log scale",
					ErrInvalid, sanitize(s.Name), sanitize(c.Categories[ci]))
			}
			present++
		}
	}
	if present == 0 {
		return fmt.Errorf("%w: every value is NaN (missing)", ErrInvalid)
	}
	return nil
}

// draw validates, lays out and paints the chart.
func (c *Chart) draw() (*image.Paletted, error) {
	if err := c.validate(); err != nil {
		return nil, err
	}
	l, err := c.layout()
	if err != nil {
		return nil, err
	}
	return c.paint(l), nil
}
