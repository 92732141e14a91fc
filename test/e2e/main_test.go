package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
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
// a test's directory. A test's own cleanup checks catch most of this; this
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

// testMounts lists mounts under the temporary directory of one of this
// package's tests (t.TempDir is <tmp>/<TestName><digits>/...).
func testMounts() []string {
	names := packageTestNames()
	if len(names) == 0 {
		return []string{"cannot list this package's tests to check for leftover mounts"}
	}
	re := regexp.MustCompile("^" + regexp.QuoteMeta(filepath.Clean(os.TempDir())) + "/(" + strings.Join(names, "|") + `)[0-9]+(/|$)`)
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return []string{"mountinfo: " + err.Error()}
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && re.MatchString(unescapeMountPath(fields[4])) {
			out = append(out, "mount "+fields[4])
		}
	}
	return out
}

// packageTestNames parses this package's test files for its test names.
func packageTestNames() []string {
	files, _ := filepath.Glob("*_test.go")
	var names []string
	fset := token.NewFileSet()
	for _, f := range files {
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			continue
		}
		for _, d := range af.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Test") && fn.Name.Name != "TestMain" {
				names = append(names, regexp.QuoteMeta(fn.Name.Name))
			}
		}
	}
	return names
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
