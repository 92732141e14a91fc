package metrics

import (
	"bytes"
	"context"
	"io"
	"math"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// sampleSet has every shape the package writes: a counter with labels
// needing escapes, a gauge without labels, a histogram with labels.
func sampleSet() *Set {
	var s Set
	c := s.Counter("kata_fsx_test_requests_total", "Requests served.\nSecond line with a \\ backslash.")
	c.Add(3, L("op", "read"))
	c.Add(5, L("op", `we"ird\`+"\n"), L("disk", "c1"))
	s.Gauge("kata_fsx_test_dirty_bytes", "Dirty bytes.").Add(4096)
	h := s.Histogram("kata_fsx_test_duration_seconds", "Request time.")
	h.AddHistogram(Buckets{Bounds: []float64{0.001, 0.01, 0.1}, Counts: []uint64{2, 0, 3, 1}, Sum: 0.75}, L("op", "write"))
	s.Counter("kata_fsx_test_empty_total", "A family without samples is left out.")
	return &s
}

// The Prometheus project's own parser reads what Set writes, with the
// same names, types, help, labels and values, and cumulative buckets.
func TestWriteParsesWithExpfmt(t *testing.T) {
	var buf bytes.Buffer
	if _, err := sampleSet().WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	t.Logf("exposition:\n%s", buf.String())
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatalf("expfmt: %v", err)
	}
	if len(fams) != 3 {
		t.Fatalf("families %v, want 3", keys(fams))
	}
	c := fams["kata_fsx_test_requests_total"]
	if c.GetType() != dto.MetricType_COUNTER || c.GetHelp() != "Requests served.\nSecond line with a \\ backslash." {
		t.Errorf("counter type %v help %q", c.GetType(), c.GetHelp())
	}
	if len(c.Metric) != 2 || c.Metric[1].GetCounter().GetValue() != 5 || c.Metric[1].Label[0].GetValue() != `we"ird\`+"\n" && c.Metric[1].Label[1].GetValue() != `we"ird\`+"\n" {
		t.Errorf("counter metrics %v", c.Metric)
	}
	g := fams["kata_fsx_test_dirty_bytes"]
	if g.GetType() != dto.MetricType_GAUGE || g.Metric[0].GetGauge().GetValue() != 4096 {
		t.Errorf("gauge %v", g)
	}
	h := fams["kata_fsx_test_duration_seconds"]
	if h.GetType() != dto.MetricType_HISTOGRAM || len(h.Metric) != 1 {
		t.Fatalf("histogram %v", h)
	}
	hist := h.Metric[0].GetHistogram()
	if hist.GetSampleCount() != 6 || hist.GetSampleSum() != 0.75 {
		t.Errorf("histogram count %d sum %v", hist.GetSampleCount(), hist.GetSampleSum())
	}
	wantCum := []uint64{2, 2, 5}
	for i, b := range hist.Bucket {
		if i < len(wantCum) && b.GetCumulativeCount() != wantCum[i] {
			t.Errorf("bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), wantCum[i])
		}
	}
}

func keys(m map[string]*dto.MetricFamily) []string {
	var k []string
	for n := range m {
		k = append(k, n)
	}
	return k
}

// Parse reads back what WriteTo wrote, exactly.
func TestRoundTrip(t *testing.T) {
	s := sampleSet()
	var buf bytes.Buffer
	if _, err := s.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	got, err := Parse(&buf)
	if err != nil {
		t.Fatal(err)
	}
	var want []Family
	for _, f := range s.Families() {
		if len(f.Samples) > 0 {
			want = append(want, *f)
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parsed\n%+v\nwant\n%+v", got, want)
	}
}

func TestParseForms(t *testing.T) {
	in := `# a comment
# HELP up Up.
# TYPE up gauge
up{job="a", instance = "b" ,} 1 1700000000000

plain_untyped 2.5
# TYPE h histogram
h_bucket{le="+Inf"} 3
h_sum 1e3
h_count 3
nan_value NaN
inf_value -Inf
`
	fams, err := Parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(fams) != 5 {
		t.Fatalf("%d families: %+v", len(fams), fams)
	}
	if f := fams[0]; f.Type != Gauge || f.Help != "Up." || len(f.Samples[0].Labels) != 2 || f.Samples[0].Labels[1] != L("instance", "b") {
		t.Errorf("up: %+v", f)
	}
	if f := fams[1]; f.Type != Untyped || f.Samples[0].Value != 2.5 {
		t.Errorf("untyped: %+v", f)
	}
	if f := fams[2]; f.Type != Histogram || len(f.Samples) != 3 || f.Samples[1].Value != 1000 {
		t.Errorf("histogram: %+v", f)
	}
	if !math.IsNaN(fams[3].Samples[0].Value) || !math.IsInf(fams[4].Samples[0].Value, -1) {
		t.Errorf("special values: %+v %+v", fams[3], fams[4])
	}
	for _, bad := range []string{
		"1abc 1",
		"x{a=\"1\" 1",
		"x{a=1} 1",
		"x{a=\"1\",a=\"2\"} 1",
		"x{a=\"\\q\"} 1",
		"x one",
		"x 1 2 3",
		"x 1 notatime",
		"# TYPE x bogus",
		"# TYPE x counter\n# TYPE x gauge",
		"# HELP x a\n# HELP x b",
		"x 1\ny 1\nx 2",
		"# TYPE h histogram\nh 1",
		strings.Repeat("x", MaxLine+10) + " 1",
	} {
		if fams, err := Parse(strings.NewReader(bad)); err == nil {
			t.Errorf("%.40q parsed: %+v", bad, fams)
		}
	}
}

func TestSetRefusesClashes(t *testing.T) {
	var s Set
	s.Counter("a_total", "")
	if _, err := s.Family("a_total", "", Gauge); err == nil {
		t.Error("a counter became a gauge")
	}
	if _, err := s.Family("bad-name", "", Gauge); err == nil {
		t.Error("bad name accepted")
	}
	if err := s.Merge(Family{Name: "a_total", Type: Gauge}); err == nil {
		t.Error("merge of a clashing type accepted")
	}
	f := s.Gauge("g", "")
	f.Add(1, L("bad-label", "x"))
	if _, err := s.WriteTo(io.Discard); err == nil {
		t.Error("bad label name written")
	}
	var s2 Set
	f2 := s2.Gauge("g", "")
	f2.Samples = append(f2.Samples, Sample{Name: "other", Value: 1})
	if _, err := s2.WriteTo(io.Discard); err == nil {
		t.Error("foreign series written in a family")
	}
}

// A Merge of a family parsed from another exposition adds its samples
// after the set's own: how the monitor joins pods.
func TestMerge(t *testing.T) {
	var s Set
	s.Counter("c_total", "C.").Add(1, L("sandbox_id", "a"))
	if err := s.Merge(Family{Name: "c_total", Help: "ignored", Type: Counter, Samples: []Sample{{Name: "c_total", Labels: []Label{L("sandbox_id", "b")}, Value: 2}}}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	s.WriteTo(&buf)
	want := "# HELP c_total C.\n# TYPE c_total counter\nc_total{sandbox_id=\"a\"} 1\nc_total{sandbox_id=\"b\"} 2\n"
	if buf.String() != want {
		t.Fatalf("got\n%s\nwant\n%s", buf.String(), want)
	}
}

// The unix socket server answers GET /metrics with a fresh collection per
// scrape, ScrapeUnix reads it, and Close removes the socket.
func TestServeUnixAndScrape(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "m.sock")
	n := 0
	srv, err := ServeUnix(sock, Handler(func(s *Set) {
		n++
		s.Counter("scrapes_total", "Scrapes.").Add(float64(n))
	}))
	if err != nil {
		t.Fatal(err)
	}
	for want := 1.0; want <= 2; want++ {
		fams, err := ScrapeUnix(context.Background(), sock, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if len(fams) != 1 || fams[0].Samples[0].Value != want {
			t.Fatalf("scrape %v: %+v", want, fams)
		}
	}
	if _, err := ScrapeUnix(context.Background(), sock, 10); err == nil {
		t.Error("scrape over its limit accepted")
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := ScrapeUnix(context.Background(), sock, 1<<20); err == nil {
		t.Error("scrape after Close succeeded")
	}
	if matches, _ := filepath.Glob(sock); len(matches) != 0 {
		t.Error("socket left after Close")
	}
}

// FuzzParse: any input is refused or parsed; what parses writes out and
// parses back to the same families.
func FuzzParse(f *testing.F) {
	var buf bytes.Buffer
	sampleSet().WriteTo(&buf)
	f.Add(buf.String())
	f.Add("# TYPE x counter\nx{a=\"b\\\\\\n\\\"\"} 1 2\n")
	f.Add("x_bucket{le=\"1\"} 1\n")
	f.Fuzz(func(t *testing.T, in string) {
		fams, err := Parse(strings.NewReader(in))
		if err != nil {
			return
		}
		var s Set
		for _, fam := range fams {
			if err := s.Merge(fam); err != nil {
				t.Fatalf("merge of parsed family %s: %v", fam.Name, err)
			}
		}
		var out bytes.Buffer
		if _, err := s.WriteTo(&out); err != nil {
			t.Fatalf("write of parsed families: %v", err)
		}
		again, err := Parse(&out)
		if err != nil {
			t.Fatalf("reparse: %v\n%s", err, out.String())
		}
		var nonEmpty []Family
		for _, fam := range fams {
			if len(fam.Samples) > 0 {
				nonEmpty = append(nonEmpty, fam)
			}
		}
		if len(again) != len(nonEmpty) {
			t.Fatalf("reparse gave %d families, want %d", len(again), len(nonEmpty))
		}
		for i := range again {
			a, b := again[i], nonEmpty[i]
			if a.Name != b.Name || a.Type != b.Type || a.Help != b.Help || len(a.Samples) != len(b.Samples) {
				t.Fatalf("family %d: %+v, want %+v", i, a, b)
			}
			for j := range a.Samples {
				x, y := a.Samples[j], b.Samples[j]
				if x.Name != y.Name || !reflect.DeepEqual(x.Labels, y.Labels) || !(x.Value == y.Value || math.IsNaN(x.Value) && math.IsNaN(y.Value)) {
					t.Fatalf("sample %d of %s: %+v, want %+v", j, a.Name, x, y)
				}
			}
		}
	})
}
