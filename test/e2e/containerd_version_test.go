package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// containerdDirEnv names the directory of the containerd, ctr and
// containerd-shim-runc-v2 the tests run (make test points it at the 1.7
// and 2.x builds in build/containerd/); unset means Debian's in /usr/bin.
const containerdDirEnv = "KATA_FSX_CONTAINERD"

// containerdDir is the directory the tests take containerd's binaries from.
func containerdDir() string {
	if d := os.Getenv(containerdDirEnv); d != "" {
		return d
	}
	return "/usr/bin"
}

// containerdBin is the path of containerd's binary name (containerd, ctr).
func containerdBin(name string) string {
	return filepath.Join(containerdDir(), name)
}

// containerdVersion is the major.minor of the containerd under test.
type containerdVersion struct {
	Major, Minor int
	Full         string // as `containerd --version` prints it
}

func (v containerdVersion) String() string { return fmt.Sprintf("%d.%d", v.Major, v.Minor) }

// AtLeast reports whether v is major.minor or newer.
func (v containerdVersion) AtLeast(major, minor int) bool {
	return v.Major > major || v.Major == major && v.Minor >= minor
}

// containerdVersionRe finds the release in `containerd --version`, e.g.
// "containerd github.com/containerd/containerd/v2 2.2.9 " or Debian's
// "containerd containerd.io 1.6.20~ds1 1.6.20~ds1-1+b1".
var containerdVersionRe = regexp.MustCompile(`\sv?(\d+)\.(\d+)\.\d+`)

func parseContainerdVersion(out string) (containerdVersion, error) {
	m := containerdVersionRe.FindStringSubmatch(" " + out)
	if m == nil {
		return containerdVersion{}, fmt.Errorf("no major.minor.patch in `containerd --version` output %q", out)
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	return containerdVersion{Major: major, Minor: minor, Full: strings.TrimSpace(out)}, nil
}

// probeContainerd runs `containerd --version` once per directory: every
// test of a run sees the same binaries.
var probeContainerd = sync.OnceValues(func() (containerdVersion, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, containerdBin("containerd"), "--version").CombinedOutput()
	if err != nil {
		return containerdVersion{}, fmt.Errorf("%s --version: %v\n%s", containerdBin("containerd"), err, out)
	}
	return parseContainerdVersion(string(out))
})

// containerdUnderTest checks that containerd, ctr and (for a build of
// ours) containerd-shim-runc-v2 are in containerdDir and returns the
// version of its containerd; a test uses it to pick version-specific
// expectations.
func containerdUnderTest(t *testing.T) containerdVersion {
	t.Helper()
	bins := []string{"containerd", "ctr"}
	if os.Getenv(containerdDirEnv) != "" {
		bins = append(bins, "containerd-shim-runc-v2")
	}
	for _, b := range bins {
		if _, err := os.Stat(containerdBin(b)); err != nil {
			if os.Getenv(containerdDirEnv) != "" {
				t.Fatalf("%s=%s has no %s (make containerd builds them): %v", containerdDirEnv, containerdDir(), b, err)
			}
			testenv.Missing(t, "%s missing (apt-get install containerd): %v", containerdBin(b), err)
		}
	}
	v, err := probeContainerd()
	if err != nil {
		t.Fatal(err)
	}
	if v.Major < 1 || v.Major == 1 && v.Minor < 6 {
		t.Fatalf("containerd %s (%s): kata-fsx supports 1.6 and newer", v, v.Full)
	}
	return v
}

// containerdPATH is the daemon's PATH: the kata-fsx shim's directory, then
// containerd's (its containerd-shim-runc-v2 must win over Debian's for
// the runc pods), then ours.
func containerdPATH(shimDir string) string {
	return "PATH=" + shimDir + ":" + containerdDir() + ":" + os.Getenv("PATH")
}

func TestParseContainerdVersion(t *testing.T) {
	for out, want := range map[string]string{
		"containerd github.com/containerd/containerd/v2 2.2.9 \n":             "2.2",
		"containerd github.com/containerd/containerd 1.7.35 \n":               "1.7",
		"containerd github.com/containerd/containerd 1.7.35+unknown \n":       "1.7",
		"containerd containerd.io 1.6.20~ds1 1.6.20~ds1-1+b1\n":               "1.6",
		"containerd github.com/containerd/containerd v1.7.2 0cae528dd6cb55\n": "1.7",
	} {
		v, err := parseContainerdVersion(out)
		if err != nil || v.String() != want {
			t.Errorf("parseContainerdVersion(%q) = %v, %v; want %s", out, v, err, want)
		}
	}
	if v, err := parseContainerdVersion("containerd dev\n"); err == nil {
		t.Errorf("parseContainerdVersion without a version = %v, want an error", v)
	}
}

// TestContainerdVersion checks the containerd under test is the one
// KATA_FSX_CONTAINERD names (a build directory named after its release,
// as make containerd makes, must hold that release), that a pod runs
// through it, and that its log holds no error about the kata-fsx runtime:
// containerd 2.x introspects every runtime (`-info`) and speaks the
// shim's bootstrap protocol, which 1.x do not.
func TestContainerdVersion(t *testing.T) {
	ce := newContainerdEnv(t)
	t.Logf("containerd %s: %s", ce.version, ce.version.Full)
	if d := os.Getenv(containerdDirEnv); d != "" {
		if rel, ok := strings.CutPrefix(filepath.Base(d), "v"); ok && !strings.Contains(ce.version.Full, " "+rel) {
			t.Fatalf("%s=%s runs containerd %q, not %s: a stale build? (rm -r %s; make containerd)", containerdDirEnv, d, ce.version.Full, rel, d)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if ce.version.AtLeast(2, 0) {
		// The runtime introspection CRI makes at start-up for each
		// runtime handler, as ctr asks for it.
		r := ce.ctr(ctx, "plugins", "inspect-runtime", "--runtime", "io.containerd.kata-fsx.v2", "--runtime-config-path", ce.config)
		if r.code != 0 {
			t.Fatalf("ctr plugins inspect-runtime: exit %d: %s", r.code, r.stderr)
		}
		var info struct {
			Name    string `json:"name"`
			Version struct {
				Version string `json:"version"`
			} `json:"version"`
		}
		if err := json.Unmarshal([]byte(r.stdout), &info); err != nil {
			t.Fatalf("ctr plugins inspect-runtime: %v\n%s", err, r.stdout)
		}
		if info.Name != "io.containerd.kata-fsx.v2" || info.Version.Version == "" {
			t.Errorf("runtime info: name %q version %q, want io.containerd.kata-fsx.v2 and a version:\n%s", info.Name, info.Version.Version, r.stdout)
		}
		// CRI introspected the handler at start-up and logs why it
		// found no features at debug level: the only reason must be
		// that kata-fsx declares none (CRI then assumes none, rather
		// than, say, recursive read-only mounts the guest may not do).
		for _, l := range strings.Split(ce.logTail(1<<30), "\n") {
			if strings.Contains(l, `failed to introspect features of runtime \"kata-fsx\"`) && !strings.Contains(l, "runtime info has no features") {
				t.Errorf("CRI's introspection of kata-fsx failed: %s", l)
			}
		}
	}
	const id = "ver"
	ce.startLongRunning(ctx, t, id, "imagefs-blk")
	// containerd 2.x records the shim's bootstrap parameters: Task API v3,
	// as the shim announces to it (1.x have no such file and speak v2).
	boot := filepath.Join(ce.dir, "state", "io.containerd.runtime.v2.task", "test", id, "bootstrap.json")
	if b, err := os.ReadFile(boot); ce.version.AtLeast(2, 0) {
		var p struct {
			Version  int    `json:"version"`
			Protocol string `json:"protocol"`
		}
		if err != nil || json.Unmarshal(b, &p) != nil || p.Version != 3 || p.Protocol != "ttrpc" {
			t.Errorf("containerd %s: bootstrap.json %q (%v): want Task API version 3 over ttrpc", ce.version, b, err)
		}
	} else if err == nil {
		t.Errorf("containerd %s wrote %s: %s", ce.version, boot, b)
	}
	if r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "e1", id, "/bin/echo", "hello"); r.code != 0 || r.stdout != "hello\n" {
		t.Errorf("ctr tasks exec: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id); r.code != 0 {
		t.Fatalf("ctr tasks kill: exit %d: %s", r.code, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, id, "STOPPED"); st != "STOPPED" {
		t.Fatalf("task %s is %s after SIGKILL, want STOPPED", id, st)
	}
	if r := ce.ctr(ctx, "tasks", "delete", id); r.code != 0 {
		t.Fatalf("ctr tasks delete: exit %d: %s", r.code, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Fatalf("ctr containers delete: exit %d: %s", r.code, r.stderr)
	}
	if errs := ce.logErrors("kata-fsx"); len(errs) > 0 {
		t.Errorf("containerd %s logged errors about kata-fsx:\n%s", ce.version, strings.Join(errs, "\n"))
	}
}

// logErrors lists the error-level lines of containerd's log that mention word.
func (ce *containerdEnv) logErrors(word string) []string {
	var out []string
	for _, l := range strings.Split(ce.logTail(1<<30), "\n") {
		if (strings.Contains(l, "level=error") || strings.Contains(l, "level=fatal")) && strings.Contains(l, word) {
			out = append(out, l)
		}
	}
	return out
}

// TestCRIEnvOptions: the settings newCRIEnvWith writes in each version's
// configuration format are the ones the CRI plugin runs with: a proxy
// snapshotter plugin loads, and (1.7 and newer) both runtime handlers
// carry their snapshotter. (No pod uses the snapshotter here; its
// socket need not be served for containerd to load the plugin.)
func TestCRIEnvOptions(t *testing.T) {
	v := containerdUnderTest(t)
	o := criOptions{ProxySnapshotters: map[string]string{"kfs-test": "/run/kata-fsx-test-none.sock"}, SnapshotAnnotations: true}
	if !v.AtLeast(1, 7) {
		_, err := containerdConfig{cri: true, opts: criOptions{RuntimeSnapshotter: "kfs-test"}}.render(v)
		if err == nil || !strings.Contains(err.Error(), "1.7 or newer") {
			t.Fatalf("containerd %s: a runtime snapshotter rendered (%v), want a refusal naming 1.7", v, err)
		}
	} else {
		o.RuntimeSnapshotter = "kfs-test"
	}
	c := newCRIEnvWith(t, o)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if p := c.ctr(ctx, "plugins", "ls"); !regexp.MustCompile(`(?m)^io\.containerd\.snapshotter\.v1\s+kfs-test\s+\S+\s+ok`).MatchString(p.stdout) {
		t.Errorf("the proxy snapshotter kfs-test is not loaded:\n%s", p.stdout)
	}
	st, err := c.rt.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Containerd struct {
			Runtimes map[string]struct {
				Snapshotter string `json:"snapshotter"`
			} `json:"runtimes"`
			DisableSnapshotAnnotations *bool `json:"disableSnapshotAnnotations"`
		} `json:"containerd"`
	}
	if err := json.Unmarshal([]byte(st.Info["config"]), &cfg); err != nil {
		t.Fatalf("CRI status config: %v\n%s", err, st.Info["config"])
	}
	for _, h := range []string{"runc", criRuntime} {
		if got := cfg.Containerd.Runtimes[h].Snapshotter; got != o.RuntimeSnapshotter {
			t.Errorf("runtime handler %s: snapshotter %q, want %q", h, got, o.RuntimeSnapshotter)
		}
	}
	// 1.x reports the CRI plugin's image settings with its own; 2.x
	// moved them to the images plugin, whose per-handler snapshotter it
	// logs at start-up.
	if v.Major < 2 {
		if d := cfg.Containerd.DisableSnapshotAnnotations; d == nil || *d {
			t.Errorf("disable_snapshot_annotations = %v, want false:\n%s", d, st.Info["config"])
		}
	} else if !strings.Contains(c.logTail(1<<24), `for snapshotter \"kfs-test\"`) {
		t.Errorf("the images plugin has no runtime platform with snapshotter kfs-test")
	}
}
