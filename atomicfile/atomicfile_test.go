package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestWriteFile: the file is replaced whole with the asked permissions,
// and nothing else is left in the directory.
func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("old content"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "new" {
		t.Fatalf("read back %q, %v", b, err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, %v; want 0600", fi.Mode(), err)
	}
	onlyFile(t, dir, "f")
}

// TestWriteFillFails: a failing fill leaves the old file and no
// temporary file, and its error is returned.
func TestWriteFillFails(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := Write(p, 0o644, func(w io.Writer) error {
		if _, err := io.WriteString(w, "partial"); err != nil {
			return err
		}
		return boom
	})
	if err != boom {
		t.Fatalf("Write: %v, want fill's error as it is", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Fatalf("after a failed write the file holds %q", b)
	}
	onlyFile(t, dir, "f")
}

// TestWriteMissingDir: no directory, no file, and an error naming it.
func TestWriteMissingDir(t *testing.T) {
	p := filepath.Join(t.TempDir(), "no", "f")
	if err := WriteFile(p, nil, 0o600); err == nil || !strings.Contains(err.Error(), p) {
		t.Fatalf("WriteFile into a missing directory: %v", err)
	}
}

func onlyFile(t *testing.T, dir, name string) {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(des) != 1 || des[0].Name() != name {
		var names []string
		for _, de := range des {
			names = append(names, de.Name())
		}
		t.Fatalf("directory holds %v, want %s alone", names, name)
	}
}
