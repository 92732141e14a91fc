package pci

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestParsePCIPath(t *testing.T) {
	good := map[string][]uint8{"02": {2}, "02/01": {2, 1}, "1f/0a/3": {0x1f, 0x0a, 3}}
	for in, want := range good {
		got, err := ParsePath(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParsePath(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "/", "02/", "02//01", "zz", "20", "123", "-1", "1/2/3/4/5/6/7/8/9", "0x2"} {
		if got, err := ParsePath(in); err == nil {
			t.Errorf("ParsePath(%q) = %v, want an error", in, got)
		}
	}
}

func FuzzParsePCIPath(f *testing.F) {
	for _, s := range []string{"02", "02/01", "1f/1f/1f/1f/1f/1f/1f/1f", "", "20", "0/0/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		slots, err := ParsePath(s)
		if err != nil {
			return
		}
		if len(slots) == 0 || len(slots) > 8 {
			t.Fatalf("%q gave %d slots", s, len(slots))
		}
		parts := make([]string, len(slots))
		for i, v := range slots {
			if v > 0x1f {
				t.Fatalf("%q gave slot %#x", s, v)
			}
			parts[i] = fmt.Sprintf("%02x", v)
		}
		again, err := ParsePath(strings.Join(parts, "/"))
		if err != nil || !slices.Equal(again, slots) {
			t.Fatalf("round trip of %q: %v, %v", s, again, err)
		}
	})
}
