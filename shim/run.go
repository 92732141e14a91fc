package shim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kata-fsx/kata-fsx/blk"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/config"
)

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// RunCommand is `kata-fsx run`: it boots a one-off pod VM through the same
// sandbox code the shim uses, runs one command in it, streams its output,
// tears everything down and returns the command's exit status.
func RunCommand(ctx context.Context, args []string, stdout, stderr io.Writer, defaultConfig string) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (default: the usual lookup)")
	backend := fs.String("backend", "", "virtio-fs, virtio-9p or imagefs-blk (default: the configuration's policy)")
	rootfs := fs.String("rootfs", "", "the container's root filesystem: a host directory, or for imagefs-blk dir:PATH, layers:L1:L2:..., oci:PATH[:TAG], oci-archive:PATH[:TAG]")
	keep := fs.Bool("keep", false, "leave the VM running after the command and print how to reach it")
	id := fs.String("id", "", "sandbox id (default: run-<random>)")
	var anns stringList
	fs.Var(&anns, "annotation", "pod annotation key=value (repeatable)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kata-fsx run [--config F] [--backend virtio-fs|virtio-9p|imagefs-blk] --rootfs SOURCE [--annotation k=v]... [--keep] -- CMD [ARGS...]")
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
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
		return 1
	}
	c, err := config.Load(*cfgPath, defaultConfig)
	if err != nil {
		return fail(err)
	}
	switch *backend {
	case "", config.SharedFSVirtioFS, config.SharedFS9P, config.SharedFSImagefsBlk:
	default:
		return fail(fmt.Errorf("--backend %q: use virtio-fs, virtio-9p or imagefs-blk", *backend))
	}
	var (
		dir   string
		idx   *index.Index
		rspec = config.Rootfs{Kind: config.RootfsDir}
	)
	if kind, rest, ok := strings.Cut(*rootfs, ":"); ok && (kind == "dir" || kind == "layers" || kind == "oci" || kind == "oci-archive") {
		if kind == "dir" {
			dir = rest
		} else {
			if *backend != config.SharedFSImagefsBlk {
				return fail(fmt.Errorf("--rootfs %s: only --backend imagefs-blk reads layers and OCI images; virtio-fs and virtio-9p share a directory", *rootfs))
			}
			if idx, err = blk.IndexSource(ctx, *rootfs, filepath.Join(c.KataFSX.ImagefsBlk.StateDir, "cache")); err != nil {
				return fail(fmt.Errorf("--rootfs %s: %w", *rootfs, err))
			}
			rspec = config.Rootfs{Kind: config.RootfsImage, ImageRef: *rootfs}
		}
	} else {
		dir = *rootfs
	}
	if idx == nil {
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
	code, err := runOne(ctx, runRequest{
		sandbox: SandboxSpec{ID: *id, Config: c, Annotations: annotations, Backend: *backend, Hostname: *id,
			Rootfs: rspec, RootfsIndex: idx},
		rootfs: dir, args: cmd, keep: *keep,
	}, stdout, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kata-fsx run: %v\n", err)
	}
	return code
}

type runRequest struct {
	sandbox SandboxSpec
	rootfs  string
	args    []string
	keep    bool
}

// exitNotExecutable is the shell's status for a command that cannot run.
const exitNotExecutable = 127

func runOne(ctx context.Context, r runRequest, stdout, stderr io.Writer) (int, error) {
	sb, err := NewSandbox(ctx, r.sandbox)
	if err != nil {
		return 1, err
	}
	fmt.Fprintf(stderr, "kata-fsx run: sandbox %s: backend %s (%s)\n", sb.ID, sb.Decision.Backend, sb.Decision.Reason)
	stopped := false
	defer func() {
		if !stopped {
			if err := sb.Stop(context.Background()); err != nil {
				fmt.Fprintf(stderr, "kata-fsx run: teardown: %v\n", err)
			}
		}
	}()
	cid := r.sandbox.ID
	spec := &specs.Spec{
		Version:  specs.Version,
		Hostname: r.sandbox.Hostname,
		Root:     &specs.Root{Path: "rootfs"},
		Process: &specs.Process{
			Args: r.args, Cwd: "/",
			Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=xterm"},
		},
	}
	if err := sb.CreateContainer(ctx, ContainerSpec{ID: cid, RootfsDir: r.rootfs, OCI: spec}); err != nil {
		return 1, err
	}
	a := sb.Agent()
	var copies sync.WaitGroup
	streams := func() {
		copies.Add(2)
		go func() { defer copies.Done(); io.Copy(stdout, a.StreamReader(ctx, cid, cid, false)) }()
		go func() { defer copies.Done(); io.Copy(stderr, a.StreamReader(ctx, cid, cid, true)) }()
	}
	if err := a.StartContainer(ctx, cid); err != nil {
		err = sb.explain(fmt.Errorf("start %q: %w", strings.Join(r.args, " "), err))
		if status.Code(errors.Unwrap(err)) == codes.NotFound || status.Code(err) == codes.NotFound {
			return exitNotExecutable, err
		}
		return 1, err
	}
	streams()
	type result struct {
		code int32
		err  error
	}
	waited := make(chan result, 1)
	go func() {
		code, err := a.WaitProcess(ctx, cid, cid)
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
		return 1, sb.explain(fmt.Errorf("wait for %q: %w", strings.Join(r.args, " "), res.err))
	}
	// The streams end at EOF once the process is gone; bound the wait in
	// case the agent never reports it.
	done := make(chan struct{})
	go func() { copies.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
	if r.keep {
		stopped = true
		fmt.Fprintf(stderr, "kata-fsx run: --keep: sandbox %s left running in %s (QEMU pid %d, agent socket %s/agent.sock); stop it with: kill %d && rm -rf %s\n",
			sb.ID, sb.Dir, sb.vm.Pid(), sb.Dir, sb.vm.Pid(), sb.Dir)
	}
	return int(res.code), nil
}
