package bench

import (
	"os"
	"path/filepath"
	"testing"
)

// TestReplaceSection: a section is replaced in place, appended to a file
// that lacks it, and written into a new file; the rest of the file stays.
func TestReplaceSection(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "b.md")
	if err := os.WriteFile(p, []byte("intro\n<!-- x:start -->\nold\n<!-- x:end -->\ntail\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ReplaceSection(p, "x", "new\n"); err != nil {
		t.Fatal(err)
	}
	if err := ReplaceSection(p, "y", "other\n"); err != nil {
		t.Fatal(err)
	}
	want := "intro\n<!-- x:start -->\nnew\n<!-- x:end -->\ntail\n\n<!-- y:start -->\nother\n<!-- y:end -->\n"
	if b, _ := os.ReadFile(p); string(b) != want {
		t.Errorf("got %q\nwant %q", b, want)
	}
	fresh := filepath.Join(dir, "sub", "new.md")
	if err := ReplaceSection(fresh, "x", "body\n"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(fresh); string(b) != "# kata-fsx benchmarks\n\n<!-- x:start -->\nbody\n<!-- x:end -->\n" {
		t.Errorf("new file: %q", b)
	}
}
