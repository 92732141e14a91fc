package virtiofs

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

// TestPodAllowListRunsOnCDaemon checks that everything the pod allow-list
// lets through (config.PodExtraArgs) is an option the real C virtiofsd
// starts with, once translated: an allow-list entry that broke the daemon
// would turn a pod's harmless request into a failed pod.
func TestPodAllowListRunsOnCDaemon(t *testing.T) {
	d := cDaemon(t)
	pod := []string{"--thread-pool-size", "4", "-o", "xattr,announce_submounts", "-owriteback", "--allow-direct-io", "--no-readdirplus"}
	canonical, err := config.PodExtraArgs(pod)
	if err != nil {
		t.Fatal(err)
	}
	off, err := config.PodExtraArgs([]string{"-o", "no_xattr"})
	if err != nil {
		t.Fatal(err)
	}
	shipped := []string{"--thread-pool-size=1", "--announce-submounts"} // configuration.toml.in
	for _, extra := range [][]string{
		canonical,
		append([]string{"--thread-pool-size=1", "--xattr"}, off...),
		append(shipped, canonical...), // the pod's words after the file's: the last one counts
	} {
		dir := t.TempDir()
		shared := filepath.Join(dir, "shared-podargs")
		if err := os.Mkdir(shared, 0o755); err != nil {
			t.Fatal(err)
		}
		p, err := Start(context.Background(), Options{Daemon: d, SharedDir: shared, Cache: "auto", ExtraArgs: extra}, filepath.Join(dir, "s.sock"))
		if err != nil {
			t.Fatalf("%q: %v", extra, err)
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.Pid()), "cmdline"))
		p.Stop(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		want, _ := FlavourC.ExtraArgs(extra)
		if got := strings.ReplaceAll(string(cmdline), "\x00", " "); !strings.Contains(got, strings.Join(want, " ")) {
			t.Errorf("daemon runs %q, want %q in it", got, want)
		}
		if err := p.Err(); err != nil {
			t.Errorf("%q: daemon reported %v", extra, err)
		}
	}
}
