package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestBenchHostCost runs `kata-fsx bench --hostcost` on one row and one
// tiny workload: the stat of a 61-entry tree on imagefs-blk must have cost
// the host block requests (by the server's metrics and by the guest's
// diskstats) and system calls of the serving process (kata-fsx run) beyond
// the no-op baseline, and the report must table them.
func TestBenchHostCost(t *testing.T) {
	sum := func(m map[string]int64) (n int64) {
		for _, v := range m {
			n += v
		}
		return n
	}
	e := newEnv(t, "")
	img := benchImage(t)
	// The pass's tree workloads walk node_modules/lodash.
	tree := filepath.Join(img, "bench", "nm", "node_modules", "lodash")
	if err := os.MkdirAll(tree, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 60; i++ {
		if err := os.WriteFile(filepath.Join(tree, fmt.Sprintf("f%d.js", i)), []byte("module.exports = 1\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, tmp := filepath.Join(e.dir, "out"), filepath.Join(e.dir, "tmp")
	for _, d := range []string{out, tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	js, md := filepath.Join(out, "hostcost.json"), filepath.Join(out, "b.md")
	r := e.run(ctx, "bench", "--hostcost", "--image", img, "--memory", "512", "--backends", "imagefs-blk", "--only", "stat",
		"--hostcost-json", js, "--md", md, "--tmp", tmp)
	if r.code != 0 {
		t.Fatalf("exit %d\nstderr:\n%s", r.code, r.stderr)
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Rows []struct {
			Backend string `json:"backend"`
			Error   string `json:"error"`
			Raw     map[string]struct {
				Syscalls map[string]int64 `json:"syscalls"`
				Requests map[string]int64 `json:"requests"`
			} `json:"raw"`
			Net map[string]struct {
				Syscalls  map[string]int64 `json:"syscalls"`
				Requests  map[string]int64 `json:"requests"`
				GuestDisk map[string]int64 `json:"guest_disk_requests"`
			} `json:"net"`
		} `json:"rows"`
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 1 || rep.Rows[0].Error != "" {
		t.Fatalf("report: %s", b)
	}
	row := rep.Rows[0]
	if len(row.Raw["baseline"].Syscalls) == 0 {
		t.Errorf("no system calls counted in the baseline step: %s", b)
	}
	stat := row.Net["stat"]
	t.Logf("stat, net of the baseline: requests %v (the guest counted %v); preadv %d of %d system calls", stat.Requests, stat.GuestDisk, stat.Syscalls["preadv"], sum(stat.Syscalls))
	// The guest's caches were dropped: its lstats read inodes and
	// directories from the disk, which kata-fsx serves with preadv, and
	// both the server's counters and the guest's see those reads.
	if stat.Requests["read"] <= 0 || stat.GuestDisk["read"] <= 0 || stat.Syscalls["preadv"] <= 0 {
		t.Errorf("stat, net of the baseline: requests %v, guest's %v, system calls %v; want reads served by preadv", stat.Requests, stat.GuestDisk, stat.Syscalls)
	}
	text, err := os.ReadFile(md)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<!-- host-cost:start -->", "| workload | imagefs-blk |", "| stat | "} {
		if !strings.Contains(string(text), want) {
			t.Errorf("report lacks %q:\n%s", want, text)
		}
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("scratch left behind: %v", left)
	}
}
