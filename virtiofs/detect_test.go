package virtiofs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const debianCDaemon = "/usr/lib/qemu/virtiofsd"

func TestDetectDebianCDaemon(t *testing.T) {
	if _, err := os.Stat(debianCDaemon); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-common, which qemu-system-x86 depends on): %v", err)
	}
	d, err := Detect(context.Background(), debianCDaemon)
	if err != nil {
		t.Fatal(err)
	}
	if d.Flavour != FlavourC || d.Version == "" {
		t.Fatalf("got %+v", d)
	}
}

// fakeRustDaemon is a mock: the Rust virtiofsd is not packaged for Debian
// bookworm and crates.io is not reachable here, so a script prints what
// its --help and --version print.
func fakeRustDaemon(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "virtiofsd")
	script := `#!/bin/sh
case "$1" in
--version) echo "virtiofsd 1.10.1";;
*) cat <<'X'
Usage: virtiofsd [OPTIONS] --shared-dir <shared-dir>
      --shared-dir <shared-dir>  Shared directory path
      --cache <cache>            The caching policy [default: auto] [possible values: auto, always, never, metadata]
X
;;
esac
`
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDetectRustDialect(t *testing.T) {
	d, err := Detect(context.Background(), fakeRustDaemon(t))
	if err != nil {
		t.Fatal(err)
	}
	if d.Flavour != FlavourRust || d.Version != "1.10.1" {
		t.Fatalf("got %+v", d)
	}
}

func TestDetectMissing(t *testing.T) {
	_, err := Detect(context.Background(), "/nonexistent/virtiofsd")
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("got %v", err)
	}
}

func TestDetectNotAVirtiofsd(t *testing.T) {
	if _, err := Detect(context.Background(), "/bin/true"); err == nil {
		t.Fatal("/bin/true detected as a virtiofsd")
	}
}
