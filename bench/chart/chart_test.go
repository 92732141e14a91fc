package chart

import (
	"bytes"
	"errors"
	"flag"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/example.png")

// exampleChart uses the seed measurements from the project brief.
func exampleChart() *Chart {
	return &Chart{
		Title:      "Sequential and random read, host NVMe",
		Unit:       "throughput, MB/s (higher is better)",
		Categories: []string{"seq read 128k", "4k rand read", "dbench"},
		Series: []Series{
			{Name: "native", Values: []float64{2810, 712, 186}},
			{Name: "9p", Values: []float64{520, 11, 58}},
			{Name: "virtio-fs", Values: []float64{1860, 44.1, 121}},
			{Name: "virtio-fs+DAX", Values: []float64{2430, 104, 147}},
			{Name: "imagefs-blk", Values: []float64{2650, math.NaN(), 170}},
		},
	}
}

func render(t *testing.T, c *Chart) (*image.Paletted, []byte) {
	t.Helper()
	var buf bytes.Buffer
	if err := c.Render(&buf); err != nil {
		t.Fatalf("Render: %v", err)
	}
	img, err := png.Decode(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatalf("decode rendered PNG: %v", err)
	}
	p, ok := img.(*image.Paletted)
	if !ok {
		t.Fatalf("decoded %T, want *image.Paletted", img)
	}
	return p, buf.Bytes()
}

// sameColor compares through RGBA so palette order in the file does not matter.
func sameColor(a, b color.Color) bool {
	r1, g1, b1, a1 := a.RGBA()
	r2, g2, b2, a2 := b.RGBA()
	return r1 == r2 && g1 == g2 && b1 == b2 && a1 == a2
}

// run is a maximal band of consecutive rows holding a colour; width is the
// pixel count of that colour on the band's middle row.
type run struct{ y0, y1, width int }

// colourRuns scans the decoded image for horizontal bands of colour c, top
// to bottom; bars and the legend swatch are such bands.
func colourRuns(img image.Image, c color.Color) []run {
	b := img.Bounds()
	count := func(y int) int {
		n := 0
		for x := b.Min.X; x < b.Max.X; x++ {
			if sameColor(img.At(x, y), c) {
				n++
			}
		}
		return n
	}
	var runs []run
	for y := b.Min.Y; y < b.Max.Y; y++ {
		if count(y) == 0 {
			continue
		}
		y0 := y
		for y < b.Max.Y && count(y) > 0 {
			y++
		}
		runs = append(runs, run{y0: y0, y1: y, width: count((y0 + y) / 2)})
	}
	return runs
}

func TestExamplePNG(t *testing.T) {
	img, data := render(t, exampleChart())
	if img.Bounds().Dx() < minDefaultW || img.Bounds().Dy() < 100 {
		t.Fatalf("default size %v is implausibly small", img.Bounds())
	}
	path := filepath.Join("testdata", "example.png")
	if *update {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The committed example must match the renderer, so a change in the
	// drawing is visible in review as a changed image.
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s (regenerate with go test -run TestExamplePNG -update): %v", path, err)
	}
	if !bytes.Equal(want, data) {
		t.Fatalf("%s is stale; regenerate with go test -run TestExamplePNG -update and inspect it", path)
	}
}

func TestRequestedSize(t *testing.T) {
	for _, size := range []image.Point{{640, 400}, {1200, 300}, {500, 900}} {
		c := exampleChart()
		c.Width, c.Height = size.X, size.Y
		img, _ := render(t, c)
		if got := img.Bounds().Size(); got != size {
			t.Errorf("requested %v, got %v", size, got)
		}
	}
}

func TestDefaultHeightGrowsWithBars(t *testing.T) {
	small, _ := render(t, &Chart{Categories: []string{"a"}, Series: []Series{{Name: "x", Values: []float64{1}}}})
	c := &Chart{Categories: []string{"a", "b", "c", "d"}}
	for i := range 4 {
		c.Series = append(c.Series, Series{Name: string(rune('p' + i)), Values: []float64{1, 2, 3, 4}})
	}
	large, _ := render(t, c)
	if large.Bounds().Dy() <= small.Bounds().Dy()+15*defaultPitch {
		t.Fatalf("16 bars: height %d, 1 bar: height %d; want growth of at least %d px",
			large.Bounds().Dy(), small.Bounds().Dy(), 15*defaultPitch)
	}
}

func TestEverySeriesColourAppears(t *testing.T) {
	c := &Chart{Title: "ten", Categories: []string{"w1", "w2"}}
	for i := range MaxSeries {
		c.Series = append(c.Series, Series{Name: "backend" + string(rune('0'+i)), Values: []float64{float64(i + 1), 10}})
	}
	img, _ := render(t, c)
	pal := palette()
	for i := range MaxSeries {
		runs := colourRuns(img, pal[seriesIndex(i)])
		// Legend swatch plus one bar per category.
		if len(runs) != 1+len(c.Categories) {
			t.Errorf("series %d: %d bands of its colour, want %d: %+v", i, len(runs), 1+len(c.Categories), runs)
		}
	}
}

func TestPaletteDistinct(t *testing.T) {
	pal := palette()
	if len(pal) != firstSeriesIndex+MaxSeries {
		t.Fatalf("palette has %d colours, want %d", len(pal), firstSeriesIndex+MaxSeries)
	}
	for i := range pal {
		for j := i + 1; j < len(pal); j++ {
			if sameColor(pal[i], pal[j]) {
				t.Errorf("palette entries %d and %d are both %v", i, j, pal[i])
			}
		}
	}
}

func TestBarLengthProportional(t *testing.T) {
	for _, log := range []bool{false, true} {
		c := &Chart{
			Categories: []string{"small", "medium", "large", "missing", "largest"},
			Series:     []Series{{Name: "s", Values: []float64{10, 20, 40, math.NaN(), 80}}},
			Log:        log,
		}
		img, _ := render(t, c)
		runs := colourRuns(img, palette()[seriesIndex(0)])
		// Legend swatch, then four bars: the NaN category draws none.
		if len(runs) != 5 {
			t.Fatalf("log=%v: %d bands, want legend + 4 bars: %+v", log, len(runs), runs)
		}
		bars := runs[1:]
		for i := 1; i < len(bars); i++ {
			if bars[i].width <= bars[i-1].width {
				t.Errorf("log=%v: bar %d (%d px) not longer than bar %d (%d px)", log, i, bars[i].width, i-1, bars[i-1].width)
			}
		}
		if !log {
			// Linear: doubling the value doubles the length, within rounding.
			for i := 1; i < len(bars); i++ {
				if d := bars[i].width - 2*bars[i-1].width; d < -2 || d > 2 {
					t.Errorf("linear: bar %d is %d px, bar %d is %d px; want double", i, bars[i].width, i-1, bars[i-1].width)
				}
			}
		} else {
			// Log: equal ratios give equal steps, within rounding.
			step := bars[1].width - bars[0].width
			for i := 2; i < len(bars); i++ {
				if d := bars[i].width - bars[i-1].width - step; d < -2 || d > 2 {
					t.Errorf("log: steps %d and %d px differ", step, bars[i].width-bars[i-1].width)
				}
			}
		}
	}
}

func TestNaNDrawsNoBar(t *testing.T) {
	c := &Chart{
		Categories: []string{"a", "b", "c"},
		Series: []Series{
			{Name: "ok", Values: []float64{1, 2, 3}},
			{Name: "broken", Values: []float64{math.NaN(), 2, math.NaN()}},
		},
	}
	img, _ := render(t, c)
	pal := palette()
	ok := colourRuns(img, pal[seriesIndex(0)])
	broken := colourRuns(img, pal[seriesIndex(1)])
	if len(ok) != 4 || len(broken) != 2 {
		t.Fatalf("bands: ok=%d (want 4), broken=%d (want 2: legend + one bar)", len(ok), len(broken))
	}
	// The surviving bar of "broken" sits in category b, below ok's b bar.
	if !(broken[1].y0 > ok[2].y0 && broken[1].y0 < ok[3].y0) {
		t.Errorf("broken bar at row %d, want between ok's b bar (%d) and c bar (%d)", broken[1].y0, ok[2].y0, ok[3].y0)
	}
	// The n/a label is drawn in the muted grey where a's bar would be.
	muted := 0
	row := ok[1].y1 + 2
	for y := row; y < broken[1].y0-4; y++ {
		for x := 0; x < img.Bounds().Dx(); x++ {
			if sameColor(img.At(x, y), pal[idxMuted]) {
				muted++
			}
		}
	}
	if muted == 0 {
		t.Error("no n/a label pixels found next to the missing bar")
	}
}

func TestZeroValueDrawsNoBarButIsValid(t *testing.T) {
	c := &Chart{Categories: []string{"a", "b"}, Series: []Series{{Name: "s", Values: []float64{0, 5}}}}
	img, _ := render(t, c)
	if runs := colourRuns(img, palette()[seriesIndex(0)]); len(runs) != 2 {
		t.Fatalf("%d bands, want legend + the one non-zero bar", len(runs))
	}
}

func TestDeterministic(t *testing.T) {
	_, a := render(t, exampleChart())
	for range 3 {
		_, b := render(t, exampleChart())
		if !bytes.Equal(a, b) {
			t.Fatal("two renders of the same chart differ")
		}
	}
}

func TestErrors(t *testing.T) {
	base := func() *Chart {
		return &Chart{Categories: []string{"a", "b"}, Series: []Series{{Name: "s", Values: []float64{1, 2}}}}
	}
	many := base()
	for range MaxSeries {
		many.Series = append(many.Series, Series{Values: []float64{1, 1}})
	}
	tooManyBars := &Chart{Series: make([]Series, 1)}
	for range 500 {
		tooManyBars.Categories = append(tooManyBars.Categories, "x")
		tooManyBars.Series[0].Values = append(tooManyBars.Series[0].Values, 1)
	}
	cases := map[string]*Chart{
		"nil":              nil,
		"no categories":    {Series: []Series{{Values: nil}}},
		"no series":        {Categories: []string{"a"}},
		"short series":     func() *Chart { c := base(); c.Series[0].Values = []float64{1}; return c }(),
		"long series":      func() *Chart { c := base(); c.Series[0].Values = []float64{1, 2, 3}; return c }(),
		"negative":         func() *Chart { c := base(); c.Series[0].Values[1] = -1; return c }(),
		"+inf":             func() *Chart { c := base(); c.Series[0].Values[0] = math.Inf(1); return c }(),
		"-inf":             func() *Chart { c := base(); c.Series[0].Values[0] = math.Inf(-1); return c }(),
		"all NaN":          func() *Chart { c := base(); c.Series[0].Values = []float64{math.NaN(), math.NaN()}; return c }(),
		"zero on log":      func() *Chart { c := base(); c.Log = true; c.Series[0].Values[0] = 0; return c }(),
		"too many series":  many,
		"negative width":   func() *Chart { c := base(); c.Width = -1; return c }(),
		"huge width":       func() *Chart { c := base(); c.Width = MaxSize + 1; return c }(),
		"huge height":      func() *Chart { c := base(); c.Height = 1 << 40; return c }(),
		"too many pixels":  func() *Chart { c := base(); c.Width, c.Height = MaxSize, MaxSize; return c }(),
		"too narrow":       func() *Chart { c := base(); c.Width = 50; return c }(),
		"too short":        func() *Chart { c := base(); c.Height = 40; return c }(),
		"default too tall": tooManyBars,
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			err := c.Render(&buf)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Render = %v, want ErrInvalid", err)
			}
			if buf.Len() != 0 {
				t.Errorf("wrote %d bytes despite the error", buf.Len())
			}
		})
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestWriteErrorIsReturned(t *testing.T) {
	if err := exampleChart().Render(failWriter{}); err == nil {
		t.Fatal("Render to a failing writer returned nil")
	}
}

func TestLongAndHostileLabels(t *testing.T) {
	long := string(bytes.Repeat([]byte("very-long-workload-name-"), 50))
	c := &Chart{
		Title:      long,
		Unit:       "\x00\xff\u00e9\u4e2d" + long,
		Categories: []string{long, "\n\t", ""},
		Series:     []Series{{Name: long, Values: []float64{1, 2, 3}}, {Name: "", Values: []float64{3, 2, 1}}},
		Width:      700,
	}
	img, _ := render(t, c)
	if img.Bounds().Dx() != 700 {
		t.Fatalf("width %d, want 700", img.Bounds().Dx())
	}
}
