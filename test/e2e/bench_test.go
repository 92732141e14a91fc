package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// benchImage is a small stand-in for the bench image: the Debian root
// (bash, coreutils, findutils, tar; no fio, dbench, rg or sqlite3) with a
// generated node_modules tree and its tarball.
func benchImage(t *testing.T) string {
	debian := fixture(t, "debian-rootfs.sh", "debootstrap")
	img := filepath.Join(t.TempDir(), "image")
	if out, err := exec.Command("cp", "-a", debian, img).CombinedOutput(); err != nil {
		t.Fatalf("copy Debian root: %v: %s", err, out)
	}
	nm := filepath.Join(img, "bench", "nm", "node_modules")
	for p := 0; p < 20; p++ {
		dir := filepath.Join(nm, fmt.Sprintf("pkg%d", p), "lib")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(nm, fmt.Sprintf("pkg%d", p), "package.json"), []byte(`{"name":"x"}`), 0o644)
		for f := 0; f < 10; f++ {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d.js", f)), []byte("module.exports = require('y')\n"), 0o644)
		}
	}
	if out, err := exec.Command("tar", "-C", filepath.Join(img, "bench", "nm"), "-cf", filepath.Join(img, "bench", "node_modules.tar"), "node_modules").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v: %s", err, out)
	}
	return img
}

// TestBenchMatrix runs `kata-fsx bench` on a small matrix: two backends
// that run, a DAX row that runs only where QEMU has a DAX window, a row
// whose agent is on vsock (hybrid vsock where /dev/vhost-vsock is absent)
// and a workload whose tool is missing from the image, which must be
// reported as failed while the rest of the matrix runs.
func TestBenchMatrix(t *testing.T) {
	e := newEnv(t, "")
	img := benchImage(t)
	out := filepath.Join(e.dir, "out")
	tmp := filepath.Join(e.dir, "tmp")
	for _, d := range []string{out, tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	r := e.run(ctx, "bench", "--image", img, "--memory", "512", "--reps", "1", "--start-reps", "2",
		"--backends", "virtio-9p;imagefs-blk;virtio-fs:cache=auto,dax=64;imagefs-blk:agent=vsock",
		"--only", "stat,find,install,rm,fio-randread", "--baseline", "virtio-9p",
		"--json", filepath.Join(out, "r.json"), "--md", filepath.Join(out, "r.md"), "--charts", out, "--tmp", tmp)
	// fio is not in this image: the run reports it and exits non-zero.
	if r.code != 1 || !strings.Contains(r.stderr, "imagefs-blk fio-randread") {
		t.Fatalf("exit %d, want 1 naming the failed workload\nstderr:\n%s", r.code, r.stderr)
	}
	var rep struct {
		Host map[string]string `json:"host"`
		Rows []struct {
			Backend string `json:"backend"`
			Skipped string `json:"skipped"`
			Error   string `json:"error"`
			Output  *struct {
				Samples  map[string][]float64 `json:"samples"`
				Failures map[string][]string  `json:"failures"`
			} `json:"output"`
			ColdStart []float64 `json:"coldstart_seconds"`
			Serving   string    `json:"serving_process"`
			HWM       uint64    `json:"serving_peak_rss_kib"`
		} `json:"rows"`
	}
	b, err := os.ReadFile(filepath.Join(out, "r.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 4 || rep.Host["qemu"] == "" {
		t.Fatalf("report: %s", b)
	}
	for i, serving := range []string{"qemu", "kata-fsx"} {
		row := rep.Rows[i]
		if row.Error != "" || row.Skipped != "" || row.Output == nil {
			t.Fatalf("row %s: error %q skipped %q", row.Backend, row.Error, row.Skipped)
		}
		for _, w := range []string{"stat", "find", "install", "rm"} {
			if v := row.Output.Samples[w]; len(v) != 1 || v[0] <= 0 {
				t.Errorf("row %s workload %s: samples %v", row.Backend, w, v)
			}
		}
		if f := row.Output.Failures["fio-randread"]; len(f) == 0 {
			t.Errorf("row %s: fio-randread without fio did not fail", row.Backend)
		}
		if len(row.ColdStart) != 2 || row.ColdStart[0] <= 0 || row.Serving != serving {
			t.Errorf("row %s: cold start %v, serving %q (want %s)", row.Backend, row.ColdStart, row.Serving, serving)
		}
	}
	if rep.Rows[1].HWM == 0 {
		t.Errorf("imagefs-blk: no peak RSS of the serving process")
	}
	// A QEMU with cache-size runs the DAX row; others skip it saying why.
	if dax := rep.Rows[2]; dax.Output == nil && !strings.Contains(dax.Skipped, "DAX not supported by this QEMU") {
		t.Errorf("DAX row: neither ran nor skipped for DAX: skipped %q error %q", dax.Skipped, dax.Error)
	}
	// The agent transport is a row option now, not a reason to skip.
	if vs := rep.Rows[3]; vs.Skipped != "" || vs.Error != "" || vs.Output == nil || len(vs.Output.Samples["stat"]) != 1 {
		t.Errorf("agent=vsock row did not run: skipped %q error %q", vs.Skipped, vs.Error)
	}
	if !strings.Contains(rep.Host["agent_transport"], "vsock") {
		t.Errorf("host agent_transport %q does not name vsock", rep.Host["agent_transport"])
	}
	md, err := os.ReadFile(filepath.Join(out, "r.md"))
	if err != nil {
		t.Fatal(err)
	}
	wants := []string{"agent=vsock", "| find -name", "failed", "![", "Targets for imagefs-blk"}
	if rep.Rows[2].Skipped != "" {
		wants = append(wants, "**skipped**")
	}
	for _, want := range wants {
		if !strings.Contains(string(md), want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	for _, png := range []string{"suite-tree.png", "suite-ratio.png"} {
		if fi, err := os.Stat(filepath.Join(out, png)); err != nil || fi.Size() == 0 {
			t.Errorf("chart %s: %v", png, err)
		}
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("bench left %d entries in its scratch directory", len(left))
	}
}
