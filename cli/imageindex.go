package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

// imageIndex is `kata-fsx image index registry:REF`: it builds the
// lazy-read index of every layer by streaming it once and pushes them as
// an artifact referring to the image, unless a usable one is there.
func imageIndex(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("image index", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file ([kata_fsx.registry] config_path; default: the usual lookup, see kata-fsx env --help)")
	push := fs.Bool("push", true, "push the indexes as an artifact referring to the image (false: build and check them only)")
	force := fs.Bool("force", false, "build and push even when a usable index artifact is there")
	quiet := fs.Bool("q", false, "no progress lines")
	positional, err := parseInterleaved(fs, args)
	if err != nil {
		return err
	}
	if len(positional) != 1 {
		return usageError{errors.New("want exactly one registry:HOST/REPO[:TAG] source")}
	}
	name, ok := strings.CutPrefix(positional[0], "registry:")
	if !ok {
		return usageError{fmt.Errorf("source %q: image index reads images from a registry: write registry:HOST/REPO[:TAG]", positional[0])}
	}
	ref, err := registry.ParseReference(name)
	if err != nil {
		return usageError{err}
	}
	cfg, err := config.Load(*cfgPath, config.DevPath())
	if errors.Is(err, config.ErrNotFound) && *cfgPath == "" {
		cfg = config.Default()
		fmt.Fprintf(stderr, "kata-fsx image index: no configuration file; registry hosts from %s\n", cfg.KataFSX.Registry.ConfigPath)
	} else if err != nil {
		return err
	}
	entries, _, _, _ := cfg.KataFSX.ImagefsBlk.Budgets()
	opts := lazyimage.Options{Client: lazyimage.ClientFromConfig(cfg.KataFSX.Registry), MaxEntries: entries,
		MaxIndexBytes: int64(cfg.KataFSX.Registry.MaxIndexMB) << 20,
		Logf: func(format string, args ...any) {
			if !*quiet {
				fmt.Fprintf(stderr, "kata-fsx image index: "+format+"\n", args...)
			}
		}}

	start := time.Now()
	var img *lazyimage.Image
	if *force || !*push {
		img, err = lazyimage.Build(ctx, opts, ref)
	} else {
		// No node cache: what counts is what the registry holds.
		img, err = lazyimage.Resolve(ctx, opts, ref)
	}
	if err != nil {
		return err
	}
	if d, ok := img.Artifact(); ok {
		fmt.Fprintf(stderr, "%s (manifest %s) already has index artifact %s for its %d layers; --force rebuilds it\n", ref, img.ManifestDesc.Digest, d, len(img.Layers))
		fmt.Fprintln(stdout, d)
		return nil
	}
	var size int64
	entriesAll, checkpoints := 0, 0
	for i, ix := range img.Layers {
		b, err := img.Encoded(i)
		if err != nil {
			return err
		}
		size += int64(len(b))
		entriesAll += len(ix.Tree.Entries)
		checkpoints += len(ix.Checkpoints)
	}
	summary := fmt.Sprintf("%d layers, %d entries, %d checkpoints, %s of indexes", len(img.Layers), entriesAll, checkpoints, human(uint64(size)))
	if !*push {
		fmt.Fprintf(stdout, "indexed %s (manifest %s): %s in %.1fs; not pushed (--push=false)\n", ref, img.ManifestDesc.Digest, summary, time.Since(start).Seconds())
		return nil
	}
	d, err := lazyimage.Push(ctx, opts, img)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "pushed index artifact %s for %s (manifest %s): %s in %.1fs\n", d.Digest, ref, img.ManifestDesc.Digest, summary, time.Since(start).Seconds())
	fmt.Fprintln(stdout, d.Digest)
	return nil
}
