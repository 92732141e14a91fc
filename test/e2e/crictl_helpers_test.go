package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// crictlVersion is the cri-tools release the tests build: Debian has no
// crictl package, and the Go module proxy serves its source.
const crictlVersion = "v1.37.0"

// crictlOnce builds crictl once per test binary; the binary is cached in
// build/tools across runs.
var crictlOnce = sync.OnceValues(func() (string, error) {
	if p := os.Getenv("KATA_FSX_CRICTL"); p != "" {
		return p, nil
	}
	dir := filepath.Join(repoRoot, "build", "tools", "crictl-"+crictlVersion)
	bin := filepath.Join(dir, "crictl")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "install", "sigs.k8s.io/cri-tools/cmd/crictl@"+crictlVersion)
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", &crictlBuildError{err: err, out: strings.TrimSpace(string(out))}
	}
	return bin, nil
})

type crictlBuildError struct {
	err error
	out string
}

func (e *crictlBuildError) Error() string {
	return "go install crictl " + crictlVersion + ": " + e.err.Error() + ": " + e.out
}

// crictl returns a crictl binary (built with the Go toolchain on first use,
// or $KATA_FSX_CRICTL), skipping the test where none can be had (failing
// it under KATA_FSX_REQUIRE_ALL).
func crictl(t *testing.T) string {
	t.Helper()
	bin, err := crictlOnce()
	if err != nil {
		testenv.Missing(t, "crictl: %v", err)
	}
	return bin
}

// crictlRun runs crictl against the CRI socket of c and returns its
// combined output.
func (c *criEnv) crictlRun(ctx context.Context, t *testing.T, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--runtime-endpoint", "unix://" + c.sock, "--image-endpoint", "unix://" + c.sock, "--timeout", "2m"}, args...)
	out, err := exec.CommandContext(ctx, crictl(t), full...).CombinedOutput()
	return string(out), err
}
