package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// bencher holds what every row needs: the link, the registry, and the
// configuration each node's own is derived from.
type bencher struct {
	o          options
	work       string
	link       *link
	reg        *registry
	hosts      string // certs.d directory naming the registry plain HTTP
	baseConfig string
	sizes      map[string]layoutImage
	layout     string
	lazy       string // why the lazy rows cannot run, "" when they can
	nodes      int
}

// row is one measured (or skipped) pod start.
type row struct {
	Image string `json:"image"`
	Link  string `json:"link"`
	Mode  string `json:"mode"`
	// FirstOutputSeconds runs from the row's start (the pull's start for
	// pull-and-unpack, `kata-fsx run`'s start otherwise) to the first
	// byte of the pod's stdout, watched from outside.
	FirstOutputSeconds float64 `json:"first_output_seconds,omitempty"`
	// ReadDoneSeconds runs from the row's start to the pod having read
	// the image's large file to its end (the "later read").
	ReadDoneSeconds float64 `json:"read_done_seconds,omitempty"`
	PullSeconds     float64 `json:"pull_seconds,omitempty"`
	// From `kata-fsx run --stats-file`, counted from the run's own start.
	RunReadySeconds       float64 `json:"run_ready_seconds,omitempty"`
	RunStartSeconds       float64 `json:"run_start_seconds,omitempty"`
	RunFirstOutputSeconds float64 `json:"run_first_output_seconds,omitempty"`
	// Bytes the registry sent over the veth (host end's rx) from the
	// row's start to the first output, and to the pod's end; tx is what
	// the host sent (requests).
	RxAtFirstOutput uint64 `json:"rx_bytes_at_first_output"`
	RxTotal         uint64 `json:"rx_bytes_total"`
	TxTotal         uint64 `json:"tx_bytes_total"`
	// FractionAtFirstOutput is RxAtFirstOutput over the image's
	// compressed size.
	FractionAtFirstOutput float64 `json:"fraction_at_first_output"`
	// RunLazy is kata-fsx's own account of a lazy rootfs's fetches
	// (the stats file's "lazy" object, kept as written), a cross-check
	// of the veth's count that excludes HTTP and TCP overhead.
	RunLazy json.RawMessage `json:"run_lazy,omitempty"`
	Skipped string          `json:"skipped,omitempty"`
	Error   string          `json:"error,omitempty"`
}

// newNode makes a fresh node: its own imagefs-blk state (index, blob and
// lazy content caches), so nothing of an earlier row is warm.
func (b *bencher) newNode(name string, prefetch bool) (dir, cfg string, err error) {
	b.nodes++
	dir = filepath.Join(b.work, fmt.Sprintf("node-%02d-%s", b.nodes, name))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", "", err
	}
	text := editConfig(b.baseConfig, map[string]map[string]string{
		"kata_fsx.imagefs_blk": {"state_dir": strconv.Quote(filepath.Join(dir, "imagefs-blk"))},
		// A node that prefetches also pushes: the record run's trace is
		// what the prefetch rows replay.
		"kata_fsx.registry": {"config_path": strconv.Quote(b.hosts), "prefetch": strconv.FormatBool(prefetch), "push_trace": strconv.FormatBool(prefetch)},
	})
	cfg = filepath.Join(dir, "configuration.toml")
	return dir, cfg, os.WriteFile(cfg, []byte(text), 0o644)
}

// imageRows runs one image on one link: pull-and-unpack then fully local
// on one node, lazy cold then warm on another, lazy with prefetch on a
// third. A failed pod is a row with its error; only a cancelled context
// stops the run.
func (b *bencher) imageRows(ctx context.Context, img layoutImage, sp linkSpeed) ([]row, error) {
	var rows []row
	dir, cfg, err := b.newNode("pull", false)
	if err != nil {
		return rows, err
	}
	oci := filepath.Join(dir, "oci")
	a := row{Image: img.Tag, Link: sp.Name, Mode: modePull}
	logf("coldbench: %s, %s: %s", img.Tag, sp.Name, a.Mode)
	t0 := time.Now()
	rx0, tx0, _ := b.link.Counters()
	pctx, cancel := context.WithTimeout(ctx, b.o.podTimeout)
	err = run(pctx, "skopeo", "--insecure-policy", "copy", "--src-tls-verify=false", "docker://"+img.Ref, "oci:"+oci+":"+img.Tag)
	cancel()
	a.PullSeconds = time.Since(t0).Seconds()
	if err != nil {
		a.Error = err.Error()
	} else {
		b.runPod(ctx, &a, img, cfg, "oci:"+oci+":"+img.Tag, t0, rx0, tx0)
	}
	rows = append(rows, a)
	if ctx.Err() != nil {
		return rows, ctx.Err()
	}
	e := row{Image: img.Tag, Link: sp.Name, Mode: modeLocal}
	if a.Error != "" {
		e.Skipped = "the pull-and-unpack row failed"
	} else {
		logf("coldbench: %s, %s: %s", img.Tag, sp.Name, e.Mode)
		t0 = time.Now()
		rx0, tx0, _ = b.link.Counters()
		b.runPod(ctx, &e, img, cfg, "oci:"+oci+":"+img.Tag, t0, rx0, tx0)
	}
	rows = append(rows, e)
	os.RemoveAll(dir)
	if ctx.Err() != nil {
		return rows, ctx.Err()
	}
	if b.lazy != "" {
		for _, m := range []string{modeLazy, modeWarm, modePrefetch} {
			rows = append(rows, row{Image: img.Tag, Link: sp.Name, Mode: m, Skipped: b.lazy})
		}
		return rows, nil
	}
	dir, cfg, err = b.newNode("lazy", false)
	if err != nil {
		return rows, err
	}
	rows = append(rows, b.lazyRun(ctx, img, sp, modeLazy, cfg, false))
	if ctx.Err() == nil {
		rows = append(rows, b.lazyRun(ctx, img, sp, modeWarm, cfg, false))
	}
	os.RemoveAll(dir)
	if ctx.Err() != nil {
		return rows, ctx.Err()
	}
	rows = append(rows, b.lazyRun(ctx, img, sp, modePrefetch, "", true))
	return rows, ctx.Err()
}

// lazyRun runs the image as registry:REF on the node whose configuration
// is cfg, or on a fresh node when cfg is "".
func (b *bencher) lazyRun(ctx context.Context, img layoutImage, sp linkSpeed, mode, cfg string, prefetch bool) row {
	r := row{Image: img.Tag, Link: sp.Name, Mode: mode}
	logf("coldbench: %s, %s: %s", img.Tag, sp.Name, mode)
	if cfg == "" {
		dir, c, err := b.newNode("lazy", prefetch)
		if err != nil {
			r.Error = err.Error()
			return r
		}
		defer os.RemoveAll(dir)
		cfg = c
	}
	t0 := time.Now()
	rx0, tx0, _ := b.link.Counters()
	b.runPod(ctx, &r, img, cfg, "registry:"+img.Ref, t0, rx0, tx0)
	return r
}

// runPod runs `kata-fsx run` with the image's command and fills r: the
// first output and the later read's end as the pod's stdout shows them,
// the veth's counters at those moments, and the run's own stats.
func (b *bencher) runPod(ctx context.Context, r *row, img layoutImage, cfg, rootfs string, t0 time.Time, rx0, tx0 uint64) {
	ctx, cancel := context.WithTimeout(ctx, b.o.podTimeout)
	defer cancel()
	statsFile := filepath.Join(filepath.Dir(cfg), "stats.json")
	os.Remove(statsFile)
	script := fmt.Sprintf("echo ready; cat %s >/dev/null && echo done", img.ReadFile)
	cmd := exec.CommandContext(ctx, b.o.bin, "run", "--config", cfg, "--backend", "imagefs-blk", "--rootfs", rootfs,
		"--stats-file", statsFile, "--", "/bin/sh", "-c", script)
	// kata-fsx run tears its VM down on SIGTERM; a kill would leave QEMU.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = time.Minute
	var stderr limitedBuffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.Error = err.Error()
		return
	}
	if err := cmd.Start(); err != nil {
		r.Error = err.Error()
		return
	}
	br := bufio.NewReader(stdout)
	var firstLine string
	if _, err := br.Peek(1); err == nil {
		r.FirstOutputSeconds = time.Since(t0).Seconds()
		rx, _, _ := b.link.Counters()
		r.RxAtFirstOutput = rx - rx0
		r.FractionAtFirstOutput = float64(r.RxAtFirstOutput) / float64(img.CompressedBytes)
		for {
			line, err := br.ReadString('\n')
			line = strings.TrimSpace(line)
			if firstLine == "" {
				firstLine = line
			}
			if line == "done" {
				r.ReadDoneSeconds = time.Since(t0).Seconds()
			}
			if err != nil {
				break
			}
		}
	}
	_, _ = io.Copy(io.Discard, br)
	werr := cmd.Wait()
	rx, tx, _ := b.link.Counters()
	r.RxTotal, r.TxTotal = rx-rx0, tx-tx0
	var errs []string
	if werr != nil {
		errs = append(errs, fmt.Sprintf("kata-fsx run: %v: %s", werr, strings.TrimSpace(stderr.String())))
	}
	if firstLine != "ready" {
		errs = append(errs, fmt.Sprintf("the pod's first output was %q, not \"ready\"", firstLine))
		r.FirstOutputSeconds = 0
	}
	if r.ReadDoneSeconds == 0 {
		errs = append(errs, "the pod never reported the later read done")
	}
	if b, err := os.ReadFile(statsFile); err == nil {
		var st struct {
			Ready       float64         `json:"ready_seconds"`
			Start       float64         `json:"start_seconds"`
			FirstOutput float64         `json:"first_output_seconds"`
			Lazy        json.RawMessage `json:"lazy"`
		}
		if err := json.Unmarshal(b, &st); err != nil {
			errs = append(errs, fmt.Sprintf("stats file: %v", err))
		}
		r.RunReadySeconds, r.RunStartSeconds, r.RunFirstOutputSeconds = st.Ready, st.Start, st.FirstOutput
		if len(st.Lazy) > 0 && string(st.Lazy) != "null" {
			r.RunLazy = st.Lazy
		}
	} else if werr == nil {
		errs = append(errs, fmt.Sprintf("stats file: %v", err))
	}
	if len(errs) > 0 {
		r.Error = strings.Join(errs, "; ")
		if ctx.Err() != nil {
			r.Error = "interrupted (" + context.Cause(ctx).Error() + "): " + r.Error
		}
		logf("coldbench: %s, %s, %s: %s", r.Image, r.Link, r.Mode, r.Error)
		return
	}
	logf("coldbench: %s, %s, %s: first output %.2f s, later read done %.2f s, %.1f MiB fetched before the first output (%.2f%%), %.1f MiB in all",
		r.Image, r.Link, r.Mode, r.FirstOutputSeconds, r.ReadDoneSeconds, mib(int64(r.RxAtFirstOutput)), 100*r.FractionAtFirstOutput, mib(int64(r.RxTotal)))
}

// editConfig sets keys (values already TOML) in the named tables of a
// configuration file's text, adding the keys or tables it lacks, and
// leaves every other line as it was.
func editConfig(text string, set map[string]map[string]string) string {
	done := map[string]map[string]bool{}
	var out []string
	section := ""
	flush := func() {
		keys := set[section]
		for _, k := range sortedKeys(keys) {
			if !done[section][k] {
				out = append(out, k+" = "+keys[k])
				markDone(done, section, k)
			}
		}
	}
	for _, line := range strings.Split(strings.TrimRight(text, "\n"), "\n") {
		t := strings.TrimSpace(line)
		if strings.HasPrefix(t, "[") && !strings.HasPrefix(t, "[[") {
			flush()
			section = strings.TrimSpace(strings.Trim(t, "[]"))
			out = append(out, line)
			continue
		}
		if k, _, ok := strings.Cut(t, "="); ok && !strings.HasPrefix(t, "#") {
			k = strings.TrimSpace(k)
			if v, ok := set[section][k]; ok {
				line = k + " = " + v
				markDone(done, section, k)
			}
		}
		out = append(out, line)
	}
	flush()
	for _, s := range sortedKeys(set) {
		if done[s] == nil {
			out = append(out, "", "["+s+"]")
			section = s
			flush()
		}
	}
	return strings.Join(out, "\n") + "\n"
}

func markDone(done map[string]map[string]bool, section, key string) {
	if done[section] == nil {
		done[section] = map[string]bool{}
	}
	done[section][key] = true
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }
