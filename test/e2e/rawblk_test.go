package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// runStats is the part of `run --stats-file`'s JSON the tests read.
type runStats struct {
	Backend      string       `json:"backend"`
	ReadySeconds float64      `json:"ready_seconds"`
	StartSeconds float64      `json:"start_seconds"`
	FirstOutput  float64      `json:"first_output_seconds"`
	AtReady      []procSample `json:"at_ready"`
	AtStart      []procSample `json:"at_start"`
	AtEnd        []procSample `json:"at_end"`
}

type procSample struct {
	Role         string `json:"role"`
	ServesRootfs bool   `json:"serves_rootfs"`
	RChar        uint64 `json:"rchar"`
	HWMKiB       uint64 `json:"hwm_kib"`
	Error        string `json:"error"`
}

// TestRunVirtioBlkRawRootfs runs a pod whose rootfs is a raw ext4 image
// behind QEMU's virtio-blk (the benchmarks' ceiling), checks that guest
// writes land in that file, and that --stats-file reports the serving
// process.
func TestRunVirtioBlkRawRootfs(t *testing.T) {
	testenv.Tool(t, "debugfs", "e2fsprogs")
	e := newEnv(t, "block_device_cache_direct = true\nblock_device_aio = \"threads\"\n")
	rootfs := busyboxRootfs(t)
	img := filepath.Join(e.dir, "img")
	raw := filepath.Join(e.dir, "rootfs.raw")
	runCLI(t, "image", "build", "dir:"+rootfs, "-o", img, "--cache", filepath.Join(e.dir, "cache"))
	runCLI(t, "image", "export", "--cache", filepath.Join(e.dir, "cache"), "--raw", raw, img)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	// raw: and --backend virtio-blk go together.
	r := e.run(ctx, "run", "--backend", "imagefs-blk", "--rootfs", "raw:"+raw, "--", "/bin/true")
	if r.code == 0 || !strings.Contains(r.stderr, "raw:FILE") {
		t.Fatalf("raw: with imagefs-blk: exit %d, stderr:\n%s", r.code, r.stderr)
	}

	stats := filepath.Join(e.dir, "stats.json")
	r = e.run(ctx, "run", "--backend", "virtio-blk", "--rootfs", "raw:"+raw, "--stats-file", stats, "--",
		"/bin/sh", "-c", "grep ' / ' /proc/mounts; echo from-guest > /written; sync")
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(r.stdout, "/dev/vda / ext4 rw") {
		t.Fatalf("root is not the virtio disk:\n%s", r.stdout)
	}
	out, err := exec.Command("debugfs", "-R", "cat /written", raw).Output()
	if err != nil || strings.TrimSpace(string(out)) != "from-guest" {
		t.Fatalf("guest write not in the raw image: %q %v", out, err)
	}
	b, err := os.ReadFile(stats)
	if err != nil {
		t.Fatal(err)
	}
	var st runStats
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	if st.Backend != "virtio-blk" || st.ReadySeconds <= 0 || st.StartSeconds < st.ReadySeconds || st.FirstOutput < st.StartSeconds {
		t.Fatalf("stats timings: %+v", st)
	}
	if len(st.AtEnd) != 1 || st.AtEnd[0].Role != "qemu" || !st.AtEnd[0].ServesRootfs || st.AtEnd[0].HWMKiB == 0 || st.AtEnd[0].Error != "" {
		t.Fatalf("stats processes: %s", b)
	}
	// The guest read its rootfs through QEMU: with O_DIRECT and aio=threads
	// that is preadv, counted in rchar.
	if st.AtStart[0].RChar <= st.AtReady[0].RChar {
		t.Fatalf("QEMU read nothing between ready and start: %s", b)
	}
}
