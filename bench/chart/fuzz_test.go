package chart

import (
	"bytes"
	"errors"
	"image/png"
	"math"
	"testing"
)

// FuzzRender feeds arbitrary labels, values and sizes; Render must either
// return ErrInvalid or produce a PNG of the requested size, never panic.
func FuzzRender(f *testing.F) {
	f.Add("title", "s", "a", "b", "native", 1.0, 2.0, 3.0, 4.0, uint8(2), int16(0), int16(0), false)
	f.Add("", "", "", "", "", 0.0, 0.0, 0.0, 0.0, uint8(1), int16(0), int16(0), false)
	f.Add("\xff\x00", "\u4e2d", "\n", "\t", "\xc3", math.NaN(), 1e-300, 5e-324, math.MaxFloat64, uint8(3), int16(200), int16(100), true)
	f.Add("t", "u", "x", "y", "z", math.NaN(), math.NaN(), math.NaN(), math.NaN(), uint8(4), int16(-1), int16(-1), false)
	f.Add("t", "u", "x", "y", "z", -1.0, math.Inf(1), 0.0, 1.0, uint8(10), int16(8001), int16(8000), true)
	f.Add("t", "u", "x", "y", "z", 1e15, 999.5, 0.0004999, 1.0, uint8(11), int16(61), int16(33), false)
	f.Fuzz(func(t *testing.T, title, unit, cat0, cat1, name string, v0, v1, v2, v3 float64, nSeries uint8, width, height int16, log bool) {
		c := &Chart{
			Title:      title,
			Unit:       unit,
			Categories: []string{cat0, cat1},
			Log:        log,
			Width:      int(width),
			Height:     int(height),
		}
		vals := []float64{v0, v1, v2, v3}
		for i := range int(nSeries % 13) {
			c.Series = append(c.Series, Series{
				Name:   name + string(rune('A'+i)),
				Values: []float64{vals[i%4], vals[(i+1)%4]},
			})
		}
		if nSeries%13 == 12 {
			c.Series[0].Values = c.Series[0].Values[:1]
		}
		// Large canvases are correct but slow to encode; their layout,
		// where the size checks live, is still exercised.
		if c.Width > 2000 || c.Height > 2000 {
			if err := c.validate(); err == nil {
				if _, err := c.layout(); err != nil && !errors.Is(err, ErrInvalid) {
					t.Fatalf("layout error %v does not wrap ErrInvalid", err)
				}
			}
			return
		}
		var buf bytes.Buffer
		err := c.Render(&buf)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		cfg, err := png.DecodeConfig(bytes.NewReader(buf.Bytes()))
		if err != nil {
			t.Fatalf("output is not a PNG: %v", err)
		}
		if (c.Width != 0 && cfg.Width != c.Width) || (c.Height != 0 && cfg.Height != c.Height) {
			t.Fatalf("requested %dx%d, got %dx%d", c.Width, c.Height, cfg.Width, cfg.Height)
		}
	})
}
