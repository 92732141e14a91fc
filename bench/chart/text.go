package chart

import (
	"image"
	"image/color"
	"strings"
	"unicode/utf8"

	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Metrics of basicfont.Face7x13, the only face used; every glyph has the
// same advance, which keeps width computation exact and cheap.
const (
	glyphAdvance = 7
	glyphAscent  = 11
	lineHeight   = 13
	// maxTextRunes bounds the work spent on absurdly long labels before
	// they are truncated to the space available.
	maxTextRunes = 200
)

// Palette indices; series colours follow firstSeriesIndex.
const (
	idxBackground = iota
	idxText
	idxAxis
	idxGrid
	idxMinorGrid
	idxMuted
	firstSeriesIndex
)

// palette returns the image palette: fixed chrome colours followed by
// MaxSeries series colours chosen to stay distinguishable from each other
// and from the grey chrome.
func palette() color.Palette {
	return color.Palette{
		idxBackground: color.RGBA{0xff, 0xff, 0xff, 0xff},
		idxText:       color.RGBA{0x20, 0x20, 0x20, 0xff},
		idxAxis:       color.RGBA{0x50, 0x50, 0x50, 0xff},
		idxGrid:       color.RGBA{0xdc, 0xdc, 0xdc, 0xff},
		idxMinorGrid:  color.RGBA{0xef, 0xef, 0xef, 0xff},
		idxMuted:      color.RGBA{0x80, 0x80, 0x80, 0xff},
		// Series colours.
		color.RGBA{0x1f, 0x6f, 0xb4, 0xff}, // blue
		color.RGBA{0xf2, 0x8b, 0x1e, 0xff}, // orange
		color.RGBA{0x2e, 0xa0, 0x4a, 0xff}, // green
		color.RGBA{0xd6, 0x2f, 0x2f, 0xff}, // red
		color.RGBA{0x8a, 0x5c, 0xc2, 0xff}, // purple
		color.RGBA{0x8c, 0x56, 0x3b, 0xff}, // brown
		color.RGBA{0xe3, 0x6f, 0xb8, 0xff}, // pink
		color.RGBA{0x17, 0xb0, 0xbf, 0xff}, // cyan
		color.RGBA{0xb5, 0xb0, 0x1a, 0xff}, // olive
		color.RGBA{0x1b, 0x2f, 0x6e, 0xff}, // navy
	}
}

// seriesIndex is the palette index of series i.
func seriesIndex(i int) uint8 { return uint8(firstSeriesIndex + i) }

// sanitize maps s onto the runes the bitmap font can draw, one cell each,
// so that a label's width is simply its rune count times glyphAdvance.
func sanitize(s string) string {
	var b strings.Builder
	n := 0
	for _, r := range s {
		if n == maxTextRunes {
			break
		}
		if r == utf8.RuneError || r < 0x20 || r > 0x7e {
			r = '?'
		}
		b.WriteRune(r)
		n++
	}
	return b.String()
}

// textWidth is the width in pixels of a sanitized string at scale.
func textWidth(s string, scale int) int { return len(s) * glyphAdvance * scale }

// fit truncates a sanitized string with "..." so it is at most maxPx wide.
func fit(s string, maxPx, scale int) string {
	if textWidth(s, scale) <= maxPx {
		return s
	}
	n := maxPx / (glyphAdvance * scale)
	if n < 4 {
		return ""
	}
	return s[:n-3] + "..."
}

// drawText paints a sanitized string with its baseline at y, starting at x,
// enlarging each font pixel to a scale x scale block.
func drawText(img *image.Paletted, x, y int, s string, idx uint8, scale int) {
	face := basicfont.Face7x13
	for i, r := range s {
		gx := x + i*glyphAdvance*scale
		dr, mask, maskp, _, ok := face.Glyph(fixed.P(0, 0), r)
		if !ok {
			continue
		}
		for py := dr.Min.Y; py < dr.Max.Y; py++ {
			for px := dr.Min.X; px < dr.Max.X; px++ {
				_, _, _, a := mask.At(maskp.X+px-dr.Min.X, maskp.Y+py-dr.Min.Y).RGBA()
				if a < 0x8000 {
					continue
				}
				fill(img, image.Rect(gx+px*scale, y+py*scale, gx+(px+1)*scale, y+(py+1)*scale), idx)
			}
		}
	}
}

// fill paints r, clipped to the image, with palette index idx.
func fill(img *image.Paletted, r image.Rectangle, idx uint8) {
	r = r.Intersect(img.Rect)
	for y := r.Min.Y; y < r.Max.Y; y++ {
		row := img.Pix[img.PixOffset(r.Min.X, y):img.PixOffset(r.Max.X, y)]
		for i := range row {
			row[i] = idx
		}
	}
}
