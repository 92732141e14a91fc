// Command coldbench measures a pod's cold start from an OCI registry, side
// by side in one run: pulling and unpacking the image before the pod
// (skopeo, then kata-fsx's oci: source) against imagefs-blk reading a
// registry: image lazily, with and without a prefetch trace, on a warm
// node, and from a fully local image. The registry (Debian's
// docker-registry) runs in a network namespace of the benchmark's own,
// reached over a veth pair whose host end counts the bytes and carries
// tc shaping (1 Gbit/s, 100 Mbit/s, or the veth's full speed). It writes
// docs/bench/coldstart.json and the cold-start section of
// docs/benchmarks.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// linkSpeed is one shaping of the registry's link.
type linkSpeed struct {
	Name string `json:"name"`
	Bits uint64 `json:"bits_per_second"` // 0: unshaped
}

var linkSpeeds = map[string]linkSpeed{
	"full":    {"full speed (unshaped veth)", 0},
	"1gbit":   {"1 Gbit/s", 1_000_000_000},
	"100mbit": {"100 Mbit/s", 100_000_000},
}

// Modes, in the order one image × link runs them.
const (
	modePull     = "pull-and-unpack"
	modeLocal    = "fully local"
	modeLazy     = "lazy, cold node"
	modeWarm     = "lazy, warm node"
	modePrefetch = "lazy, cold node, prefetch"
	modeRecord   = "lazy, trace recording run"
)

type options struct {
	cache, bin, baseConfig string
	images, links          []string
	largeFiles, largeMiB   int
	jsonOut, mdOut         string
	prepare                bool
	podTimeout             time.Duration
}

func main() {
	var o options
	var images, links string
	flag.StringVar(&o.cache, "cache", "build/cache", "fixture cache directory (the bench image and the generated OCI layout)")
	flag.StringVar(&o.bin, "bin", "bin/kata-fsx", "the kata-fsx binary")
	flag.StringVar(&o.baseConfig, "config", "build/configuration.toml", "configuration every node's own is derived from")
	flag.StringVar(&images, "images", "bench,large", "images to run: bench (the bench image), large (plus ~1 GiB of file data)")
	flag.StringVar(&links, "links", "full,1gbit,100mbit", "registry links: full (unshaped), 1gbit, 100mbit")
	flag.IntVar(&o.largeFiles, "large-files", 8, "files in the large image's extra layer")
	flag.IntVar(&o.largeMiB, "large-file-mib", 128, "MiB per file of the large layer")
	flag.StringVar(&o.jsonOut, "json", "docs/bench/coldstart.json", "raw results")
	flag.StringVar(&o.mdOut, "md", "docs/benchmarks.md", "Markdown file whose cold-start section is replaced")
	flag.BoolVar(&o.prepare, "prepare", false, "build the cached OCI layout and exit")
	renderOnly := flag.Bool("render", false, "rewrite the Markdown section from the -json file of an earlier run and exit")
	flag.DurationVar(&o.podTimeout, "pod-timeout", 10*time.Minute, "longest one pod (pull included) may take")
	flag.Parse()
	if *renderOnly {
		if err := render(o.jsonOut, o.mdOut); err != nil {
			fatal(err)
		}
		return
	}
	o.images = strings.Split(images, ",")
	o.links = strings.Split(links, ",")
	for _, l := range o.links {
		if _, ok := linkSpeeds[l]; !ok {
			fatal(fmt.Errorf("-links: %q is not one of full, 1gbit, 100mbit", l))
		}
	}
	for _, i := range o.images {
		if i != tagBench && i != tagLarge {
			fatal(fmt.Errorf("-images: %q is not one of bench, large", i))
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := benchmain(ctx, o); err != nil {
		stop()
		fatal(err)
	}
}

func benchmain(ctx context.Context, o options) error {
	for _, tool := range []struct{ name, pkg string }{{"ip", "iproute2"}, {"tc", "iproute2"}, {"skopeo", "skopeo"}, {"docker-registry", "docker-registry"}, {"tar", "tar"}} {
		if _, err := exec.LookPath(tool.name); err != nil {
			return fmt.Errorf("%s is not installed (apt-get install %s)", tool.name, tool.pkg)
		}
	}
	rootfs, err := fixture("bench-image.sh", o.cache)
	if err != nil {
		return fmt.Errorf("bench image (test/fixtures/bench-image.sh): %w", err)
	}
	layout := filepath.Join(o.cache, "coldbench", "oci")
	sizes, err := buildLayout(layout, rootfs, o.largeFiles, o.largeMiB, logf)
	if err != nil {
		return err
	}
	if o.prepare {
		for _, t := range sortedTags(sizes) {
			logf("coldbench: %s: %d layers, %.1f MiB compressed, %.1f MiB uncompressed", t, sizes[t].Layers, mib(sizes[t].CompressedBytes), mib(sizes[t].UncompressedBytes))
		}
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("coldbench needs root (network namespaces, tc, QEMU)")
	}
	for _, p := range []string{o.bin, o.baseConfig} {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("%s: %w (run make build guest first)", p, err)
		}
	}
	began := time.Now()
	work, err := os.MkdirTemp("", "coldbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	lk, err := newLink(ctx, os.Getpid())
	if err != nil {
		return err
	}
	defer func() {
		if err := lk.Close(); err != nil {
			logf("coldbench: teardown: %v", err)
		}
	}()
	if err := os.MkdirAll(filepath.Join(work, "registry"), 0o755); err != nil {
		return err
	}
	reg, err := startRegistry(ctx, lk, filepath.Join(work, "registry"))
	if err != nil {
		return err
	}
	defer reg.Stop()
	hosts, err := reg.hostsDir(work)
	if err != nil {
		return err
	}
	base, err := os.ReadFile(o.baseConfig)
	if err != nil {
		return err
	}
	b := &bencher{o: o, work: work, link: lk, reg: reg, hosts: hosts, baseConfig: string(base), sizes: sizes, layout: layout}
	rep := &report{Date: began.UTC().Format(time.RFC3339), Command: strings.TrimSpace("go run ./test/bench/coldbench " + strings.Join(os.Args[1:], " ")),
		Host: hostInfo(o.bin), LoadStart: loadAvg(), Registry: reg.Addr, Veth: lk.HostDev}
	for _, t := range o.images {
		img := sizes[t]
		img.Ref = reg.Addr + "/coldbench/" + t + ":" + t
		img.ReadFile = readFileFor(t)
		logf("coldbench: pushing %s (%.1f MiB compressed) to %s", t, mib(img.CompressedBytes), img.Ref)
		t0 := time.Now()
		if err := reg.push(ctx, layout, t, "coldbench/"+t); err != nil {
			return fmt.Errorf("pushing %s: %w", t, err)
		}
		img.PushSeconds = time.Since(t0).Seconds()
		rep.Images = append(rep.Images, img)
	}
	b.lazy = lazySupported(o.bin)
	if b.lazy != "" {
		logf("coldbench: lazy rows not run: %s", b.lazy)
	} else {
		for i := range rep.Images {
			if err := b.index(ctx, &rep.Images[i]); err != nil {
				return err
			}
		}
	}
	defer func() {
		// Whatever ran is written, even after a failure or Ctrl-C: a
		// half-hour run is never lost to its last row.
		rep.WallSeconds = time.Since(began).Seconds()
		rep.LoadEnd = loadAvg()
		if err := rep.write(o.jsonOut, o.mdOut); err != nil {
			logf("coldbench: writing the report: %v", err)
		}
	}()
	for _, img := range rep.Images {
		if b.lazy != "" {
			break
		}
		// One lazy run with prefetch on records the image's trace, which
		// the prefetch rows then replay; it is reported, not compared.
		r := b.lazyRun(ctx, img, linkSpeeds["full"], modeRecord, "", true)
		rep.Rows = append(rep.Rows, r)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	for _, ln := range o.links {
		sp := linkSpeeds[ln]
		if err := lk.Shape(ctx, sp.Bits); err != nil {
			return err
		}
		for _, img := range rep.Images {
			rows, err := b.imageRows(ctx, img, sp)
			rep.Rows = append(rep.Rows, rows...)
			if err != nil {
				return err
			}
		}
	}
	return ctx.Err()
}

// readFileFor is the file the pod reads after its first output (the
// "later read"): the bench image's node_modules tar, or one of the large
// layer's files.
func readFileFor(tag string) string {
	if tag == tagLarge {
		return "/data/blob-0"
	}
	return "/bench/node_modules.tar"
}

// lazySupported says why registry: cannot be run ("" when it can): the
// benchmark may run before `kata-fsx run --rootfs registry:` exists.
func lazySupported(bin string) string {
	out, _ := exec.Command(bin, "run", "-h").CombinedOutput()
	if !strings.Contains(string(out), "registry:") {
		return "this kata-fsx's `run --rootfs` has no registry: source"
	}
	return ""
}

// index pushes the image's lazy-read index artifact with `kata-fsx image
// index`, once, unshaped: without one every node would stream each layer
// whole to build its own, which is not what the lazy rows measure. A
// kata-fsx without the command leaves a note and no artifact.
func (b *bencher) index(ctx context.Context, img *layoutImage) error {
	out, _ := exec.Command(b.o.bin, "image").CombinedOutput()
	if !strings.Contains(string(out), "index registry:") {
		img.IndexNote = "no `kata-fsx image index` in this build: nodes index each layer by streaming it whole"
		logf("coldbench: %s: %s", img.Tag, img.IndexNote)
		return nil
	}
	dir, cfg, err := b.newNode("index", false)
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	logf("coldbench: %s: kata-fsx image index (unshaped)", img.Tag)
	t0 := time.Now()
	if err := run(ctx, b.o.bin, "image", "index", "-q", "registry:"+img.Ref, "--config", cfg); err != nil {
		return fmt.Errorf("indexing %s: %w", img.Ref, err)
	}
	img.IndexSeconds = time.Since(t0).Seconds()
	return nil
}

func fixture(script, cache string) (string, error) {
	cmd := exec.Command(filepath.Join("test", "fixtures", script), cache)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	return strings.TrimSpace(string(out)), err
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s %s\n", time.Now().UTC().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

func fatal(err error) {
	fmt.Fprintf(os.Stderr, "coldbench: %v\n", err)
	os.Exit(1)
}
