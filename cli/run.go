package cli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/lazyroot"
	"github.com/kata-fsx/kata-fsx/node"
	"github.com/kata-fsx/kata-fsx/sandbox"
)

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// runRun is `kata-fsx run`: it boots a one-off pod VM through the same
// sandbox code the shim uses, runs one command in it, streams its output,
// tears everything down and returns the command's exit status.
func runRun(ctx context.Context, args []string, stdout, stderr io.Writer, defaultConfig string) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (default: the usual lookup)")
	backend := fs.String("backend", "", "virtio-fs, virtio-9p, imagefs-blk, or virtio-blk (a raw image) (default: the configuration's policy)")
	rootfs := fs.String("rootfs", "", "the container's root filesystem: a host directory, or for imagefs-blk dir:PATH, layers:L1:L2:..., oci:PATH[:TAG], oci-archive:PATH[:TAG], registry:HOST/REPO[:TAG|@DIGEST] (read lazily), or for virtio-blk raw:FILE (an ext4 image)")
	keep := fs.Bool("keep", false, "leave the VM running after the command and print how to reach it")
	id := fs.String("id", "", "sandbox id (default: run-<random>)")
	statsFile := fs.String("stats-file", "", "write timings and the serving processes' I/O and memory counters to this JSON file")
	serveMetrics := fs.Bool("metrics", false, "serve the pod's metrics on shim-monitor.sock in its sandbox directory while it runs, as the shim does (docs/metrics.md)")
	var anns stringList
	fs.Var(&anns, "annotation", "pod annotation key=value (repeatable)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kata-fsx run [--config F] [--backend virtio-fs|virtio-9p|imagefs-blk|virtio-blk] --rootfs SOURCE [--annotation k=v]... [--keep] [--stats-file F] [--metrics] -- CMD [ARGS...]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cmd := fs.Args()
	if *rootfs == "" || len(cmd) == 0 {
		fs.Usage()
		return 2
	}
	// cli.Run lets a second signal kill a command whose cleanup is stuck;
	// for run that would leave the pod behind half torn down. While this
	// channel is registered SIGINT and SIGTERM never take their default
	// action, so every signal after the first only waits for the teardown
	// the first began. SIGKILL still ends run at once (the watchdog then
	// cleans up).
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	sigDone := make(chan struct{})
	defer func() {
		signal.Stop(sigs)
		close(sigDone)
	}()
	go reportSignals(sigs, sigDone, stderr)
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
		return 1
	}
	began := time.Now()
	c, err := config.Load(*cfgPath, defaultConfig)
	if err != nil {
		return fail(err)
	}
	switch *backend {
	case "", config.SharedFSVirtioFS, config.SharedFS9P, config.SharedFSImagefsBlk, sandbox.BackendVirtioBlk:
	default:
		return fail(fmt.Errorf("--backend %q: use virtio-fs, virtio-9p, imagefs-blk or virtio-blk", *backend))
	}
	var (
		dir, rawFile string
		idx          *index.Index
		lazy         *lazyroot.Root
		rspec        = config.Rootfs{Kind: config.RootfsDir}
	)
	rawPath, isRaw := strings.CutPrefix(*rootfs, "raw:")
	if (*backend == sandbox.BackendVirtioBlk) != isRaw {
		return fail(fmt.Errorf("--rootfs %s: --backend virtio-blk takes the rootfs as raw:FILE (an ext4 image), and raw: only goes with --backend virtio-blk", *rootfs))
	}
	if isRaw {
		if rawFile, err = filepath.Abs(rawPath); err != nil {
			return fail(err)
		}
		if fi, err := os.Stat(rawFile); err != nil || !fi.Mode().IsRegular() {
			return fail(fmt.Errorf("--rootfs %s: not a regular file", *rootfs))
		}
		rspec = config.Rootfs{Kind: config.RootfsOther, Why: "a raw image file"}
	} else if lazyroot.IsSource(*rootfs) {
		if *backend != config.SharedFSImagefsBlk {
			return fail(fmt.Errorf("--rootfs %s: a registry image is read lazily by --backend imagefs-blk only", *rootfs))
		}
		lazy, err = lazyroot.Open(ctx, *rootfs, node.LazyRootOptions(c, func(format string, args ...any) {
			fmt.Fprintf(stderr, "kata-fsx run: "+format+"\n", args...)
		}))
		if err != nil {
			return fail(fmt.Errorf("--rootfs %s: %w", *rootfs, err))
		}
		defer func() {
			if lazy != nil { // not handed to a sandbox: run failed before one
				lazy.Close()
			}
		}()
		idx = lazy.TakeTree()
		rspec = config.Rootfs{Kind: config.RootfsImage, ImageRef: *rootfs}
	} else if kind, rest, ok := strings.Cut(*rootfs, ":"); ok && (kind == "dir" || kind == "layers" || kind == "oci" || kind == "oci-archive") {
		if kind == "dir" {
			dir = rest
		} else {
			if *backend != config.SharedFSImagefsBlk {
				return fail(fmt.Errorf("--rootfs %s: only --backend imagefs-blk reads layers and OCI images; virtio-fs and virtio-9p share a directory", *rootfs))
			}
			entries, layer, _, _ := c.KataFSX.ImagefsBlk.Budgets()
			budgets := blk.Budgets{MaxEntries: entries, MaxLayerBytes: layer}
			if idx, err = blk.IndexSource(ctx, *rootfs, node.LayoutOf(c).BlkCache(), budgets); err != nil {
				return fail(fmt.Errorf("--rootfs %s: %w", *rootfs, err))
			}
			rspec = config.Rootfs{Kind: config.RootfsImage, ImageRef: *rootfs}
		}
	} else {
		dir = *rootfs
	}
	if idx == nil && rawFile == "" {
		if dir, err = filepath.Abs(dir); err != nil {
			return fail(err)
		}
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			return fail(fmt.Errorf("--rootfs %s: not a directory", *rootfs))
		}
		rspec.Layers = []string{dir}
	}
	annotations := map[string]string{}
	for _, a := range anns {
		k, v, ok := strings.Cut(a, "=")
		if !ok {
			return fail(fmt.Errorf("--annotation %q: want key=value", a))
		}
		annotations[k] = v
	}
	if *id == "" {
		b := make([]byte, 6)
		rand.Read(b)
		*id = "run-" + hex.EncodeToString(b)
	}
	if err := sandbox.ValidID(*id); err != nil {
		return fail(err)
	}
	// The directory is made here, not by the sandbox, so that it is
	// certainly this run's: the watchdog removes it should run die, and
	// must never remove another pod's of the same id.
	sbDir := sandbox.DirOf(c, *id)
	if err := os.MkdirAll(filepath.Dir(sbDir), 0o700); err != nil {
		return fail(fmt.Errorf("state directory: %w", err))
	}
	if err := os.Mkdir(sbDir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			err = fmt.Errorf("%w: a pod with this id runs, or a run that died left it behind along with its watchdog (remove it once no QEMU names it)", err)
		}
		return fail(fmt.Errorf("sandbox %s: %w", *id, err))
	}
	wd, err := startWatchdog(sbDir, stderr)
	if err != nil {
		os.Remove(sbDir)
		return fail(err)
	}
	defer func() {
		wd.dismiss()
		// Left empty when the pod failed before its sandbox took the
		// directory over; otherwise the teardown removed it.
		if err := os.Remove(sbDir); err != nil && !errors.Is(err, os.ErrNotExist) {
			fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
		}
	}()
	req := runRequest{
		pod: sandbox.Spec{ID: *id, Config: c, Annotations: annotations, Backend: *backend, Hostname: *id,
			Rootfs: rspec, RootfsIndex: idx, RootfsBlockFile: rawFile},
		rootfs: dir, args: cmd, keep: *keep, statsFile: *statsFile, began: began, metrics: *serveMetrics,
	}
	if lazy != nil {
		// The sandbox owns it from here: it closes it on every path.
		req.pod.RootfsLazy, req.lazy = lazy, lazy
		lazy = nil
	}
	code, err := runOne(ctx, req, stdout, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
	}
	return code
}

// reportSignals says what run does about each SIGINT or SIGTERM until
// done is closed: the first stops the pod, the others wait for that.
func reportSignals(sigs <-chan os.Signal, done <-chan struct{}, stderr io.Writer) {
	for n := 0; ; n++ {
		select {
		case sig := <-sigs:
			name := sig.String()
			if s, ok := sig.(syscall.Signal); ok {
				name = unix.SignalName(s)
			}
			if n == 0 {
				fmt.Fprintf(stderr, "kata-fsx run: %s: stopping the pod\n", name)
			} else {
				fmt.Fprintf(stderr, "kata-fsx run: %s again: the pod's teardown is under way and finishes first (SIGKILL ends kata-fsx run at once; its watchdog then removes the pod)\n", name)
			}
		case <-done:
			return
		}
	}
}

type runRequest struct {
	pod       sandbox.Spec
	rootfs    string
	args      []string
	keep      bool
	statsFile string
	metrics   bool // serve the pod's metrics socket
	began     time.Time
	lazy      *lazyroot.Root // a registry: rootfs, owned by the sandbox
}

// keepMarker ends the command's stderr in --keep mode, followed by its status.
const keepMarker = "\x00kata-fsx-exit:"

// keepArgs wraps a command so that the container outlives it (exec needs a
// running container): a shell runs it, reports its status on stderr and
// then idles on its stdin, which the agent holds open.
func keepArgs(args []string) []string {
	script := `"$@"; s=$?; printf '` + `\000kata-fsx-exit:%d\n' "$s" >&2; while read -r _; do :; done; exec sleep 2147483647`
	return append([]string{"/bin/sh", "-c", script, "kata-fsx-keep"}, args...)
}

func runOne(ctx context.Context, r runRequest, stdout, stderr io.Writer) (int, error) {
	r.pod.PruneCaches = node.AutoPrune
	sb, err := sandbox.New(ctx, r.pod)
	if err != nil {
		return 1, err
	}
	fmt.Fprintf(stderr, "kata-fsx run: sandbox %s: backend %s (%s)\n", sb.ID, sb.Decision.Backend, sb.Decision.Reason)
	// statsMu guards stats: the output pump records the first output.
	// Its holders sample /proc and the lazy store's counters and write the
	// stats file, waiting for nothing that takes statsMu.
	var statsMu sync.Mutex
	stats := &sandbox.RunStats{SandboxID: sb.ID, Backend: sb.Decision.Backend, Reason: sb.Decision.Reason,
		ReadySeconds: time.Since(r.began).Seconds(), AtReady: sb.Sample()}
	if r.lazy != nil {
		stats.Lazy = &sandbox.LazyStats{Image: r.lazy.Image.Ref.String(), IndexSource: r.lazy.Image.IndexSource, ImageBytes: r.lazy.CompressedSize()}
	}
	defer func() {
		if r.statsFile != "" {
			statsMu.Lock()
			// Sampled before teardown, while the processes still exist.
			stats.AtEnd = sb.Sample()
			if r.lazy != nil {
				st := r.lazy.Stats()
				stats.Lazy.FetchedAtEnd, stats.Lazy.RangeRequests = st.FetchedBytes, st.RangeRequests
				stats.Lazy.VerifyFailures, stats.Lazy.ReadErrors = st.VerifyFailures, st.ReadErrors
			}
			err := writeStats(r.statsFile, stats)
			statsMu.Unlock()
			if err != nil {
				fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
			}
		}
		if err := sb.Stop(context.Background()); err != nil {
			fmt.Fprintf(stderr, "kata-fsx run: teardown: %v\n", err)
		}
	}()
	if r.metrics {
		if err := sb.ServeMetrics(); err != nil {
			return 1, err
		}
		fmt.Fprintf(stderr, "kata-fsx run: metrics on %s\n", sandbox.MetricsSocket(sb.Dir))
	}
	cid := r.pod.ID
	args := r.args
	if r.keep {
		args = keepArgs(args)
	}
	spec := &specs.Spec{
		Version:  specs.Version,
		Hostname: r.pod.Hostname,
		Root:     &specs.Root{Path: "rootfs"},
		Process: &specs.Process{
			Args: args, Cwd: "/",
			Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=xterm"},
		},
	}
	if err := sb.CreateContainer(ctx, sandbox.ContainerSpec{ID: cid, RootfsDir: r.rootfs, OCI: spec}); err != nil {
		return 1, err
	}
	g := sb.Guest()
	if err := g.StartContainer(ctx, cid); err != nil {
		err = sb.Explain(fmt.Errorf("start %q: %w", strings.Join(r.args, " "), err))
		if grpcstatus.Code(err) == codes.NotFound {
			return sandbox.ExitNotExecutable, err
		}
		return 1, err
	}
	stats.StartSeconds = time.Since(r.began).Seconds()
	stats.AtStart = sb.Sample()
	sb.ContainerStarted(cid)
	streamCtx, stopStreams := context.WithCancel(ctx)
	defer stopStreams()
	keepStatus := make(chan int, 1)
	errOut := stderr
	if r.keep {
		errOut = &markerWriter{w: stderr, status: keepStatus}
	}
	// The process's first output proves it runs: the cold-start mark.
	stdout = &firstWrite{w: stdout, first: func() {
		statsMu.Lock()
		defer statsMu.Unlock()
		stats.FirstOutputSeconds = time.Since(r.began).Seconds()
		stats.AtFirstOutput = sb.Sample()
		if r.lazy != nil {
			stats.Lazy.FetchedAtFirstOutput = r.lazy.Stats().FetchedBytes
		}
	}}
	copies := pumpOutput(streamCtx, g, cid, cid, stdout, errOut)
	if r.keep {
		var code int
		select {
		case code = <-keepStatus:
		case <-sb.Failed():
			return 1, sb.Err()
		case <-ctx.Done():
			return 130, fmt.Errorf("interrupted: tearing the sandbox down")
		}
		stopStreams()
		copies.Wait()
		// A virtio-serial channel takes one host connection at a time:
		// hand it over to kata-fsx exec. Over vsock both can connect, and
		// keeping ours lets Stop destroy the sandbox through the agent.
		if g.ExclusiveChannel() {
			if err := sb.ReleaseAgent(); err != nil {
				return code, err
			}
		}
		fmt.Fprintf(stderr, "kata-fsx run: --keep: the command exited with status %d; pod %s keeps running.\n"+
			"  exec into it:  kata-fsx exec %s -- CMD [ARGS...]   (with the same --config)\n"+
			"  stop it:       Ctrl-C or SIGTERM to this process\n", code, sb.ID, sb.ID)
		select {
		case <-ctx.Done():
			return code, nil
		case <-sb.Failed():
			return 1, sb.Err()
		}
	}
	type result struct {
		code int32
		err  error
	}
	waited := make(chan result, 1)
	go func() {
		code, err := g.Wait(ctx, cid, cid)
		waited <- result{code, err}
	}()
	var res result
	select {
	case res = <-waited:
	case <-sb.Failed():
		return 1, sb.Err()
	case <-ctx.Done():
		return 130, fmt.Errorf("interrupted: tearing the sandbox down")
	}
	if res.err != nil {
		return 1, sb.Explain(fmt.Errorf("wait for %q: %w", strings.Join(r.args, " "), res.err))
	}
	// The streams end at EOF once the process is gone; bound the wait in
	// case the agent never reports it.
	done := make(chan struct{})
	go func() { copies.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
	return int(res.code), nil
}

// firstWrite calls first before the first write reaches w.
type firstWrite struct {
	w     io.Writer
	once  sync.Once
	first func()
}

func (f *firstWrite) Write(p []byte) (int, error) {
	f.once.Do(f.first)
	return f.w.Write(p)
}

// pumpOutput copies a process's stdout and stderr from the agent until they
// end (or ctx does); wait on the result for both to be drained.
func pumpOutput(ctx context.Context, g *sandbox.Guest, cid, eid string, stdout, stderr io.Writer) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); io.Copy(stdout, g.Output(ctx, cid, eid, false)) }()
	go func() { defer wg.Done(); io.Copy(stderr, g.Output(ctx, cid, eid, true)) }()
	return &wg
}

// pumpInput copies in to a process's stdin until in ends, then closes the
// process's stdin; a process that exits first ends the copy with an error
// from the agent, which is not worth reporting.
func pumpInput(ctx context.Context, g *sandbox.Guest, cid, eid string, in io.Reader, stderr io.Writer) {
	buf := make([]byte, 256<<10)
	for {
		n, rerr := in.Read(buf)
		if n > 0 {
			if _, err := g.WriteStdin(ctx, cid, eid, buf[:n]); err != nil {
				return
			}
		}
		if rerr != nil {
			if rerr != io.EOF {
				fmt.Fprintf(stderr, "kata-fsx exec: stdin: %v\n", rerr)
			}
			if err := g.CloseStdin(ctx, cid, eid); err != nil && ctx.Err() == nil {
				fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
			}
			return
		}
	}
}

// markerWriter passes stderr through until the --keep wrapper's marker,
// whose status it reports instead of printing.
type markerWriter struct {
	w      io.Writer
	buf    []byte
	status chan<- int
	seen   bool
}

func (m *markerWriter) Write(p []byte) (int, error) {
	if m.seen {
		return len(p), nil
	}
	m.buf = append(m.buf, p...)
	if i := strings.Index(string(m.buf), keepMarker); i >= 0 {
		if j := strings.IndexByte(string(m.buf[i:]), '\n'); j >= 0 {
			m.w.Write(m.buf[:i])
			code, _ := strconv.Atoi(string(m.buf[i+len(keepMarker) : i+j]))
			m.seen = true
			m.status <- code
		}
		return len(p), nil
	}
	// Hold back only what could be the start of a marker.
	keep := max(0, len(m.buf)-len(keepMarker))
	if _, err := m.w.Write(m.buf[:keep]); err != nil {
		return 0, err
	}
	m.buf = append(m.buf[:0], m.buf[keep:]...)
	return len(p), nil
}

// runExec is `kata-fsx exec ID -- CMD`: it runs a command in the
// container of a pod that `kata-fsx run --keep` left running, and returns
// the command's exit status.
func runExec(ctx context.Context, args []string, stdout, stderr io.Writer, defaultConfig string) int {
	fs := flag.NewFlagSet("exec", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (default: the usual lookup)")
	interactive := fs.Bool("i", false, "forward this command's stdin to CMD (its end closes CMD's stdin); without -i CMD's stdin is closed")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kata-fsx exec [--config F] [-i] ID -- CMD [ARGS...]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() < 2 {
		fs.Usage()
		return 2
	}
	id, cmd := fs.Arg(0), fs.Args()[1:]
	if len(cmd) > 0 && cmd[0] == "--" {
		cmd = cmd[1:]
	}
	if err := sandbox.ValidID(id); err != nil || len(cmd) == 0 {
		fs.Usage()
		return 2
	}
	c, err := config.Load(*cfgPath, defaultConfig)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
		return 1
	}
	g, err := sandbox.DialGuest(ctx, c, id, 30*time.Second)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
		return 1
	}
	defer g.Close()
	b := make([]byte, 6)
	rand.Read(b)
	eid := "exec-" + hex.EncodeToString(b)
	ps, err := sandbox.NewProcessSpec(&specs.Process{Args: cmd, Cwd: "/",
		Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"}})
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
		return 1
	}
	err = g.Exec(ctx, id, eid, ps)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
		if grpcstatus.Code(err) == codes.NotFound {
			return sandbox.ExitNotExecutable
		}
		return 1
	}
	copies := pumpOutput(ctx, g, id, eid, stdout, stderr)
	if *interactive {
		go pumpInput(ctx, g, id, eid, os.Stdin, stderr)
	} else {
		// Best effort: a process that has already exited has no stdin left.
		_ = g.CloseStdin(ctx, id, eid)
	}
	// Interrupted (SIGINT/SIGTERM cancel ctx), the exec is killed in the
	// guest too: a command left running there would outlive its caller.
	// The client waits for the guest to report the process gone, so a
	// caller that sees this command return never finds it still running;
	// the bound is generous because a loaded TCG guest answers slowly.
	killed := make(chan struct{})
	stopKill := context.AfterFunc(ctx, func() {
		defer close(killed)
		kctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := g.Signal(kctx, id, eid, syscall.SIGKILL); err != nil {
			fmt.Fprintf(stderr, "kata-fsx exec: interrupted; killing %s in the guest: %v\n", eid, err)
			return
		}
		if _, err := g.Wait(kctx, id, eid); err != nil {
			fmt.Fprintf(stderr, "kata-fsx exec: interrupted; %s killed in the guest but not yet reaped: %v\n", eid, err)
		}
	})
	code, err := g.Wait(ctx, id, eid)
	if !stopKill() {
		<-killed // the client must outlive the kill
	}
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx exec: %v\n", err)
		return 1
	}
	copies.Wait()
	return int(code)
}

func writeStats(path string, st *sandbox.RunStats) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("--stats-file: %w", err)
	}
	return nil
}
