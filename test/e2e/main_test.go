package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// runMarkerEnv marks every process this test binary starts, and through
// inheritance every containerd, shim, QEMU and virtiofsd they start, so
// the suite can find its own leftovers while other packages' tests run
// beside it.
const runMarkerEnv = "KATA_FSX_E2E_RUN"

// TestMain runs the suite, then asserts that it left nothing behind: no
// process it started, no network namespace or tap it made, no mount under
// a test environment's directory. A test's own cleanup checks catch most of this; this
// catches what a test forgot to check.
func TestMain(m *testing.M) {
	marker := fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
	os.Setenv(runMarkerEnv, marker)
	netnsBefore := netnsNames()
	tapsBefore := hostTaps()
	code := m.Run()
	if left := suiteLeftovers(marker, netnsBefore, tapsBefore); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "e2e suite left behind:\n  %s\n", strings.Join(left, "\n  "))
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// suiteLeftovers lists what the suite left, waiting a little for
// processes that are on their way out.
func suiteLeftovers(marker string, netnsBefore, tapsBefore map[string]bool) []string {
	var left []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		left = markedProcesses(marker)
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	for name := range netnsNames() {
		if !netnsBefore[name] {
			left = append(left, "network namespace "+name)
		}
	}
	for name := range hostTaps() {
		if !tapsBefore[name] {
			left = append(left, "tap "+name+" in the host's network namespace")
		}
	}
	left = append(left, testMounts()...)
	return left
}

// markedProcesses lists live processes whose environment carries marker,
// other than this test binary.
func markedProcesses(marker string) []string {
	want := []byte(runMarkerEnv + "=" + marker + "\x00")
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !bytes.Contains(append(env, 0), want) {
			continue
		}
		if st, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); bytes.Contains(st, []byte(") Z ")) {
			continue // a zombie holds nothing; its parent is gone or will reap it
		}
		cmd, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		out = append(out, fmt.Sprintf("process %d: %s", pid, strings.ReplaceAll(strings.TrimRight(string(cmd), "\x00"), "\x00", " ")))
	}
	return out
}

// netnsNames lists the named network namespaces (ip netns's directory).
func netnsNames() map[string]bool {
	names := map[string]bool{}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		names[e.Name()] = true
	}
	return names
}

// hostTaps lists the tun/tap links of the host's network namespace.
func hostTaps() map[string]bool {
	taps := map[string]bool{}
	ents, _ := os.ReadDir("/sys/class/net")
	for _, e := range ents {
		if _, err := os.Stat(filepath.Join("/sys/class/net", e.Name(), "tun_flags")); err == nil {
			taps[e.Name()] = true
		}
	}
	return taps
}

// envDirs are the directories of this run's test environments (newEnv):
// the only places whose mounts are this run's, when another run of this
// package shares the machine. Package state because TestMain has no other
// way to see what its tests made.
var envDirs sync.Map

// testMounts lists mounts under one of this run's environment directories.
func testMounts() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return []string{"mountinfo: " + err.Error()}
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) <= 4 {
			continue
		}
		mp := unescapeMountPath(fields[4])
		envDirs.Range(func(dir, _ any) bool {
			if mp == dir.(string) || strings.HasPrefix(mp, dir.(string)+"/") {
				out = append(out, "mount "+mp)
				return false
			}
			return true
		})
	}
	return out
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(p string) string {
	if !strings.Contains(p, `\`) {
		return p
	}
	s, err := strconv.Unquote(`"` + strings.ReplaceAll(p, `"`, `\"`) + `"`)
	if err != nil {
		return p
	}
	return s
}
