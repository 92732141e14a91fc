// Command densitybench renders the density benchmark's committed results
// (docs/bench/density.json and any others named, written by test/e2e's
// TestDensityBench) into the density section of docs/benchmarks.md, so
// the tables can change without measuring again.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/kata-fsx/kata-fsx/bench"
	"github.com/kata-fsx/kata-fsx/test/bench/densitybench/density"
)

// sectionName marks the benchmark's part of docs/benchmarks.md.
const sectionName = "density"

func main() {
	doc := flag.String("doc", "docs/benchmarks.md", "the Markdown file whose density section is rewritten")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: densitybench [-doc FILE] [RESULT.json ...] (default docs/bench/density.json; several are rendered in order)")
		flag.PrintDefaults()
	}
	flag.Parse()
	in := flag.Args()
	if len(in) == 0 {
		in = []string{"docs/bench/density.json"}
	}
	if err := render(in, *doc); err != nil {
		fmt.Fprintln(os.Stderr, "densitybench:", err)
		os.Exit(1)
	}
}

func render(in []string, doc string) error {
	var md strings.Builder
	for i, path := range in {
		b, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("read result: %w", err)
		}
		var res density.Result
		if err := json.Unmarshal(b, &res); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if i > 0 {
			md.WriteString("\n")
		}
		md.WriteString(res.Markdown())
	}
	fmt.Print(md.String())
	if err := bench.ReplaceSection(doc, sectionName, md.String()); err != nil {
		return fmt.Errorf("write %s: %w", doc, err)
	}
	return nil
}
