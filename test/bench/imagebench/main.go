// Command imagebench measures imagefs-blk's image synthesis against the
// tools that would otherwise make a disk image of the same tree, side by
// side in one run: kata-fsx (index + ext4 metadata, data left in place),
// mkfs.ext4 -d (copies the data) and mkfs.erofs (copies the data;
// --tar=i where the installed erofs-utils has it). It writes a JSON file
// of raw numbers and a Markdown section for docs/benchmarks.md.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/bench"
	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
)

type row struct {
	Tree        string    `json:"tree"`
	Entries     int       `json:"entries"`
	DataBytes   uint64    `json:"data_bytes"`
	Tool        string    `json:"tool"`
	Seconds     []float64 `json:"seconds"`
	Median      float64   `json:"median_seconds"`
	OutputBytes uint64    `json:"output_bytes"` // metadata stored (kata-fsx) or image file allocation (mkfs)
	Note        string    `json:"note,omitempty"`
}

func main() {
	cache := flag.String("cache", "build/cache", "fixture cache directory")
	reps := flag.Int("reps", 3, "repetitions per tool and tree")
	jsonOut := flag.String("json", "docs/bench/image.json", "raw results")
	mdOut := flag.String("md", "docs/benchmarks.md", "Markdown file whose image-synthesis section is replaced")
	flag.Parse()
	ctx := context.Background()

	trees := []struct{ name, path string }{}
	if p, err := fixture("debian-rootfs.sh", *cache); err == nil {
		trees = append(trees, struct{ name, path string }{"Debian bookworm minbase", p})
	} else {
		fmt.Fprintf(os.Stderr, "imagebench: Debian root skipped: %v\n", err)
	}
	if p, err := fixture("node-modules.sh", *cache); err == nil {
		trees = append(trees, struct{ name, path string }{"node_modules (express, react, webpack, eslint, typescript)", filepath.Join(p, "node_modules")})
	} else {
		fmt.Fprintf(os.Stderr, "imagebench: node_modules skipped: %v\n", err)
	}
	gen, err := tree100k(filepath.Join(*cache, "tree-100k"))
	if err != nil {
		fatal(err)
	}
	trees = append(trees, struct{ name, path string }{"generated: 100 000 files in 1 000 dirs", gen})

	var rows []row
	tmp, err := os.MkdirTemp("", "imagebench-")
	if err != nil {
		fatal(err)
	}
	defer os.RemoveAll(tmp)
	erofsTar := erofsHasTar()
	for _, tr := range trees {
		fmt.Fprintf(os.Stderr, "imagebench: %s (%s)\n", tr.name, tr.path)
		idx, err := hostfs.FromDir(ctx, tr.path, index.Options{})
		if err != nil {
			fatal(err)
		}
		var data uint64
		for i := range idx.Entries {
			if idx.Entries[i].Type == index.TypeRegular {
				data += uint64(idx.Entries[i].Size)
			}
		}
		k := row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "kata-fsx (index + ext4 metadata)"}
		for r := 0; r < *reps; r++ {
			runtime.GC()
			t0 := time.Now()
			ix, err := hostfs.FromDir(ctx, tr.path, index.Options{})
			if err != nil {
				fatal(err)
			}
			img, err := ext4.Build(ctx, ix, ext4.Options{})
			if err != nil {
				fatal(err)
			}
			k.Seconds = append(k.Seconds, time.Since(t0).Seconds())
			k.OutputBytes = img.Manifest.MetaBytes
			img.Close()
		}
		rows = append(rows, finish(k))
		// The synthesis alone, from the index in memory: what writing the
		// metadata costs once the tree is known.
		y := row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "kata-fsx, ext4 synthesis only (index in memory)"}
		for r := 0; r < *reps; r++ {
			runtime.GC()
			t0 := time.Now()
			img, err := ext4.Build(ctx, idx, ext4.Options{})
			if err != nil {
				fatal(err)
			}
			y.Seconds = append(y.Seconds, time.Since(t0).Seconds())
			y.OutputBytes = img.Manifest.MetaBytes
			img.Close()
		}
		rows = append(rows, finish(y))
		// A second pod on the same snapshot: the layer's index comes from
		// the per-layer cache, so only the merge and the synthesis remain.
		// The key vouches the layer is immutable, as a committed snapshot
		// is: unkeyed layers are never cached.
		icache := filepath.Join(tmp, "index-cache")
		iopts := index.Options{CacheDir: icache, LayerKeys: []string{"snapshot"}}
		if _, err := overlayfs.FromLayers(ctx, []string{tr.path}, iopts); err != nil {
			fatal(err)
		}
		c := row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "kata-fsx, layer index cached (next pod)"}
		for r := 0; r < *reps; r++ {
			runtime.GC()
			t0 := time.Now()
			ix, err := overlayfs.FromLayers(ctx, []string{tr.path}, iopts)
			if err != nil {
				fatal(err)
			}
			img, err := ext4.Build(ctx, ix, ext4.Options{})
			if err != nil {
				fatal(err)
			}
			c.Seconds = append(c.Seconds, time.Since(t0).Seconds())
			c.OutputBytes = img.Manifest.MetaBytes
			img.Close()
		}
		rows = append(rows, finish(c))
		os.RemoveAll(icache)
		sizeMB := (data*3/2)>>20 + 256 + uint64(len(idx.Entries))/64
		m := row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "mkfs.ext4 -d (copies data)"}
		for r := 0; r < *reps; r++ {
			out := filepath.Join(tmp, "ext4.img")
			os.Remove(out)
			t0 := time.Now()
			if b, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", tr.path, out, fmt.Sprintf("%dM", sizeMB)).CombinedOutput(); err != nil {
				m.Note = fmt.Sprintf("failed: %v %s", err, strings.TrimSpace(string(b)))
				break
			}
			m.Seconds = append(m.Seconds, time.Since(t0).Seconds())
			m.OutputBytes = allocated(out)
		}
		rows = append(rows, finish(m))
		e := row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "mkfs.erofs DIR (copies data)"}
		if _, err := exec.LookPath("mkfs.erofs"); err != nil {
			e.Note = "mkfs.erofs not installed"
		}
		for r := 0; e.Note == "" && r < *reps; r++ {
			out := filepath.Join(tmp, "erofs.img")
			os.Remove(out)
			t0 := time.Now()
			if b, err := exec.Command("mkfs.erofs", "-d0", out, tr.path).CombinedOutput(); err != nil {
				e.Note = fmt.Sprintf("failed: %v %s", err, strings.TrimSpace(string(b)))
				break
			}
			e.Seconds = append(e.Seconds, time.Since(t0).Seconds())
			e.OutputBytes = allocated(out)
		}
		rows = append(rows, finish(e))
		if !erofsTar {
			rows = append(rows, row{Tree: tr.name, Entries: len(idx.Entries), DataBytes: data, Tool: "mkfs.erofs --tar=i (index only)",
				Note: "not supported by the installed erofs-utils (Debian 12 ships 1.5; --tar arrived in 1.7)"})
		}
	}
	host, _ := os.Hostname()
	res := map[string]any{"date": time.Now().UTC().Format(time.RFC3339), "host": host, "cpus": runtime.NumCPU(), "go": runtime.Version(),
		"command": strings.TrimSpace("go run ./test/bench/imagebench " + strings.Join(os.Args[1:], " ")), "rows": rows}
	os.MkdirAll(filepath.Dir(*jsonOut), 0o755)
	b, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(*jsonOut, append(b, '\n'), 0o644); err != nil {
		fatal(err)
	}
	if err := bench.ReplaceSection(*mdOut, "image-synthesis", markdown(rows, res)); err != nil {
		fatal(err)
	}
	fmt.Print(markdown(rows, res))
}

func finish(r row) row {
	if len(r.Seconds) > 0 {
		s := append([]float64(nil), r.Seconds...)
		sort.Float64s(s)
		r.Median = s[len(s)/2]
	}
	return r
}

func markdown(rows []row, res map[string]any) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Run %s on %v CPUs (%s), `%s`, median of the repetitions; every tool on the same tree in the same run.\n\n",
		res["date"], res["cpus"], res["go"], res["command"])
	b.WriteString("| tree | entries | data | tool | time (median) | spread | output | time vs kata-fsx |\n|---|---:|---:|---|---:|---:|---:|---:|\n")
	base, synth := map[string]float64{}, map[string]float64{}
	for _, r := range rows {
		switch r.Tool {
		case "kata-fsx (index + ext4 metadata)":
			base[r.Tree] = r.Median
		case "kata-fsx, ext4 synthesis only (index in memory)":
			synth[r.Tree] = r.Median
		}
	}
	for _, r := range rows {
		if len(r.Seconds) == 0 {
			fmt.Fprintf(&b, "| %s | %d | %s | %s | — | — | — | %s |\n", r.Tree, r.Entries, mib(r.DataBytes), r.Tool, r.Note)
			continue
		}
		s := append([]float64(nil), r.Seconds...)
		sort.Float64s(s)
		out := mib(r.OutputBytes)
		if strings.HasPrefix(r.Tool, "kata-fsx") {
			out += fmt.Sprintf(" metadata (%.2f%% of data)", 100*float64(r.OutputBytes)/float64(max(r.DataBytes, 1)))
		} else {
			out += " image"
		}
		ratio := "1x"
		switch {
		case !strings.HasPrefix(r.Tool, "kata-fsx") && base[r.Tree] > 0 && synth[r.Tree] > 0:
			ratio = fmt.Sprintf("%.1fx the full path, %.1fx the synthesis", r.Median/base[r.Tree], r.Median/synth[r.Tree])
		case base[r.Tree] > 0 && r.Median < base[r.Tree]:
			ratio = fmt.Sprintf("%.1fx faster", base[r.Tree]/r.Median)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %.3f s | %.3f–%.3f s | %s | %s |\n", r.Tree, r.Entries, mib(r.DataBytes), r.Tool, r.Median, s[0], s[len(s)-1], out, ratio)
	}
	return b.String()
}

func mib(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func allocated(path string) uint64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return uint64(fi.Size())
}

func erofsHasTar() bool {
	out, _ := exec.Command("mkfs.erofs", "--help").CombinedOutput()
	return strings.Contains(string(out), "--tar")
}

func fixture(script, cache string) (string, error) {
	cmd := exec.Command(filepath.Join("test", "fixtures", script), cache)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	return strings.TrimSpace(string(out)), err
}

// tree100k generates (once) 100 000 small files in 1 000 directories.
func tree100k(dir string) (string, error) {
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		return filepath.Join(dir, "tree"), nil
	}
	fmt.Fprintf(os.Stderr, "imagebench: generating 100 000 files in %s (once)\n", dir)
	os.RemoveAll(dir)
	r := rand.New(rand.NewSource(100000))
	buf := make([]byte, 16384)
	for d := 0; d < 1000; d++ {
		p := filepath.Join(dir, "tree", fmt.Sprintf("dir%03d", d))
		if err := os.MkdirAll(p, 0o755); err != nil {
			return "", err
		}
		for f := 0; f < 100; f++ {
			n := 512 + r.Intn(8192)
			r.Read(buf[:n])
			if err := os.WriteFile(filepath.Join(p, fmt.Sprintf("file%03d.js", f)), buf[:n], 0o644); err != nil {
				return "", err
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, ".complete"), nil, 0o644); err != nil {
		return "", err
	}
	return filepath.Join(dir, "tree"), nil
}

func fatal(err error) {
	fmt.Fprintf(os.Stderr, "imagebench: %v\n", err)
	os.Exit(1)
}
