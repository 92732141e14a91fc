package arch

import (
	"os"
	"regexp"
	"sort"
	"testing"
)

// codeSpan is one `...` span of Markdown.
var codeSpan = regexp.MustCompile("`([^`\n]+)`")

// TestArchitectureDocNamesEveryPackage: docs/architecture.md is the map
// of the code, so every package of the module has a row in its Packages
// table, named as its import path relative to the module in backquotes,
// and the table names no package that is gone.
func TestArchitectureDocNamesEveryPackage(t *testing.T) {
	doc, err := os.ReadFile("../../docs/architecture.md")
	if err != nil {
		t.Fatalf("read the architecture map: %v", err)
	}
	table := packagesTable(t, string(doc))
	named := map[string]bool{}
	for _, m := range codeSpan.FindAllStringSubmatch(table, -1) {
		named[m[1]] = true
	}
	pkgs := map[string]bool{}
	var missing []string
	for _, p := range graph(t) {
		pkgs[p.ImportPath] = true
		if !named[p.ImportPath] {
			missing = append(missing, p.ImportPath)
		}
	}
	sort.Strings(missing)
	for _, p := range missing {
		t.Errorf("docs/architecture.md's Packages table has no row naming `%s`: add one saying its one job and what it may import", p)
	}
	// A first cell naming a path that is not a package is a row left
	// behind by a move.
	for _, row := range regexp.MustCompile("(?m)^\\| *(`[^|]*)\\|").FindAllStringSubmatch(table, -1) {
		for _, m := range codeSpan.FindAllStringSubmatch(row[1], -1) {
			if !pkgs[m[1]] && !nonPackageRows[m[1]] {
				t.Errorf("docs/architecture.md's Packages table has a row for `%s`, which is no package of the module: remove or rename it", m[1])
			}
		}
	}
}

// nonPackageRows are directories with a row of their own that hold no Go
// package: build scripts and data.
var nonPackageRows = map[string]bool{
	"guest/kernel": true, "guest/image": true, "guest/initrd": true,
	"test/fixtures": true, "deploy": true,
}

// packagesTable returns the text of the map's "## Packages" section.
func packagesTable(t *testing.T, doc string) string {
	t.Helper()
	loc := regexp.MustCompile(`(?m)^## Packages\n`).FindStringIndex(doc)
	if loc == nil {
		t.Fatal("docs/architecture.md has no \"## Packages\" section")
	}
	rest := doc[loc[1]:]
	if end := regexp.MustCompile(`(?m)^## `).FindStringIndex(rest); end != nil {
		rest = rest[:end[0]]
	}
	return rest
}
