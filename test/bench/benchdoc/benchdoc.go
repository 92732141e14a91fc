// Package benchdoc writes benchmark results into docs/benchmarks.md, each
// benchmark owning the text between its own markers.
package benchdoc

import (
	"fmt"
	"os"
	"strings"
)

// ReplaceSection rewrites the text between <!-- NAME:start --> and
// <!-- NAME:end --> in path, so a run updates only its own table.
func ReplaceSection(path, name, body string) error {
	start, end := "<!-- "+name+":start -->", "<!-- "+name+":end -->"
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	s := string(old)
	i, j := strings.Index(s, start), strings.Index(s, end)
	if i < 0 || j < i {
		return fmt.Errorf("%s has no %s ... %s markers", path, start, end)
	}
	s = s[:i+len(start)] + "\n" + body + s[j:]
	return os.WriteFile(path, []byte(s), 0o644)
}
