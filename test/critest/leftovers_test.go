package critest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// host is what the machine had before the run: what the run leaves is
// what is new. Network namespaces and shim sockets are shared with every
// other containerd on the machine, so only the run's count: a namespace
// with an address of the run's subnet, a socket the run's containerd
// logged connecting to.
type host struct {
	netns, taps map[string]bool
}

func snapshotHost() host {
	return host{netns: names("/run/netns", nil), taps: names("/sys/class/net", isTap)}
}

// shimAddressRe finds the shim sockets containerd connects to in its log.
var shimAddressRe = regexp.MustCompile(`address="?unix://(/[^" ]+)`)

func isTap(dir, name string) bool {
	_, err := os.Stat(filepath.Join(dir, name, "tun_flags"))
	return err == nil
}

func names(dir string, keep func(dir, name string) bool) map[string]bool {
	m := map[string]bool{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if keep == nil || keep(dir, e.Name()) {
			m[e.Name()] = true
		}
	}
	return m
}

// podLeftovers lists what a removed pod may leave: network namespaces,
// taps and shim sockets that were not there before the run, mounts under
// the run's directory, and entries of the pods' state directory.
func podLeftovers(w world, before host) []string {
	var left []string
	for n := range names("/run/netns", nil) {
		if before.netns[n] {
			continue
		}
		out, _ := exec.Command("ip", "-n", n, "-o", "addr").Output()
		if bytes.Contains(out, []byte(" "+subnetPrefix)) {
			left = append(left, "network namespace "+n+" with an address of the run's subnet")
		}
	}
	for n := range names("/sys/class/net", isTap) {
		if !before.taps[n] {
			left = append(left, "tap "+n)
		}
	}
	if log, err := os.ReadFile(w.path("containerd.log")); err == nil {
		seen := map[string]bool{}
		for _, m := range shimAddressRe.FindAllSubmatch(log, -1) {
			sock := string(m[1])
			if seen[sock] {
				continue
			}
			seen[sock] = true
			if _, err := os.Lstat(sock); err == nil {
				left = append(left, "shim socket "+sock)
			}
		}
	}
	for _, m := range mountsUnder(w.dir) {
		left = append(left, "mount "+m)
	}
	for n := range names(w.stateDir(), nil) {
		if n != "accel.json" { // the accelerator verdict is meant to stay
			left = append(left, "pod state "+filepath.Join(w.stateDir(), n))
		}
	}
	return left
}

// leftovers is podLeftovers plus every process of the run, once
// containerd is gone.
func leftovers(w world, marker string, before host) []string {
	return append(markedProcesses(marker, 0), podLeftovers(w, before)...)
}

// waitGone waits until the run's only process is containerd (the shims,
// QEMU and virtiofsd of removed pods exit on their own), and reports
// those that did not.
func waitGone(t *testing.T, w world, marker string, d time.Duration) {
	t.Helper()
	ctrd := containerdPID(w)
	err := testenv.Wait(d, func() (bool, error) {
		left := markedProcesses(marker, ctrd)
		return len(left) == 0, fmt.Errorf("processes of removed pods still running after %s: %v", d, left)
	})
	if err != nil {
		t.Error(err)
	}
}

// containerdPID is the pid of the run's containerd (the process whose
// command line names the run's configuration).
func containerdPID(w world) int {
	for _, p := range processesMentioning(w.path("containerd.toml")) {
		return p
	}
	return 0
}

// shims lists the run's shim processes (their command line names the
// containerd socket), containerd itself excepted.
func shims(w world) []int {
	ctrd := containerdPID(w)
	var out []int
	for _, p := range processesMentioning(w.sock()) {
		if p != ctrd {
			out = append(out, p)
		}
	}
	return out
}

// markedProcesses lists live processes, other than except, whose
// environment carries the run's marker.
func markedProcesses(marker string, except int) []string {
	want := []byte(runMarkerEnv + "=" + marker + "\x00")
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() || pid == except {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !bytes.Contains(append(env, 0), want) {
			continue
		}
		if st, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); bytes.Contains(st, []byte(") Z ")) {
			continue
		}
		cmd, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		out = append(out, fmt.Sprintf("process %d: %s", pid, strings.ReplaceAll(strings.TrimRight(string(cmd), "\x00"), "\x00", " ")))
	}
	return out
}

// processesMentioning lists processes whose command line contains s.
func processesMentioning(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, en := range ents {
		pid, err := strconv.Atoi(en.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", en.Name(), "cmdline"))
		if err == nil && bytes.Contains(b, []byte(s)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// mountsUnder lists the mount points under dir.
func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return []string{"mountinfo: " + err.Error()}
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			out = append(out, fields[4])
		}
	}
	return out
}
