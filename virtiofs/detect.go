// Package virtiofs runs virtiofsd for a pod: it detects which daemon
// flavour is installed, speaks its argument dialect and supervises it.
package virtiofs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os/exec"
	"regexp"
	"strings"
	"time"
)

// ErrNotFound means the daemon binary does not exist.
var ErrNotFound = errors.New("virtiofsd not found")

// Daemon describes an installed virtiofsd binary.
type Daemon struct {
	Path    string
	Flavour Flavour
	Version string // e.g. "7.2.22" for the C daemon, "1.10.1" for the Rust one
}

var (
	rustVersionRe = regexp.MustCompile(`(?m)^virtiofsd\s+v?(\d+\.\d+\.\d+)`)
	cVersionRe    = regexp.MustCompile(`virtiofsd version (\d+\.\d+(?:\.\d+)?)`)
)

const probeTimeout = 5 * time.Second

// Detect runs the daemon's --help and --version and tells the flavour
// from the dialect its help describes (the Rust daemon has --shared-dir,
// the C one -o source=).
func Detect(ctx context.Context, path string) (*Daemon, error) {
	if _, err := exec.LookPath(path); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %s", ErrNotFound, path)
		}
		return nil, fmt.Errorf("virtiofsd %s: %w", path, err)
	}
	help, err := probe(ctx, path, "--help")
	if err != nil {
		return nil, err
	}
	d := &Daemon{Path: path}
	switch {
	case strings.Contains(help, "--shared-dir"):
		d.Flavour = FlavourRust
	case strings.Contains(help, "-o source="):
		d.Flavour = FlavourC
	default:
		return nil, fmt.Errorf("virtiofsd %s: --help describes neither the C (-o source=) nor the Rust (--shared-dir) dialect", path)
	}
	ver, err := probe(ctx, path, "--version")
	if err != nil {
		return nil, err
	}
	re := cVersionRe
	if d.Flavour == FlavourRust {
		re = rustVersionRe
	}
	if m := re.FindStringSubmatch(ver); m != nil {
		d.Version = m[1]
	}
	return d, nil
}

// probe runs the daemon with one informational flag. Both daemons print
// help on stdout or stderr depending on version, and some exit non-zero
// after printing it, so the output matters, not the status.
func probe(ctx context.Context, path, flag string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, path, flag)
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	if ctx.Err() != nil {
		return "", fmt.Errorf("virtiofsd %s %s: no answer within %v", path, flag, probeTimeout)
	}
	if out.Len() == 0 && err != nil {
		return "", fmt.Errorf("virtiofsd %s %s: %w", path, flag, err)
	}
	return out.String(), nil
}
