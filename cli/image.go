package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/ext4"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/overlay"
	"github.com/kata-fsx/kata-fsx/blk/rawimage"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/node"
)

const imageUsage = `usage: kata-fsx image COMMAND

  build SOURCE -o DIR [--writable-size SIZE] [--journal=false] [--journal-size SIZE] [--cache DIR]
        SOURCE: dir:PATH | layers:L1:L2:... (lowest first) | oci:PATH[:TAG] | oci-archive:PATH[:TAG]
                | registry:HOST/REPO[:TAG|@DIGEST] (file data stays in the registry; serve reads it on demand)
  inspect DIR [--json]
  export DIR --raw OUT [--overlay FILE]
  serve DIR --socket PATH [--overlay FILE] [--read-only] [--queues N]
  index registry:HOST/REPO[:TAG] [--config F] [--push=true] [--force] [-q]
        build each layer's lazy-read index and push them as an artifact referring to the image
`

// buildInfoFile records how an image directory was built.
const buildInfoFile = "build.json"

// BuildInfo is what `image build` records beside the image for `inspect`.
type BuildInfo struct {
	Source string `json:"source"`
	// Resolved pins a registry: source to the manifest digest the image
	// was built from, so that serving it reads exactly those layers.
	Resolved     string    `json:"resolved,omitempty"`
	Started      time.Time `json:"started"`
	IndexSeconds float64   `json:"index_seconds"`
	BuildSeconds float64   `json:"synthesis_seconds"`
	Entries      int       `json:"entries"`
}

func runImage(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, imageUsage)
		return 2
	}
	var err error
	switch args[0] {
	case "build":
		err = imageBuild(ctx, args[1:], stdout, stderr)
	case "inspect":
		err = imageInspect(args[1:], stdout, stderr)
	case "export":
		err = imageExport(ctx, args[1:], stdout, stderr)
	case "serve":
		err = imageServe(ctx, args[1:], stdout, stderr)
	case "index":
		err = imageIndex(ctx, args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, imageUsage)
		return 0
	default:
		fmt.Fprintf(stderr, "kata-fsx image: unknown command %q\n\n%s", args[0], imageUsage)
		return 2
	}
	var ue usageError
	if errors.As(err, &ue) || errors.Is(err, blk.ErrSourceSpec) {
		fmt.Fprintf(stderr, "kata-fsx image %s: %v\n\n%s", args[0], err, imageUsage)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx image %s: %v\n", args[0], err)
		return 1
	}
	return 0
}

type usageError struct{ error }

// parseInterleaved parses args with fs, allowing flags after positional
// arguments, and returns the positional ones in order.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for rest := args; len(rest) > 0; rest = fs.Args()[1:] {
		if err := fs.Parse(rest); err != nil {
			return nil, usageError{err}
		}
		if fs.NArg() == 0 {
			break
		}
		positional = append(positional, fs.Arg(0))
	}
	return positional, nil
}

// parseSize reads sizes such as 512M, 2G, 1048576 (bytes).
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	if n := len(s); n > 0 {
		switch strings.ToUpper(s[n-1:]) {
		case "K":
			mult, s = 1<<10, s[:n-1]
		case "M":
			mult, s = 1<<20, s[:n-1]
		case "G":
			mult, s = 1<<30, s[:n-1]
		case "T":
			mult, s = 1<<40, s[:n-1]
		}
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 || v > (1<<62)/mult {
		return 0, fmt.Errorf("size %q: want a number of bytes with an optional K, M, G or T suffix", s)
	}
	return v * mult, nil
}

// defaultCacheDir is the index and blob cache: $KATA_FSX_CACHE, else the
// configured imagefs-blk state directory's cache/.
func defaultCacheDir() string {
	if d := os.Getenv("KATA_FSX_CACHE"); d != "" {
		return d
	}
	if c, err := config.Load("", config.DevPath()); err == nil {
		return node.LayoutOf(c).BlkCache()
	}
	return node.LayoutOf(config.Default()).BlkCache()
}

func imageBuild(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	fs := flag.NewFlagSet("image build", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("o", "", "output image directory")
	writable := fs.String("writable-size", "1G", "free space added for guest writes (sparse)")
	journal := fs.Bool("journal", true, "give the filesystem a journal")
	journalSize := fs.String("journal-size", "16M", "journal size")
	cache := fs.String("cache", "", "index and blob cache directory (default: $KATA_FSX_CACHE or <imagefs_blk.state_dir>/cache)")
	quiet := fs.Bool("q", false, "no progress output")
	maxMeta := fs.String("max-metadata", "", "metadata budget (default: kata_fsx.imagefs_blk.max_metadata_mb)")
	maxMem := fs.String("max-build-memory", "", "build memory budget (default: kata_fsx.imagefs_blk.max_build_memory_mb)")
	// Flags may follow the source, as in the usage line.
	positional, err := parseInterleaved(fs, args)
	if err != nil {
		return err
	}
	if len(positional) != 1 || *out == "" {
		return usageError{errors.New("want exactly one SOURCE and -o DIR")}
	}
	ws, err := parseSize(*writable)
	if err != nil {
		return usageError{fmt.Errorf("--writable-size: %w", err)}
	}
	js, err := parseSize(*journalSize)
	if err != nil {
		return usageError{fmt.Errorf("--journal-size: %w", err)}
	}
	if *cache == "" {
		*cache = defaultCacheDir()
	}
	budgets, err := buildBudgets(*maxMeta, *maxMem)
	if err != nil {
		return err
	}
	// A build that fails or is interrupted leaves no output directory it
	// created: a half-written image must not be mistaken for one.
	if _, serr := os.Lstat(*out); errors.Is(serr, os.ErrNotExist) {
		defer func() {
			if err != nil {
				os.RemoveAll(*out)
			}
		}()
	}
	progress := newProgress(stderr, *quiet)
	defer progress.Finish()

	info := BuildInfo{Source: positional[0], Started: time.Now().UTC()}
	progress.Describe("indexing " + positional[0])
	t0 := time.Now()
	var idx *index.Index
	if lazyroot.IsSource(positional[0]) {
		// Only the tree is needed: the metadata holds no file data.
		lazy, err := openLazy(ctx, positional[0], false, func(format string, args ...any) {
			progress.Describe(fmt.Sprintf(format, args...))
		})
		if err != nil {
			return err
		}
		defer lazy.Close()
		idx = lazy.Tree
		pinned := lazy.Image.Ref
		pinned.Tag, pinned.Digest = "", lazy.Image.ManifestDesc.Digest
		info.Resolved = lazyroot.Prefix + pinned.String()
	} else if idx, err = blk.IndexSource(ctx, positional[0], *cache, budgets); err != nil {
		return err
	}
	info.IndexSeconds = time.Since(t0).Seconds()
	info.Entries = len(idx.Entries)
	progress.Describe(fmt.Sprintf("synthesizing ext4 metadata for %d entries", len(idx.Entries)))
	t1 := time.Now()
	opts := ext4.Options{WritableSize: ws, JournalSize: js, NoJournal: !*journal,
		MaxMetadataBytes: budgets.MaxMetadataBytes, MaxBuildMemory: budgets.MaxBuildMemory}
	// The metadata file is made beside the output, so that writing it
	// there copies within one file system (and not into a tmpfs /tmp).
	if st, err := os.Stat(filepath.Dir(filepath.Clean(*out))); err == nil && st.IsDir() {
		opts.TempDir = filepath.Dir(filepath.Clean(*out))
	}
	if ws == 0 {
		opts.WritableSize = -1
	}
	img, err := ext4.Build(ctx, idx, opts)
	if err != nil {
		return err
	}
	defer img.Close()
	info.BuildSeconds = time.Since(t1).Seconds()
	progress.Describe("writing " + *out)
	if err = img.WriteTo(*out); err != nil {
		return err
	}
	if err = ctx.Err(); err != nil {
		return fmt.Errorf("interrupted while writing %s: %w", *out, err)
	}
	b, _ := json.MarshalIndent(info, "", "  ")
	if err = os.WriteFile(filepath.Join(*out, buildInfoFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	progress.Finish()
	mf := img.Manifest
	fmt.Fprintf(stdout, "built %s: %d entries, %s of metadata, %s of data left in place, %s disk (indexed in %.2fs, synthesized in %.2fs)\n",
		*out, len(idx.Entries), human(mf.MetaBytes), human(mf.DataBytes), human(mf.SizeBytes), info.IndexSeconds, info.BuildSeconds)
	return nil
}

// imageOpener returns what reads a built image's file data: for an image
// built from a registry: source the node's lazy store (its build.json
// pins the manifest), else this host's files and blob cache.
func imageOpener(ctx context.Context, dir, cache string, prefetch bool, stderr io.Writer, cmd string) (index.Opener, func(), error) {
	info, err := readBuildInfo(dir)
	if err != nil {
		return nil, nil, err
	}
	if info == nil || !lazyroot.IsSource(info.Resolved) {
		return &hostfs.Opener{CacheDir: cache}, func() {}, nil
	}
	lazy, err := openLazy(ctx, info.Resolved, prefetch, func(format string, args ...any) {
		fmt.Fprintf(stderr, "kata-fsx image "+cmd+": "+format+"\n", args...)
	})
	if err != nil {
		return nil, nil, fmt.Errorf("image %s was built from %s: %w", dir, info.Resolved, err)
	}
	lazy.Started()
	return lazy.Opener(), func() { lazy.Close() }, nil
}

// readBuildInfo reads an image directory's build.json; nil when there is
// none (an image built before it was written).
func readBuildInfo(dir string) (*BuildInfo, error) {
	p := filepath.Join(dir, buildInfoFile)
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, nil
	}
	var info BuildInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	return &info, nil
}

// openLazy opens a registry: image as the configuration says, with its
// prefetch only when prefetch is also true.
func openLazy(ctx context.Context, spec string, prefetch bool, logf func(string, ...any)) (*lazyroot.Root, error) {
	c := config.Default()
	if lc, err := config.Load("", config.DevPath()); err == nil {
		c = lc
	}
	o := node.LazyRootOptions(c, logf)
	o.Registry.Prefetch = o.Registry.Prefetch && prefetch
	return lazyroot.Open(ctx, spec, o)
}

// buildBudgets returns the metadata and build memory budgets: the flags
// when given, else the configuration's.
func buildBudgets(maxMeta, maxMem string) (blk.Budgets, error) {
	b := config.Default().KataFSX.ImagefsBlk
	if c, err := config.Load("", config.DevPath()); err == nil {
		b = c.KataFSX.ImagefsBlk
	}
	entries, layer, meta, mem := b.Budgets()
	out := blk.Budgets{MaxEntries: entries, MaxLayerBytes: layer, MaxMetadataBytes: meta, MaxBuildMemory: mem}
	for _, f := range []struct {
		name, v string
		dst     *int64
	}{{"--max-metadata", maxMeta, &out.MaxMetadataBytes}, {"--max-build-memory", maxMem, &out.MaxBuildMemory}} {
		if f.v == "" {
			continue
		}
		v, err := parseSize(f.v)
		if err != nil || v == 0 {
			return out, usageError{fmt.Errorf("%s: want a positive size, e.g. 512M: %q", f.name, f.v)}
		}
		*f.dst = v
	}
	return out, nil
}

// progress shows what long work is doing, on a terminal or a log.
type progress struct{ bar *progressbar.ProgressBar }

func newProgress(w io.Writer, quiet bool) *progress {
	if quiet {
		return &progress{}
	}
	return &progress{bar: progressbar.NewOptions(-1,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionShowElapsedTimeOnFinish(),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionThrottle(100*time.Millisecond),
	)}
}

func (p *progress) Describe(s string) {
	if p.bar != nil {
		p.bar.Describe(s)
		_ = p.bar.RenderBlank()
	}
}

func (p *progress) Finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}

// ImageSummary is `image inspect --json`.
type ImageSummary struct {
	Dir               string         `json:"dir"`
	BlockSize         uint32         `json:"block_size"`
	SizeBytes         uint64         `json:"size_bytes"`
	MetadataBytes     uint64         `json:"metadata_bytes"`
	DataBytes         uint64         `json:"data_bytes"`
	FreeBytes         uint64         `json:"free_bytes"`
	JournalBytes      uint64         `json:"journal_bytes"`
	Inodes            uint64         `json:"inodes"`
	UsedInodes        uint64         `json:"used_inodes"`
	Entries           map[string]int `json:"entries_by_type"`
	Features          []string       `json:"features"`
	MapExtents        int            `json:"map_extents"`
	Sources           int            `json:"sources"`
	Build             *BuildInfo     `json:"build,omitempty"`
	MetadataPctOfData float64        `json:"metadata_pct_of_data"`
}

func imageInspect(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("image inspect", flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print JSON")
	dir, err := parseDirArg(fs, args)
	if err != nil {
		return err
	}
	img, err := ext4.Open(dir)
	if err != nil {
		return err
	}
	defer img.Close()
	mf := img.Manifest
	s := ImageSummary{Dir: dir, BlockSize: mf.BlockSize, SizeBytes: mf.SizeBytes, MetadataBytes: mf.MetaBytes,
		DataBytes: mf.DataBytes, JournalBytes: mf.Journal, Inodes: mf.Inodes, UsedInodes: mf.UsedInodes,
		Entries: mf.Counts, Features: mf.Features, MapExtents: mf.Extents, Sources: len(mf.Sources)}
	s.FreeBytes = freeBytes(img)
	if mf.DataBytes > 0 {
		s.MetadataPctOfData = 100 * float64(mf.MetaBytes) / float64(mf.DataBytes)
	}
	// A damaged build.json only loses the build section of the summary.
	s.Build, _ = readBuildInfo(dir)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(s)
	}
	fmt.Fprintf(stdout, "image      %s\n", dir)
	if s.Build != nil {
		fmt.Fprintf(stdout, "source     %s\nbuilt      %s (index %.2fs, synthesis %.2fs)\n", s.Build.Source, s.Build.Started.Format(time.RFC3339), s.Build.IndexSeconds, s.Build.BuildSeconds)
	}
	fmt.Fprintf(stdout, "disk       %s (%d blocks of %d bytes)\n", human(s.SizeBytes), mf.Blocks, s.BlockSize)
	fmt.Fprintf(stdout, "metadata   %s (%.2f%% of data)\n", human(s.MetadataBytes), s.MetadataPctOfData)
	fmt.Fprintf(stdout, "data       %s, left in place in %d source(s)\n", human(s.DataBytes), s.Sources)
	fmt.Fprintf(stdout, "journal    %s\n", human(s.JournalBytes))
	fmt.Fprintf(stdout, "free       %s\n", human(s.FreeBytes))
	fmt.Fprintf(stdout, "inodes     %d used of %d\n", s.UsedInodes, s.Inodes)
	var kinds []string
	for k := range s.Entries {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(stdout, "  %-9s %d\n", k, s.Entries[k])
	}
	fmt.Fprintf(stdout, "features   %s\n", strings.Join(s.Features, " "))
	return nil
}

// freeBytes counts the blocks no extent claims (the map lists only used
// ranges) plus any listed as free.
func freeBytes(img *ext4.Image) uint64 {
	used := uint64(0)
	for i := 0; i < img.Map.Len(); i++ {
		if e := img.Map.At(i); e.Kind != blockmap.Free {
			used += e.Count
		}
	}
	return (img.Map.Blocks() - used) * uint64(img.Map.BlockSize())
}

func parseDirArg(fs *flag.FlagSet, args []string) (string, error) {
	var dir string
	rest := args
	for {
		if err := fs.Parse(rest); err != nil {
			return "", usageError{err}
		}
		if fs.NArg() == 0 {
			break
		}
		if dir != "" {
			return "", usageError{errors.New("want exactly one DIR")}
		}
		dir, rest = fs.Arg(0), fs.Args()[1:]
	}
	if dir == "" {
		return "", usageError{errors.New("want an image DIR")}
	}
	return dir, nil
}

func imageExport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("image export", flag.ContinueOnError)
	fs.SetOutput(stderr)
	raw := fs.String("raw", "", "write the full raw ext4 filesystem to this file")
	ovl := fs.String("overlay", "", "include the guest writes kept in this overlay (as 'serve --overlay' left it)")
	cache := fs.String("cache", "", "blob cache the image was built with (default as for build)")
	dir, err := parseDirArg(fs, args)
	if err != nil {
		return err
	}
	if *raw == "" {
		return usageError{errors.New("--raw OUT is required")}
	}
	if *cache == "" {
		*cache = defaultCacheDir()
	}
	img, err := ext4.Open(dir)
	if err != nil {
		return err
	}
	defer img.Close()
	opener, closeOpener, err := imageOpener(ctx, dir, *cache, false, stderr, "export")
	if err != nil {
		return err
	}
	defer closeOpener()
	f, err := os.OpenFile(*raw, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	p := newProgress(stderr, false)
	p.Describe(fmt.Sprintf("exporting %s of filesystem to %s", human(img.Manifest.SizeBytes), *raw))
	if *ovl != "" {
		err = exportWithOverlay(ctx, img, *ovl, opener, f)
	} else {
		err = ext4.Export(ctx, img, opener, f)
	}
	p.Finish()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(*raw)
		return err
	}
	fmt.Fprintf(stdout, "exported %s to %s\n", dir, *raw)
	return nil
}

// exportWithOverlay writes the disk as the guest sees it: the image with
// the overlay's blocks on top. Blocks that read as zeros stay holes.
func exportWithOverlay(ctx context.Context, img *ext4.Image, overlayPath string, opener index.Opener, out *os.File) error {
	if _, err := os.Stat(overlayPath); err != nil {
		return fmt.Errorf("overlay: %w", err)
	}
	base := rawimage.New(img, opener)
	defer base.Close()
	dev, err := overlay.Open(base, base.Size(), overlayPath, overlay.Options{BlockSize: int(img.Manifest.BlockSize), ReadOnly: true})
	if err != nil {
		return fmt.Errorf("overlay %s: %w", overlayPath, err)
	}
	defer dev.Close()
	if err := out.Truncate(dev.Size()); err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < dev.Size(); off += int64(len(buf)) {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(int64(len(buf)), dev.Size()-off)
		if _, err := dev.ReadAt(buf[:n], off); err != nil {
			return fmt.Errorf("read disk at %d: %w", off, err)
		}
		if allZero(buf[:n]) {
			continue
		}
		if _, err := out.WriteAt(buf[:n], off); err != nil {
			return err
		}
	}
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func imageServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("image serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sock := fs.String("socket", "", "vhost-user socket to listen on (created 0600; its directory 0700)")
	ovl := fs.String("overlay", "", "sparse file for guest writes (with FILE.dirty beside it); reopening it resumes")
	ro := fs.Bool("read-only", false, "refuse guest writes (no overlay needed)")
	queues := fs.Int("queues", 1, "most queues a frontend may use (QEMU's num-queues)")
	cache := fs.String("cache", "", "blob cache the image was built with (default as for build)")
	dir, err := parseDirArg(fs, args)
	if err != nil {
		return err
	}
	if *sock == "" {
		return usageError{errors.New("--socket PATH is required")}
	}
	if *ovl == "" && !*ro {
		return usageError{errors.New("--overlay FILE is required unless --read-only")}
	}
	if *cache == "" {
		*cache = defaultCacheDir()
	}
	opener, closeOpener, err := imageOpener(ctx, dir, *cache, true, stderr, "serve")
	if err != nil {
		return err
	}
	defer closeOpener()
	opts := blk.Options{CacheDir: *cache, NumQueues: *queues, ReadOnly: *ro, Opener: opener}
	d, err := blk.Serve(ctx, dir, *ovl, *sock, opts)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "serving %s (%s) on %s; overlay %s; stop with Ctrl-C\n", dir, human(d.Image.Manifest.SizeBytes), *sock, *ovl)
	<-ctx.Done()
	if err := d.Close(); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	fmt.Fprintln(stdout, "stopped; overlay flushed")
	return nil
}

func human(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
