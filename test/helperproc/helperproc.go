// Package helperproc runs a test binary again as a helper process (one of
// its own tests, which acts as the helper when an environment variable
// tells it what to do) and waits until the helper reaches a point it
// prints, so that a test can hold a lock in another process, or kill a
// process at a chosen step.
package helperproc

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Start runs the test binary with only test (a TestX) and the extra
// environment env, and returns once the helper printed a line containing
// want; the helper is killed and reaped when t ends. A helper that ends
// (PASS, FAIL) or prints "error:" before want fails t with what it
// printed.
func Start(t testing.TB, test, want string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), env...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		pw.Close()
	})
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		// Keep the pipe drained so the helper never blocks on its output.
		_, _ = io.Copy(io.Discard, pr)
	}()
	var seen []string
	for l := range lines {
		if strings.Contains(l, want) {
			go func() {
				for range lines {
				}
			}()
			return cmd
		}
		seen = append(seen, l)
		if strings.HasPrefix(l, "error:") || strings.HasPrefix(l, "FAIL") || strings.HasPrefix(l, "PASS") {
			break
		}
	}
	t.Fatalf("helper %s %q never printed %q: %q", test, env, want, seen)
	return nil
}

// Kill kills the helper (SIGKILL) and reaps it.
func Kill(t testing.TB, cmd *exec.Cmd) {
	t.Helper()
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
}

// Pause prints "helperproc: paused at STEP" and blocks forever: a helper
// calls it, through a hook its package's tests set, at the step where its
// test kills it to show that a crash there leaves nothing torn.
func Pause(step string) {
	fmt.Fprintf(os.Stderr, "helperproc: paused at %s\n", step)
	select {}
}
